"""CSV files at the edges of the format read as tf.data reads them: line breaks inside quoted fields, lone "\\r"
line endings, empty lines, and the files and record_defaults tf.data refuses."""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tensorflow as tf

from shardflow import data
from shardflow.data import errors


@dataclasses.dataclass(frozen=True)
class Lib:
    name: str
    CsvDataset: Any
    make_csv_dataset: Any
    decode_csv: Any


TF = Lib("tf", tf.data.experimental.CsvDataset, tf.data.experimental.make_csv_dataset, tf.io.decode_csv)
SF = Lib("shardflow", data.CsvDataset, data.make_csv_dataset, data.decode_csv)


@pytest.fixture(params=[TF, SF], ids=lambda lib: lib.name)
def lib(request: pytest.FixtureRequest) -> Lib:
    return request.param


def write(tmp_path: Path, content: bytes) -> str:
    path = tmp_path / "data.csv"
    path.write_bytes(content)
    return str(path)


def rows(dataset: Any) -> list[list[tuple[str, Any]]]:
    """Each row as (dtype, value) pairs, so that int32 1 and int64 1 differ."""
    return [[typed(value) for value in row] for row in dataset]


def typed(value: Any) -> tuple[str, Any]:
    array = np.asarray(value, dtype=object if isinstance(value, bytes) else None)
    return array.dtype.str, array.item()


TWO_COLUMNS = [[0], [""]]
FILES = [
    (b'1,"a\nb"\n2,"c\r\nd"\n', TWO_COLUMNS, {}),
    (b'1,"x ""quoted""\nline"\r\n2,plain', TWO_COLUMNS, {}),
    (b'id,"multi\nline name"\n1,a\n2,"b\rc"\n', TWO_COLUMNS, {"header": True}),
    (b"1,a\r2,b\r3,c", TWO_COLUMNS, {}),
    (b"1,a\r\n2,b\r3,c\n4,d\r", TWO_COLUMNS, {}),
    (b"1\n\n3\n", [[0]], {}),
    (b"a\n\nc\n\n", [["missing"]], {}),
    (b"1\r\n\r\n3", [[0]], {}),
    (b"", [[0]], {}),
    (b"name\n", [[0]], {"header": True}),
    (b'1;"semi;colon\n"\n2;x\n', TWO_COLUMNS, {"field_delim": ";"}),
    (b'1,"a\nb"\n', TWO_COLUMNS, {"use_quote_delim": False}),
]


@pytest.mark.parametrize("buffer_size", [None, 1, 3])
@pytest.mark.parametrize(("content", "defaults", "options"), FILES)
def test_csv_dataset_records_equal_tf(
    tmp_path: Path, content: bytes, defaults: list[Any], options: dict[str, Any], buffer_size: int | None
) -> None:
    name = write(tmp_path, content)

    def read(lib: Lib) -> list[list[tuple[str, Any]]]:
        return rows(lib.CsvDataset(name, defaults, buffer_size=buffer_size, **options).ignore_errors())

    assert read(SF) == read(TF)


@pytest.mark.parametrize(
    "content",
    [b"1,a\n\n3,c\n", b"1,a\r\r2,b\n", b'1,"never closed\n2,b\n', b"1,a,extra\n2,b\n"],
    ids=["empty_line", "lone_cr_twice", "unclosed_quote", "extra_field"],
)
def test_malformed_records_raise_invalid_argument(tmp_path: Path, lib: Lib, content: bytes) -> None:
    name = write(tmp_path, content)
    expected = tf.errors.InvalidArgumentError if lib is TF else errors.InvalidArgumentError
    with pytest.raises(expected):
        list(lib.CsvDataset(name, TWO_COLUMNS))


def test_empty_file_with_a_header_raises_invalid_argument(tmp_path: Path, lib: Lib) -> None:
    name = write(tmp_path, b"")
    expected = tf.errors.InvalidArgumentError if lib is TF else errors.InvalidArgumentError
    with pytest.raises(expected):
        list(lib.CsvDataset(name, [[0]], header=True))


@pytest.mark.parametrize("defaults", [[np.zeros((1, 1), np.int32)], [[0], np.array([[1.0]], np.float32)]])
def test_decode_csv_refuses_record_defaults_of_rank_two(lib: Lib, defaults: list[Any]) -> None:
    expected = tf.errors.InvalidArgumentError if lib is TF else errors.InvalidArgumentError
    with pytest.raises(expected):
        lib.decode_csv(["1,2"], defaults)


def test_csv_dataset_refuses_nested_list_record_defaults(tmp_path: Path, lib: Lib) -> None:
    name = write(tmp_path, b"1\n")
    expected = tf.errors.InvalidArgumentError if lib is TF else errors.InvalidArgumentError
    with pytest.raises(expected):
        list(lib.CsvDataset(name, [[[0]]]))


def test_make_csv_dataset_keeps_the_columns_in_file_order(tmp_path: Path) -> None:
    names = [str(index) for index in range(1, 13)]
    name = write(tmp_path, (",".join(names) + "\n" + ",".join(names) + "\n").encode())

    def columns(lib: Lib) -> list[tuple[str, str, Any]]:
        batches = lib.make_csv_dataset(name, batch_size=1, shuffle=False, num_epochs=1)
        (batch,) = list(batches.as_numpy_iterator())
        return [(key, value.dtype.str, value.tolist()) for key, value in batch.items()]

    assert columns(SF) == columns(TF)


@pytest.mark.parametrize("content", [FILES[1][0], FILES[4][0], b'1,"a\nb"\r\n\r\n2,"c"\r3,d'])
def test_csv_dataset_restores_between_multi_line_records(tmp_path: Path, content: bytes) -> None:
    dataset = data.CsvDataset(write(tmp_path, content), [[0], ["missing"]], buffer_size=4).ignore_errors()
    expected = rows(dataset)
    iterator = iter(dataset)
    for done in range(len(expected) + 1):
        restored = iter(dataset)
        restored.set_state(json.loads(json.dumps(iterator.get_state())))
        assert rows(restored) == expected[done:]
        next(iterator, None)


def test_make_csv_dataset_reads_a_header_with_a_quoted_line_break_as_tf(tmp_path: Path) -> None:
    name = write(tmp_path, b'id,"full\nname"\n1,"x\ny"\n2,z\n')

    def columns(lib: Lib) -> list[tuple[str, Any]]:
        (batch,) = list(lib.make_csv_dataset(name, batch_size=2, shuffle=False, num_epochs=1).as_numpy_iterator())
        return [(key, value.tolist()) for key, value in batch.items()]

    assert columns(SF) == columns(TF)
