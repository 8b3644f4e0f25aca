"""decode_csv: CSV records to one numpy array per column, with tf.io.decode_csv's rules for quotes and defaults.

A batch of plain records (no quotes, no stray line breaks) is split with bytes operations over the whole batch
and converted a column at a time; anything else goes through the RFC 4180 parser below, record by record.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

_STRING = np.dtype(object)
_DTYPES = {np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.int32), np.dtype(np.int64), _STRING}
_DTYPE_NAMES = {np.dtype(np.float32): "float", np.dtype(np.float64): "double", np.dtype(np.int32): "int32"}


class CsvRecordError(ValueError):
    """Record `index` of a batch cannot be decoded; `problem` says why."""

    def __init__(self, index: int, problem: str, record: bytes) -> None:
        super().__init__(f"record {index}: {problem}: {record[:200]!r}")
        self.index = index
        self.problem = problem


@dataclass(frozen=True)
class ColumnSpec:
    """One column's dtype, and its default (None: the field is required)."""

    dtype: np.dtype[Any]
    default: Any


@dataclass(frozen=True, kw_only=True)
class CsvFormat:
    """How records are split and which columns are kept (decode_csv's arguments, checked once)."""

    columns: tuple[ColumnSpec, ...]
    field_delim: bytes = b","
    use_quote_delim: bool = True
    na_value: bytes = b""
    select_cols: tuple[int, ...] | None = None

    @staticmethod
    def of(
        record_defaults: Sequence[Any],
        field_delim: str | bytes = ",",
        use_quote_delim: bool = True,
        na_value: str | bytes = "",
        select_cols: Sequence[int] | None = None,
    ) -> CsvFormat:
        delim = field_delim.encode() if isinstance(field_delim, str) else bytes(field_delim)
        if len(delim) != 1 or delim in b'"\r\n':
            raise ValueError(f"field_delim must be one character other than a quote or line break, got {delim!r}")
        columns = tuple(column_spec(default) for default in record_defaults)
        if not columns:
            raise ValueError("record_defaults is empty: give one default (or dtype) per column")
        if select_cols is not None:
            select_cols = tuple(int(index) for index in select_cols)
            if len(select_cols) != len(columns):
                raise ValueError(f"select_cols has {len(select_cols)} columns but record_defaults {len(columns)}")
            if any(index < 0 for index in select_cols) or list(select_cols) != sorted(set(select_cols)):
                raise ValueError(f"select_cols must be increasing column indices >= 0, got {list(select_cols)}")
        na = na_value.encode() if isinstance(na_value, str) else bytes(na_value)
        return CsvFormat(
            columns=columns, field_delim=delim, use_quote_delim=use_quote_delim, na_value=na, select_cols=select_cols
        )


def column_spec(default: Any) -> ColumnSpec:
    """A record_defaults entry: a one-value list or array (optional column of its type; a Python int is int32 and
    a float float32, as in TensorFlow), an empty one (required), or a dtype (required)."""
    if isinstance(default, type | np.dtype):
        return ColumnSpec(_csv_dtype(default), None)
    if isinstance(default, str | bytes):
        return ColumnSpec(_STRING, _as_bytes(default))
    if isinstance(default, list | tuple) and not default:
        return ColumnSpec(np.dtype(np.float32), None)
    values = default if isinstance(default, list | tuple) else [default]
    if isinstance(default, np.ndarray | np.generic):
        array = np.asarray(default).reshape(-1)
        dtype = _STRING if array.dtype.kind in "OSU" else _csv_dtype(array.dtype)
        return ColumnSpec(dtype, _one_default(array.tolist(), dtype) if array.size else None)
    value = values[0] if len(values) == 1 else None
    if isinstance(value, str | bytes):
        return ColumnSpec(_STRING, _one_default(values, _STRING))
    if isinstance(value, bool) or not isinstance(value, int | float | np.generic):
        raise ValueError(f"a record default must be [value], [] or a dtype, got {default!r}")
    dtype = (
        np.dtype(value.dtype)
        if isinstance(value, np.generic)
        else np.dtype(np.int32 if isinstance(value, int) else np.float32)
    )
    return ColumnSpec(_csv_dtype(dtype), _one_default(values, dtype))


def _csv_dtype(dtype: Any) -> np.dtype[Any]:
    normalized = _STRING if dtype in (str, bytes, np.str_, np.bytes_, object) else np.dtype(dtype)
    if normalized not in _DTYPES:
        raise ValueError(f"a CSV column's dtype must be float32, float64, int32, int64 or string, got {dtype!r}")
    return normalized


def _one_default(values: Sequence[Any], dtype: np.dtype[Any]) -> Any:
    if len(values) != 1:
        raise ValueError(f"a record default holds one value, got {values!r}")
    return _as_bytes(values[0]) if dtype == _STRING else dtype.type(values[0])


def _as_bytes(value: Any) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


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
    csv_format = CsvFormat.of(record_defaults, field_delim, use_quote_delim, na_value, select_cols)
    if isinstance(records, str | bytes | np.str_ | np.bytes_):
        return [column[0] for column in decode_lines([_as_bytes(records)], csv_format)]
    array = np.asarray(records, dtype=object)
    lines = [_as_bytes(record) for record in array.reshape(-1).tolist()]
    return [column.reshape(array.shape) for column in decode_lines(lines, csv_format)]


def decode_lines(lines: list[bytes], csv_format: CsvFormat) -> list[npt.NDArray[Any]]:
    """The columns of a batch of records, each a 1-D array."""
    table = _split_plain(lines, csv_format)
    if table is None:
        table = _split_each(lines, csv_format)
    return [_convert(table[:, index], index, csv_format, lines) for index in range(len(csv_format.columns))]


def _split_plain(lines: list[bytes], csv_format: CsvFormat) -> npt.NDArray[Any] | None:
    """All fields of a batch at once, or None when some record needs the full parser (or is an error)."""
    delim = csv_format.field_delim
    joined = b"\n".join(lines)
    if (csv_format.use_quote_delim and b'"' in joined) or b"\r" in joined or joined.count(b"\n") != len(lines) - 1:
        return None
    # Every record must have the same number of fields: count the delimiters of each record in one pass.
    lengths = np.fromiter(map(len, lines), np.int64, count=len(lines))
    if not lines or not lengths.all():
        return None  # an empty record has no fields at all
    delims = np.concatenate(([0], np.cumsum(np.frombuffer(joined, np.uint8) == delim[0])))
    ends = np.cumsum(lengths + 1) - 1
    counts = delims[ends] - delims[ends - lengths] + 1
    num_fields = int(counts[0])
    if (counts != num_fields).any() or num_fields < _fields_needed(csv_format):
        return None
    if csv_format.select_cols is None and num_fields != len(csv_format.columns):
        return None
    table = np.array(joined.replace(b"\n", delim).split(delim), dtype=object).reshape(len(lines), num_fields)
    return table if csv_format.select_cols is None else table[:, list(csv_format.select_cols)]


def _split_each(lines: list[bytes], csv_format: CsvFormat) -> npt.NDArray[Any]:
    table = np.empty((len(lines), len(csv_format.columns)), dtype=object)
    needed = _fields_needed(csv_format)
    for index, line in enumerate(lines):
        try:
            fields = split_record(line, csv_format.field_delim, csv_format.use_quote_delim)
        except ValueError as error:
            raise CsvRecordError(index, str(error), line) from None
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
    if dtype == _STRING:
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
