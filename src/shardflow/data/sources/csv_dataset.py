"""CsvDataset (the decoded rows of CSV files) and make_csv_dataset (batches of feature dicts and labels)."""

from __future__ import annotations

import collections
import glob
import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from shardflow.data.dataset import Dataset
from shardflow.data.sources.csv import decode_lines, split_record
from shardflow.data.sources.csv_format import CsvFormat
from shardflow.data.sources.errors import CsvRecordError, InvalidRecordError
from shardflow.data.sources.files import ByteStream, compression_type_name
from shardflow.data.sources.reader import FileDataset, RecordReader
from shardflow.data.sources.text import LineReader

Row = tuple[Any, ...]


class CsvDataset(FileDataset[Row]):
    """The records of CSV files as tuples of numpy scalars, one per column of `record_defaults`
    (tf.data.experimental.CsvDataset). A record that cannot be decoded raises InvalidRecordError naming the file
    and line, after the records before it; iterating on continues after it.

    Records are lines (TextLineDataset's), so a quoted field cannot span lines. Iterator state:
    {"file_index", "offset": byte offset of the next line, "record_index": lines read, header included}.
    """

    def __init__(
        self,
        filenames: object,
        record_defaults: Sequence[Any],
        compression_type: str | None = None,
        buffer_size: int | None = None,
        header: bool = False,
        field_delim: str = ",",
        use_quote_delim: bool = True,
        na_value: str = "",
        select_cols: Sequence[int] | None = None,
        exclude_cols: Sequence[int] | None = None,
    ) -> None:
        super().__init__(filenames)
        if exclude_cols is not None:
            if select_cols is not None:
                raise ValueError("give select_cols or exclude_cols, not both")
            excluded = set(exclude_cols)
            select_cols = [index for index in range(len(record_defaults) + len(excluded)) if index not in excluded]
        self.csv_format = CsvFormat.of(record_defaults, field_delim, use_quote_delim, na_value, select_cols)
        self.compression_type = compression_type_name(compression_type)
        self.buffer_size = buffer_size
        self.header = header

    def open_reader(self, filename: str, position: dict[str, Any] | None) -> CsvReader:
        position = position or {}
        stream = ByteStream(filename, self.compression_type, self.buffer_size, int(position.get("offset", 0)))
        lines = LineReader(stream, int(position.get("record_index", 0)), skip_header_lines=int(self.header))
        return CsvReader(lines, self.csv_format)


