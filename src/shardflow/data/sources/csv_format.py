"""The arguments of decode_csv checked once: each column's dtype and default, the delimiter, quotes, na_value."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from shardflow.data.errors import InvalidArgumentError

STRING = np.dtype(object)  # CSV strings are bytes in object arrays
_DTYPES = {np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.int32), np.dtype(np.int64), STRING}


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

    @staticmethod
    def cached(
        record_defaults: Sequence[Any],
        field_delim: str | bytes = ",",
        use_quote_delim: bool = True,
        na_value: str | bytes = "",
        select_cols: Sequence[int] | None = None,
    ) -> CsvFormat:
        """CsvFormat.of, remembered for the arguments a map calls decode_csv with batch after batch: checking
        record_defaults costs more than decoding a small batch."""
        arguments = (record_defaults, field_delim, use_quote_delim, na_value, select_cols)
        try:
            key = _hashable(arguments)
        except TypeError:
            return CsvFormat.of(*arguments)
        csv_format = _cached_formats.get(key)
        if csv_format is None:
            if len(_cached_formats) >= _MAX_CACHED_FORMATS:
                _cached_formats.clear()
            csv_format = _cached_formats[key] = CsvFormat.of(*arguments)
        return csv_format


_cached_formats: dict[Any, CsvFormat] = {}
_MAX_CACHED_FORMATS = 64


def _hashable(value: Any) -> Any:
    """A hashable stand-in for an argument of decode_csv that tells apart every value CsvFormat.of tells apart (a float
    by its bits, so that -0.0 is not 0.0); TypeError for anything else."""
    if isinstance(value, list | tuple):
        return (type(value), *map(_hashable, value))
    if isinstance(value, float):
        return (float, value.hex())
    if isinstance(value, np.ndarray | np.generic):
        array = np.asarray(value)
        content = tuple(array.reshape(-1).tolist()) if array.dtype == object else array.tobytes()
        return (type(value), array.dtype.str, array.shape, content)
    hash(value)
    return (type(value), value)


def column_spec(default: Any) -> ColumnSpec:
    """A record_defaults entry: a one-value list or array (optional column of its type; a Python int is int32 and
    a float float32, as in TensorFlow), an empty one (required), or a dtype (required)."""
    if isinstance(default, type | np.dtype):
        return ColumnSpec(_csv_dtype(default), None)
    if isinstance(default, str | bytes):
        return ColumnSpec(STRING, _as_bytes(default))
    if isinstance(default, list | tuple) and not default:
        return ColumnSpec(np.dtype(np.float32), None)
    values = default if isinstance(default, list | tuple) else [default]
    if isinstance(default, np.ndarray | np.generic):
        if np.ndim(default) > 1:
            raise InvalidArgumentError(f"a record default must have rank 0 or 1, got shape {np.shape(default)}")
        array = np.asarray(default).reshape(-1)
        dtype = STRING if array.dtype.kind in "OSU" else _csv_dtype(array.dtype)
        return ColumnSpec(dtype, _one_default(array.tolist(), dtype) if array.size else None)
    value = values[0] if len(values) == 1 else None
    if isinstance(value, str | bytes):
        return ColumnSpec(STRING, _one_default(values, STRING))
    if isinstance(value, bool) or not isinstance(value, int | float | np.generic):
        raise InvalidArgumentError(f"a record default must be [value], [] or a dtype, got {default!r}")
    dtype = (
        np.dtype(value.dtype)
        if isinstance(value, np.generic)
        else np.dtype(np.int32 if isinstance(value, int) else np.float32)
    )
    return ColumnSpec(_csv_dtype(dtype), _one_default(values, dtype))


def _csv_dtype(dtype: Any) -> np.dtype[Any]:
    normalized = STRING if dtype in (str, bytes, np.str_, np.bytes_, object) else np.dtype(dtype)
    if normalized not in _DTYPES:
        raise ValueError(f"a CSV column's dtype must be float32, float64, int32, int64 or string, got {dtype!r}")
    return normalized


def _one_default(values: Sequence[Any], dtype: np.dtype[Any]) -> Any:
    if len(values) != 1:
        raise ValueError(f"a record default holds one value, got {values!r}")
    return _as_bytes(values[0]) if dtype == STRING else dtype.type(values[0])


def _as_bytes(value: Any) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)
