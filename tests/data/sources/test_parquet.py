"""ParquetDataset: rows or batches of columns, strings as bytes, column selection and exact resume."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from shardflow.data.sources import ParquetDataset


@pytest.fixture
def files(tmp_path):
    """Two files of 7 and 3 rows, in row groups of 3 rows."""
    paths = []
    for name, start, stop in (("a", 0, 7), ("b", 100, 103)):
        table = pa.table(
            {
                "id": np.arange(start, stop, dtype=np.int64),
                "name": [f"n{index}" for index in range(start, stop)],
                "score": np.arange(start, stop) / 2,
            }
        )
        paths.append(str(tmp_path / f"{name}.parquet"))
        pq.write_table(table, paths[-1], row_group_size=3)
    return paths


def test_without_batch_size_each_element_is_one_row_of_numpy_scalars_and_bytes(files):
    rows = list(ParquetDataset(files))
    assert len(rows) == 10
    assert rows[0] == {"id": 0, "name": b"n0", "score": 0.0}
    assert rows[7] == {"id": 100, "name": b"n100", "score": 50.0}
    assert type(rows[0]["id"]) is np.int64


def test_with_batch_size_elements_are_column_batches_that_do_not_span_files(files):
    batches = list(ParquetDataset(files, columns=["id", "name"], batch_size=4))
    assert [batch["id"].tolist() for batch in batches] == [[0, 1, 2, 3], [4, 5, 6], [100, 101, 102]]
    assert list(batches[0]) == ["id", "name"]
    assert batches[1]["name"].dtype == object and batches[1]["name"].tolist() == [b"n4", b"n5", b"n6"]


@pytest.mark.parametrize("batch_size", [None, 2, 4])
def test_resume_mid_row_group_and_across_files_gives_exactly_the_remaining_elements(files, check_resume, batch_size):
    elements = check_resume(ParquetDataset(files, batch_size=batch_size))
    assert sum(len(np.atleast_1d(element["id"])) for element in elements) == 10


def test_state_counts_rows_of_the_current_file(files):
    rows = iter(ParquetDataset(files, batch_size=2))
    next(rows), next(rows)
    assert rows.get_state() == {"file_index": 0, "row": 4}


def test_a_missing_file_raises_file_not_found_naming_it(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"missing\.parquet"):
        list(ParquetDataset(str(tmp_path / "missing.parquet")))
