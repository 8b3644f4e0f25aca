"""Plain CSV batches decoded by pyarrow compute kernels, for decode_csv's fast path.

Only batches without quotes, carriage returns or empty records come here. The fields are split and converted by
pyarrow's C++ kernels, which run without the GIL, so a map of decode_csv on threads uses other cores. Its output is
kept only when every record has the same number of fields and every value converts: any error, and any missing value
of a required column, sends the batch back to the record-by-record parser, which words the error as TensorFlow does.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from shardflow.data.sources.csv_format import STRING, CsvFormat


def decode_with_arrow(lines: list[bytes], joined: bytes, csv_format: CsvFormat) -> list[npt.NDArray[Any]] | None:
    """The columns of `lines` (joined by newlines in `joined`), or None when the batch needs the full parser."""
    if (
        not lines
        or (csv_format.use_quote_delim and b'"' in joined)
        or b"\r" in joined
        or not all(lines)  # an empty record, which has no fields
        or b"\n" in b"".join(lines)
    ):
        return None
    import pyarrow as pa
    import pyarrow.compute as pc

    fields = pc.split_pattern(pa.array(lines, pa.binary()), csv_format.field_delim)
    num_fields = pc.list_value_length(fields)
    width = num_fields[0].as_py()
    selected = csv_format.select_cols or range(len(csv_format.columns))
    wanted = len(csv_format.columns) if csv_format.select_cols is None else selected[-1] + 1
    uneven = pc.any(pc.not_equal(num_fields, width)).as_py()
    if uneven or width < wanted or (csv_format.select_cols is None and width != wanted):
        return None
    values = fields.flatten()
    missing = pc.equal(values, b"")
    if csv_format.na_value:
        missing = pc.or_(missing, pc.equal(values, csv_format.na_value))
    if pc.any(missing).as_py():
        values = pc.if_else(missing, pa.scalar(None, pa.binary()), values)
    row_starts = np.arange(len(lines), dtype=np.int64) * width
    columns: dict[int, npt.NDArray[Any]] = {}
    # Columns of one dtype are taken and converted together: one kernel call per dtype, not per column.
    for dtype in {spec.dtype for spec in csv_format.columns}:
        indices = [index for index, spec in enumerate(csv_format.columns) if spec.dtype == dtype]
        taken = values.take((row_starts[:, None] + np.array([selected[index] for index in indices])).reshape(-1))
        try:
            converted = taken if dtype == STRING else taken.cast(pa.from_numpy_dtype(dtype))
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            return None
        block = _block(converted, [csv_format.columns[index] for index in indices], len(lines), dtype)
        if block is None:
            return None
        for position, index in enumerate(indices):
            columns[index] = block[position]
    return [columns[index] for index in range(len(csv_format.columns))]


def _block(converted: Any, specs: list[Any], num_records: int, dtype: np.dtype[Any]) -> npt.NDArray[Any] | None:
    """The converted values of these columns as one (column, record) array with defaults filled in, or None if a
    required value is missing."""
    valid = np.asarray(converted.is_valid()).reshape(num_records, len(specs)) if converted.null_count else None
    if valid is not None:
        if not all(valid[:, position].all() or spec.default is not None for position, spec in enumerate(specs)):
            return None
        converted = converted.fill_null(b"" if dtype == STRING else dtype.type(0))
    array = converted.to_numpy(zero_copy_only=False)
    if dtype == STRING and array.dtype != STRING:
        array = array.astype(object)
    block: npt.NDArray[Any] = array.reshape(num_records, len(specs)).T.copy()
    if valid is not None:
        for position, spec in enumerate(specs):
            missing = ~valid[:, position]
            if missing.any():
                block[position, missing] = spec.default
    return block
