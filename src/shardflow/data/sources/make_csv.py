"""make_csv_dataset: batches of (feature dict, label) from CSV files, names and types read from the files."""

from __future__ import annotations

import collections
import errno
import glob
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from shardflow.data.dataset import Dataset
from shardflow.data.errors import NotFoundError
from shardflow.data.options import AUTOTUNE
from shardflow.data.sources.csv import split_record
from shardflow.data.sources.csv_dataset import CsvDataset, Row
from shardflow.data.sources.csv_records import CsvRecordReader
from shardflow.data.sources.errors import InvalidRecordError
from shardflow.data.sources.files import ByteStream


def make_csv_dataset(
    file_pattern: str | Sequence[str],
    batch_size: int,
    column_names: Sequence[str] | None = None,
    column_defaults: Sequence[Any] | None = None,
    label_name: str | None = None,
    select_columns: Sequence[str | int] | None = None,
    field_delim: str = ",",
    use_quote_delim: bool = True,
    na_value: str = "",
    header: bool = True,
    num_epochs: int | None = None,
    shuffle: bool = True,
    shuffle_buffer_size: int = 10_000,
    shuffle_seed: int | None = None,
    prefetch_buffer_size: int | None = None,
    num_parallel_reads: int | None = None,
    sloppy: bool = False,
    num_rows_for_inference: int = 100,
    compression_type: str | None = None,
    ignore_errors: bool = False,
) -> Dataset[Any]:
    """Batches of (features dict, label) from CSV files, as tf.data.experimental.make_csv_dataset: column names
    from the header unless given, column types inferred from the first `num_rows_for_inference` rows unless
    `column_defaults` are given, files and rows shuffled unless `shuffle=False`, `num_epochs=None` repeating
    forever (and then dropping the last partial batch). Without `label_name` the elements are feature dicts."""
    files = _CsvFiles(_matching_files(file_pattern), field_delim, use_quote_delim, na_value, header, compression_type)
    columns = _columns(files, column_names, column_defaults, select_columns, num_rows_for_inference)
    if label_name is not None and label_name not in columns.names:
        raise ValueError(f"label_name {label_name!r} is not one of the columns {columns.names}")
    file_names: Dataset[Any] = Dataset.from_tensor_slices(np.array(files.filenames, dtype=object))
    if shuffle:
        file_names = file_names.shuffle(len(files.filenames), seed=shuffle_seed)
    rows = file_names.interleave(
        _file_reader(files, columns, ignore_errors),
        cycle_length=num_parallel_reads or 1,
        block_length=1,
        num_parallel_calls=num_parallel_reads,
        deterministic=not sloppy,
    )
    if shuffle:
        rows = rows.shuffle(shuffle_buffer_size, seed=shuffle_seed)
    if num_epochs != 1:
        rows = rows.repeat(num_epochs)
    batches = rows.batch(batch_size, drop_remainder=num_epochs is None).map(_to_features(columns.names, label_name))
    return batches.prefetch(AUTOTUNE if prefetch_buffer_size is None else prefetch_buffer_size)


@dataclass(frozen=True)
class _CsvFiles:
    """The files matched and how to read their records."""

    filenames: list[str]
    field_delim: str
    use_quote_delim: bool
    na_value: str
    header: bool
    compression_type: str | None

    def first_lines(self, filename: str, num_lines: int) -> list[bytes]:
        """The first records of a file, split as CsvDataset splits them (a quoted field may hold a line break)."""
        lines: list[bytes] = []
        stream = ByteStream(filename, self.compression_type)
        reader = CsvRecordReader(
            stream, 0, header=False, field_delim=self.field_delim.encode(), use_quote_delim=self.use_quote_delim
        )
        try:
            while len(lines) < num_lines and (batch := reader.read_batch()):
                lines.extend(batch)
        finally:
            reader.close()
        return lines[:num_lines]

    def split(self, line: bytes) -> list[bytes]:
        return split_record(line, self.field_delim.encode(), self.use_quote_delim)


@dataclass(frozen=True)
class _Columns:
    """The columns read: their names, their indices in the file (None: all) and their defaults, which give types."""

    names: list[str]
    indices: list[int] | None
    defaults: Sequence[Any]


def _columns(
    files: _CsvFiles,
    column_names: Sequence[str] | None,
    column_defaults: Sequence[Any] | None,
    select_columns: Sequence[str | int] | None,
    num_rows_for_inference: int,
) -> _Columns:
    """The columns given, or read from the header and inferred from the first rows where not given."""
    if column_names is None:
        if not files.header:
            raise ValueError("make_csv_dataset needs column_names when the files have no header")
        column_names = _header(files)
    names = list(column_names)
    if len(set(names)) != len(names):
        raise ValueError(f"column names must be unique, got {names}")
    indices = None if select_columns is None else _column_indices(select_columns, names)
    if column_defaults is None:
        column_defaults = _infer_defaults(files, len(names), indices, num_rows_for_inference)
    if indices is not None:
        if len(column_defaults) != len(indices):
            raise ValueError(f"column_defaults has {len(column_defaults)} entries for {len(indices)} selected columns")
        names = [names[index] for index in indices]
    return _Columns(names, indices, column_defaults)


