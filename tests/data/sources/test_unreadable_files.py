"""A file no reader can read is one error naming it: under ignore_errors() one counted skip, then the next file."""

from __future__ import annotations

import gzip
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from shardflow.data.dataset import Dataset
from shardflow.data.sources import (
    CsvDataset,
    DataLossError,
    FixedLengthRecordDataset,
    ParquetDataset,
    TextLineDataset,
    TFRecordDataset,
    TFRecordWriter,
    files,
)

# A regression here is a loop that never returns: fail it instead.
pytestmark = pytest.mark.timeout(60)

GARBAGE = np.random.default_rng(24).bytes(3000)


def _parquet(path: Path, start: int) -> None:
    table = pa.table({"id": np.arange(start, start + 5, dtype=np.int64), "name": [f"n{i}" for i in range(5)]})
    pq.write_table(table, path, row_group_size=2)


def _tfrecord(path: Path, start: int) -> None:
    with TFRecordWriter(str(path)) as writer:
        for index in range(start, start + 3):
            writer.write(b"record %d" % index)


# name: (dataset over the files, write a good file whose records start at `start`, content of an unreadable file)
READERS: dict[str, tuple[Callable[[list[str]], Dataset[Any]], Callable[[Path, int], object], bytes]] = {
    "parquet, not parquet": (ParquetDataset, _parquet, GARBAGE),
    "tfrecord, garbage": (TFRecordDataset, _tfrecord, GARBAGE),
    "csv gzip, not gzip": (
        lambda files: CsvDataset(files, [0, 0], compression_type="GZIP"),
        lambda path, start: path.write_bytes(gzip.compress(b"%d,1\n%d,2\n" % (start, start + 1))),
        GARBAGE,
    ),
    "text lines gzip, not gzip": (
        lambda files: TextLineDataset(files, compression_type="GZIP"),
        lambda path, start: path.write_bytes(gzip.compress(b"line %d\nline %d\n" % (start, start + 1))),
        GARBAGE,
    ),
    "fixed length, shorter than its header": (
        lambda files: FixedLengthRecordDataset(files, record_bytes=4, header_bytes=8),
        lambda path, start: path.write_bytes(b"header::" + b"%04d%04d" % (start, start + 1)),
        b"short",
    ),
}


def _files(tmp_path: Path, reader: str) -> tuple[list[str], str]:
    """Three files, the middle one unreadable: the paths, and the unreadable one's."""
    _, write_good, bad_content = READERS[reader]
    write_good(tmp_path / "first", 0)
    (tmp_path / "unreadable").write_bytes(bad_content)
    write_good(tmp_path / "last", 100)
    paths = [str(tmp_path / name) for name in ("first", "unreadable", "last")]
    return paths, paths[1]


def _as_comparable(element: Any) -> Any:
    if isinstance(element, dict):
        return {name: value.item() if hasattr(value, "item") else value for name, value in element.items()}
    return element


@pytest.mark.parametrize("reader", READERS)
def test_under_ignore_errors_an_unreadable_file_is_one_counted_skip_and_the_other_files_are_read_whole(
    tmp_path, reader
):
    paths, _ = _files(tmp_path, reader)
    make = READERS[reader][0]
    expected = [_as_comparable(e) for e in list(make(paths[:1])) + list(make(paths[2:]))]
    elements = iter(make(paths).ignore_errors())
    assert [_as_comparable(e) for e in elements] == expected
    assert elements.num_skipped == 1  # type: ignore[attr-defined]


@pytest.mark.parametrize("reader", READERS)
def test_without_ignore_errors_an_unreadable_file_raises_an_error_naming_it_and_reading_goes_on(tmp_path, reader):
    paths, unreadable = _files(tmp_path, reader)
    make = READERS[reader][0]
    elements = iter(make(paths))
    first = list(make(paths[:1]))
    assert [_as_comparable(next(elements)) for _ in first] == [_as_comparable(e) for e in first]
    with pytest.raises(DataLossError, match=rf"{unreadable}: .* at byte offset \d+") as caught:
        next(elements)
    assert caught.value.filename == unreadable
    assert [_as_comparable(e) for e in elements] == [_as_comparable(e) for e in make(paths[2:])]


def test_a_truncated_parquet_file_is_one_counted_skip_and_its_error_names_the_footer(tmp_path):
    _parquet(tmp_path / "first.parquet", 0)
    whole = (tmp_path / "first.parquet").read_bytes()
    truncated = tmp_path / "truncated.parquet"
    truncated.write_bytes(whole[: len(whole) // 2])
    paths = [str(tmp_path / "first.parquet"), str(truncated)]
    rows = iter(ParquetDataset(paths).ignore_errors())
    assert [int(row["id"]) for row in rows] == [0, 1, 2, 3, 4]
    assert rows.num_skipped == 1  # type: ignore[attr-defined]
    with pytest.raises(DataLossError, match="not a readable Parquet file") as caught:
        list(ParquetDataset(str(truncated)))
    assert (caught.value.filename, caught.value.offset) == (str(truncated), len(whole) // 2 - 8)


def test_a_damaged_parquet_row_group_names_the_file_and_where_the_row_group_starts(tmp_path):
    path = tmp_path / "damaged.parquet"
    _parquet(path, 0)
    second = pq.ParquetFile(path).metadata.row_group(1).column(0).data_page_offset
    content = bytearray(path.read_bytes())
    content[second : second + 40] = bytes(byte ^ 0xFF for byte in content[second : second + 40])
    path.write_bytes(bytes(content))
    with pytest.raises(DataLossError, match=r"damaged\.parquet: cannot decode row group \d") as caught:
        list(ParquetDataset(str(path)))
    assert caught.value.filename == str(path)
    rows = iter(ParquetDataset([str(path), str(path)]).ignore_errors())
    list(rows)
    assert rows.num_skipped == 2  # type: ignore[attr-defined]  # once per file, however many rows it lost


def test_an_unreadable_file_read_in_parallel_is_one_counted_skip(tmp_path):
    paths, _ = _files(tmp_path, "tfrecord, garbage")
    records = iter(TFRecordDataset(paths, num_parallel_reads=3).ignore_errors())
    assert sorted(records) == sorted([b"record %d" % index for index in (0, 1, 2, 100, 101, 102)])
    assert records.num_skipped == 1  # type: ignore[attr-defined]


class _FailingFile:
    """A file whose reads fail, as on a failing disk."""

    def read(self, size: int) -> bytes:
        raise OSError(5, os.strerror(5))

    def close(self) -> None:
        pass


def test_a_read_that_fails_names_the_file_and_reading_goes_on_with_the_next(tmp_path, monkeypatch):
    for name in ("failing.txt", "next.txt"):
        (tmp_path / name).write_bytes(b"a\nb\n")
    real_open = files.open_to_read
    monkeypatch.setattr(
        files, "open_to_read", lambda name: _FailingFile() if name.endswith("failing.txt") else real_open(name)
    )
    lines = iter(TextLineDataset([str(tmp_path / "failing.txt"), str(tmp_path / "next.txt")]))
    with pytest.raises(OSError, match=r"Input/output error at byte offset 0") as caught:
        next(lines)
    assert caught.value.filename == str(tmp_path / "failing.txt")
    assert list(lines) == [b"a", b"b"]