class CsvReader(RecordReader[Row]):
    """Decodes each batch of lines a column at a time; a bad line splits the batch around it."""

    def __init__(self, lines: LineReader, csv_format: CsvFormat) -> None:
        self._lines = lines
        self._csv_format = csv_format
        self._rest: list[bytes] = []  # lines of the line batch after the rows returned so far
        self._start = 0  # index in the line batch of the first line of the last row batch
        self._size = 0  # rows in the last row batch

    def read_batch(self) -> list[Row]:
        self._start += self._size
        self._size = 0
        if not self._rest:
            self._rest = self._lines.read_batch()
            self._start = 0
            if not self._rest:
                return []
        lines, self._rest = self._rest, []
        try:
            columns = decode_lines(lines, self._csv_format)
        except CsvRecordError as error:
            if error.index == 0:
                self._rest = lines[1:]
                self._start += 1  # the bad line counts as read
                line_number = self._lines.position(self._start)["record_index"]
                raise InvalidRecordError(self._lines.stream.filename, line_number, error.problem) from None
            # The rows before the bad line come first; the next call decodes the bad line again and raises.
            self._rest = lines[error.index :]
            lines = lines[: error.index]
            columns = decode_lines(lines, self._csv_format)
        rows = list(zip(*columns, strict=True))
        self._size = len(rows)
        return rows

    def position(self, count: int) -> dict[str, Any]:
        return self._lines.position(self._start + count)

    def close(self) -> None:
        self._lines.close()


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
    filenames = _matching_files(file_pattern)
    if column_names is None:
        if not header:
            raise ValueError("make_csv_dataset needs column_names when the files have no header")
        column_names = _header(filenames, field_delim, use_quote_delim, compression_type)
    column_names = list(column_names)
    if len(set(column_names)) != len(column_names):
        raise ValueError(f"column names must be unique, got {column_names}")
    select_cols = None if select_columns is None else _column_indices(select_columns, column_names)
    if column_defaults is None:
        column_defaults = _infer_defaults(
            filenames,
            len(column_names),
            select_cols,
            field_delim,
            use_quote_delim,
            na_value,
            header,
            num_rows_for_inference,
            compression_type,
        )
    if select_cols is not None:
        if len(column_defaults) != len(select_cols):
            raise ValueError(
                f"column_defaults has {len(column_defaults)} entries for {len(select_cols)} selected columns"
            )
        column_names = [column_names[index] for index in select_cols]
    if label_name is not None and label_name not in column_names:
        raise ValueError(f"label_name {label_name!r} is not one of the columns {column_names}")

    def read_file(filename: Any) -> Dataset[Row]:
        rows: Dataset[Row] = CsvDataset(
            filename,
            column_defaults,
            compression_type=compression_type,
            header=header,
            field_delim=field_delim,
            use_quote_delim=use_quote_delim,
            na_value=na_value,
            select_cols=select_cols,
        )
        return rows.ignore_errors() if ignore_errors else rows

    def to_features(*columns: npt.NDArray[Any]) -> Any:
        features = collections.OrderedDict(zip(column_names, columns, strict=True))  # as tf.data: in column order
        return features if label_name is None else (features, features.pop(label_name))

    files: Dataset[Any] = Dataset.from_tensor_slices(np.array(filenames, dtype=object))
    if shuffle:
        files = files.shuffle(len(filenames), seed=shuffle_seed)
    rows = files.interleave(
        read_file,
        cycle_length=num_parallel_reads or 1,
        block_length=1,
        num_parallel_calls=num_parallel_reads,
        deterministic=not sloppy,
    )
    if shuffle:
        rows = rows.shuffle(shuffle_buffer_size, seed=shuffle_seed)
    if num_epochs != 1:
        rows = rows.repeat(num_epochs)
    batches = rows.batch(batch_size, drop_remainder=num_epochs is None).map(to_features)
    return batches.prefetch(-1 if prefetch_buffer_size is None else prefetch_buffer_size)


def _matching_files(file_pattern: str | Sequence[str]) -> list[str]:
    patterns = [file_pattern] if isinstance(file_pattern, str | os.PathLike) else list(file_pattern)
    filenames = [name for pattern in patterns for name in sorted(glob.glob(os.fspath(pattern)))]
    if not filenames:
        raise FileNotFoundError(f"no files match {', '.join(map(str, patterns))}")
    return filenames


def _first_lines(filename: str, compression_type: str | None, num_lines: int) -> list[bytes]:
    lines: list[bytes] = []
    reader = LineReader(ByteStream(filename, compression_type))
    try:
        while len(lines) < num_lines and (batch := reader.read_batch()):
            lines.extend(batch)
    finally:
        reader.close()
    return lines[:num_lines]


def _header(filenames: list[str], field_delim: str, use_quote_delim: bool, compression_type: str | None) -> list[str]:
    headers = []
    for filename in filenames:
        first = _first_lines(filename, compression_type, 1)
        if not first:
            raise ValueError(f"{filename}: no header line (the file is empty)")
        headers.append([name.decode() for name in split_record(first[0], field_delim.encode(), use_quote_delim)])
    different = next((name for name, found in zip(filenames, headers, strict=True) if found != headers[0]), None)
    if different is not None:
        raise ValueError(f"{different}: its header differs from the one of {filenames[0]}")
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


def _infer_defaults(
    filenames: list[str],
    num_columns: int,
    select_cols: list[int] | None,
    field_delim: str,
    use_quote_delim: bool,
    na_value: str,
    header: bool,
    num_rows: int,
    compression_type: str | None,
) -> list[Any]:
    columns = select_cols if select_cols is not None else list(range(num_columns))
    narrowest = [0] * len(columns)  # index into _INFERRED; len(_INFERRED) means string
    seen = [False] * len(columns)
    rows_left = num_rows
    for filename in filenames:
        lines = _first_lines(filename, compression_type, rows_left + int(header))[int(header) :]
        for line_number, line in enumerate(lines, start=1 + int(header)):
            fields = split_record(line, field_delim.encode(), use_quote_delim)
            if len(fields) != num_columns:
                raise InvalidRecordError(
                    filename, line_number, f"expected {num_columns} fields but found {len(fields)}"
                )
            for position, column in enumerate(columns):
                text = fields[column]
                if text in (b"", na_value.encode()):
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