def _file_reader(files: _CsvFiles, columns: _Columns, ignore_errors: bool) -> Callable[[Any], Dataset[Row]]:
    """The function that interleave maps each file name to: the file's rows."""

    def read_file(filename: Any) -> Dataset[Row]:
        rows: Dataset[Row] = CsvDataset(
            filename,
            columns.defaults,
            compression_type=files.compression_type,
            header=files.header,
            field_delim=files.field_delim,
            use_quote_delim=files.use_quote_delim,
            na_value=files.na_value,
            select_cols=columns.indices,
        )
        return rows.ignore_errors() if ignore_errors else rows

    return read_file


def _to_features(column_names: list[str], label_name: str | None) -> Callable[..., Any]:
    """The function that a batch's columns are mapped with: a feature dict, or (features, label)."""

    def to_features(*columns: npt.NDArray[Any]) -> Any:
        features = collections.OrderedDict(zip(column_names, columns, strict=True))  # as tf.data: in column order
        return features if label_name is None else (features, features.pop(label_name))

    return to_features


def _matching_files(file_pattern: str | Sequence[str]) -> list[str]:
    patterns = [file_pattern] if isinstance(file_pattern, str | os.PathLike) else list(file_pattern)
    filenames = [name for pattern in patterns for name in sorted(glob.glob(os.fspath(pattern)))]
    if not filenames:
        raise NotFoundError(errno.ENOENT, "no files match", ", ".join(map(str, patterns)))
    return filenames


def _header(files: _CsvFiles) -> list[str]:
    headers = []
    for filename in files.filenames:
        first = files.first_lines(filename, 1)
        if not first:
            raise ValueError(f"{filename}: no header line (the file is empty)")
        headers.append([name.decode() for name in files.split(first[0])])
    different = next((name for name, found in zip(files.filenames, headers, strict=True) if found != headers[0]), None)
    if different is not None:
        raise ValueError(f"{different}: its header differs from the one of {files.filenames[0]}")
    return headers[0]


def _column_indices(select_columns: Sequence[str | int], column_names: list[str]) -> list[int]:
    indices = []
    for column in select_columns:
        if isinstance(column, int):
            if not 0 <= column < len(column_names):
                raise ValueError(f"select_columns: column index {column} is out of range for {len(column_names)}")
            indices.append(column)
        elif column in column_names:
            indices.append(column_names.index(column))
        else:
            raise ValueError(f"select_columns: {column!r} is not one of the columns {column_names}")
    return sorted(indices)


# Types tried from the narrowest, as tf.data infers them; each column takes the narrowest that fits every value.
_INFERRED: list[tuple[Any, Callable[[bytes], bool]]] = [
    (np.int32, lambda text: _fits(text, int, np.iinfo(np.int32))),
    (np.int64, lambda text: _fits(text, int, np.iinfo(np.int64))),
    (np.float32, lambda text: _fits(text, float, np.finfo(np.float32))),
    (np.float64, lambda text: _fits(text, float, np.finfo(np.float64))),
]


def _fits(text: bytes, parse: Callable[[bytes], Any], info: Any) -> bool:
    try:
        value = parse(text)
    except ValueError:
        return False
    return bool(info.min <= value <= info.max) or not np.isfinite(value)


def _infer_defaults(files: _CsvFiles, num_columns: int, select_cols: list[int] | None, num_rows: int) -> list[Any]:
    columns = select_cols if select_cols is not None else list(range(num_columns))
    narrowest = [0] * len(columns)  # index into _INFERRED; len(_INFERRED) means string
    seen = [False] * len(columns)
    rows_left = num_rows
    header = int(files.header)
    for filename in files.filenames:
        lines = files.first_lines(filename, rows_left + header)[header:]
        for line_number, line in enumerate(lines, start=1 + header):
            fields = files.split(line)
            if len(fields) != num_columns:
                raise InvalidRecordError(
                    filename, line_number, f"expected {num_columns} fields but found {len(fields)}"
                )
            for position, column in enumerate(columns):
                text = fields[column]
                if text in (b"", files.na_value.encode()):
                    continue
                seen[position] = True
                while narrowest[position] < len(_INFERRED) and not _INFERRED[narrowest[position]][1](text):
                    narrowest[position] += 1
        rows_left -= len(lines)
        if rows_left <= 0:
            break
    return [
        np.array([0], dtype=_INFERRED[kind][0]) if found and kind < len(_INFERRED) else [""]
        for kind, found in zip(narrowest, seen, strict=True)
    ]
