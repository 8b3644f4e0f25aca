"""Plain CSV batches decoded by pyarrow's C++ reader, for decode_csv's fast path.

Only batches without quotes, carriage returns or empty records come here, and pyarrow's output is kept only when
it read every record whole: any error, and any missing value of a required column, sends the batch back to the
record-by-record parser, which words the error as TensorFlow does.
"""

from __future__ import annotations

import io
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
        or b"\n\n" in joined
        or not lines[0]
        or not lines[-1]
        or joined.count(b"\n") != len(lines) - 1
        or not (csv_format.field_delim + csv_format.na_value).isascii()
    ):
        return None
    import pyarrow as pa
    import pyarrow.csv as arrow_csv

    selected = csv_format.select_cols or range(len(csv_format.columns))
    names = [f"f{index}" for index in selected]  # pyarrow's names for columns it numbers itself
    types = {
        name: pa.binary() if spec.dtype == STRING else pa.from_numpy_dtype(spec.dtype)
        for name, spec in zip(names, csv_format.columns, strict=True)
    }
    null_values = sorted({"", csv_format.na_value.decode()})
    try:
        table = arrow_csv.read_csv(
            io.BytesIO(joined + b"\n"),
            read_options=arrow_csv.ReadOptions(
                autogenerate_column_names=True, use_threads=len(joined) > 1 << 20, block_size=len(joined) + 2
            ),
            parse_options=arrow_csv.ParseOptions(
                delimiter=csv_format.field_delim.decode(), quote_char=False, ignore_empty_lines=False
            ),
            convert_options=arrow_csv.ConvertOptions(
                column_types=types, include_columns=names, null_values=null_values, strings_can_be_null=True
            ),
        )
    except (pa.ArrowInvalid, pa.ArrowKeyError, KeyError):
        return None
    if table.num_rows != len(lines) or (csv_format.select_cols is None and len(table.schema) != len(names)):
        return None
    columns = []
    for name, spec in zip(names, csv_format.columns, strict=True):
        column = table.column(name)
        if column.null_count:
            if spec.default is None:
                return None
            column = column.fill_null(pa.scalar(spec.default, type=types[name]))
        columns.append(_to_numpy(column, spec.dtype))
    return columns


def _to_numpy(column: Any, dtype: np.dtype[Any]) -> npt.NDArray[Any]:
    array = column.to_numpy()
    if dtype == STRING and array.dtype != STRING:
        array = array.astype(object)
    return array  # type: ignore[no-any-return]
