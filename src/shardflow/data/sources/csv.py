"""decode_csv: CSV records to one numpy array per column, with tf.io.decode_csv's rules for quotes and defaults.

A batch of plain records goes through pyarrow's reader in one call; anything else (quotes, stray line breaks,
an error to report) through the RFC 4180 parser below, record by record, which is the reference.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from shardflow.data.sources.csv_arrow import decode_with_arrow
from shardflow.data.sources.csv_format import STRING, CsvFormat
from shardflow.data.sources.errors import CsvRecordError

_DTYPE_NAMES = {np.dtype(np.float32): "float", np.dtype(np.float64): "double", np.dtype(np.int32): "int32"}


def decode_csv(
    records: Any,
    record_defaults: Sequence[Any],
    field_delim: str = ",",
    use_quote_delim: bool = True,
    na_value: str = "",
    select_cols: Sequence[int] | None = None,
) -> list[Any]:
    """Decode CSV records as tf.io.decode_csv: one output per column of `record_defaults`, shaped like `records`.

    `records` is one record (bytes or str; the outputs are then numpy scalars, bytes for strings) or an array or
    list of them (numpy arrays; strings as object arrays of bytes). An empty or na_value field takes its column's
    default; a required column without a value, a wrong number of fields or an unparsable number raises
    CsvRecordError naming the record.
    """
    csv_format = CsvFormat.cached(record_defaults, field_delim, use_quote_delim, na_value, select_cols)
    if isinstance(records, str | bytes | np.str_ | np.bytes_):
        return [column[0] for column in decode_lines([_as_bytes(records)], csv_format)]
    array = np.asarray(records, dtype=object)
    lines = array.reshape(-1).tolist()
    if set(map(type, lines)) - {bytes}:
        lines = [_as_bytes(line) for line in lines]
    return [column.reshape(array.shape) for column in decode_lines(lines, csv_format)]


def _as_bytes(value: Any) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


def decode_lines(
    lines: list[bytes], csv_format: CsvFormat, empty_record_is_a_field: bool = False
) -> list[npt.NDArray[Any]]:
    """The columns of a batch of records, each a 1-D array. An empty record has no fields (decode_csv), or one
    empty field with `empty_record_is_a_field` (CsvDataset)."""
    columns = decode_with_arrow(lines, b"\n".join(lines), csv_format)
    if columns is not None:
        return columns
    table = _split_each(lines, csv_format, empty_record_is_a_field)
    return [_convert(table[:, index], index, csv_format, lines) for index in range(len(csv_format.columns))]


def _split_each(lines: list[bytes], csv_format: CsvFormat, empty_record_is_a_field: bool = False) -> npt.NDArray[Any]:
    table = np.empty((len(lines), len(csv_format.columns)), dtype=object)
    needed = _fields_needed(csv_format)
    for index, line in enumerate(lines):
        try:
            fields = split_record(line, csv_format.field_delim, csv_format.use_quote_delim)
        except ValueError as error:
            raise CsvRecordError(index, str(error), line) from None
        if not fields and empty_record_is_a_field:
            fields = [b""]
        if csv_format.select_cols is None:
            if len(fields) != needed:
                raise CsvRecordError(index, f"expected {needed} fields but found {len(fields)}", line)
            table[index] = fields
        else:
            if len(fields) < needed:
                found = sum(column < len(fields) for column in csv_format.select_cols)
                raise CsvRecordError(index, f"expected {len(csv_format.columns)} fields but found {found}", line)
            table[index] = [fields[column] for column in csv_format.select_cols]
    return table


def _fields_needed(csv_format: CsvFormat) -> int:
    return len(csv_format.columns) if csv_format.select_cols is None else csv_format.select_cols[-1] + 1


def split_record(record: bytes, delim: bytes, use_quote_delim: bool) -> list[bytes]:
    """The fields of one record (RFC 4180, as TensorFlow reads it). An empty record has no fields."""
    fields: list[bytes] = []
    size = len(record)
    position = 0
    while position < size or (fields and record[position - 1 : position] == delim):
        if use_quote_delim and record[position : position + 1] == b'"':
            field, position = _quoted_field(record, position + 1, delim)
        else:
            end = record.find(delim, position)
            end = size if end < 0 else end
            field = record[position:end]
            if (use_quote_delim and b'"' in field) or b"\n" in field or b"\r" in field:
                raise ValueError("unquoted fields cannot have quotes or line breaks inside")
            position = end
        fields.append(field)
        position += 1  # past the delimiter (or the end)
        if position > size:
            break
    return fields


def _quoted_field(record: bytes, position: int, delim: bytes) -> tuple[bytes, int]:
    """The field whose opening quote is just before `position`, and the position after its closing quote."""
    pieces = []
    while True:
        quote = record.find(b'"', position)
        if quote < 0:
            raise ValueError("a quoted field has to end with a quote followed by the delimiter or the record's end")
        pieces.append(record[position:quote])
        after = record[quote + 1 : quote + 2]
        if after == b'"':  # an escaped quote
            pieces.append(b'"')
            position = quote + 2
        elif after in (b"", delim):
            return b"".join(pieces), quote + 1
        else:
            raise ValueError("a quote inside a quoted field has to be escaped by another quote")


def _convert(fields: npt.NDArray[Any], index: int, csv_format: CsvFormat, lines: list[bytes]) -> npt.NDArray[Any]:
    """Column `index` of the batch in its dtype, defaults filled in."""
    spec = csv_format.columns[index]
    column_number = index if csv_format.select_cols is None else csv_format.select_cols[index]
    missing = fields == b""
    if csv_format.na_value:
        missing |= fields == csv_format.na_value
    if not missing.any():
        return _parse(fields, np.arange(fields.size), spec.dtype, column_number, lines)
    if spec.default is None:
        record = int(np.flatnonzero(missing)[0])
        raise CsvRecordError(record, f"field {column_number} is required but missing", lines[record])
    present = ~missing
    column = np.empty(fields.size, dtype=spec.dtype)
    column[missing] = spec.default
    column[present] = _parse(fields[present], np.flatnonzero(present), spec.dtype, column_number, lines)
    return column


def _parse(
    fields: npt.NDArray[Any],
    records: npt.NDArray[np.int64],
    dtype: np.dtype[Any],
    column_number: int,
    lines: list[bytes],
) -> npt.NDArray[Any]:
    if dtype == STRING:
        return fields
    try:
        with np.errstate(over="ignore"):  # TensorFlow too turns an out-of-range float into inf
            return fields.astype(dtype)
    except (ValueError, OverflowError):
        pass
    parse = float if dtype.kind == "f" else int
    for position, field in enumerate(fields.tolist()):
        try:
            dtype.type(parse(field))
        except (ValueError, OverflowError):
            record = int(records[position])
            name = _DTYPE_NAMES.get(dtype, str(dtype))
            raise CsvRecordError(
                record, f"field {column_number} is not a valid {name}: {field!r}", lines[record]
            ) from None
    raise AssertionError("a column failed to convert but none of its fields did")
