"""ParquetDataset: the rows of Parquet files through pyarrow, one at a time or in batches of columns."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import numpy.typing as npt

from shardflow.data.sources.errors import DataLossError
from shardflow.data.sources.files import open_to_read
from shardflow.data.sources.reader import FileDataset, RecordReader

Columns = dict[str, npt.NDArray[Any]]

_READ_ROWS = 64 * 1024
"""Rows pyarrow decodes per read when batch_size is small or None."""


class ParquetDataset(FileDataset[dict[str, Any]]):
    """The rows of Parquet files in order, with only `columns` (all when None) read. With `batch_size`, an
    element is a dict of numpy arrays of up to `batch_size` rows (a file's last batch may be shorter; batches do
    not span files); without, a dict of numpy scalars per row. Strings are bytes (object arrays); nulls are NaN
    in float columns and None in object ones.

    A file pyarrow cannot open or decode raises DataLossError naming it, with the byte offset of its footer or of
    the row group that failed; reading goes on with the next file. Iterator state: {"file_index", "row": rows of
    the file already returned}. Resuming reads from the row group holding that row.
    """

    def __init__(self, filenames: object, columns: list[str] | None = None, batch_size: int | None = None) -> None:
        super().__init__(filenames)
        if batch_size is not None and batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        self.columns = None if columns is None else list(columns)
        self.batch_size = batch_size

    def open_reader(self, filename: str, position: dict[str, Any] | None) -> ParquetReader:
        return ParquetReader(filename, self.columns, self.batch_size, int((position or {}).get("row", 0)))


class ParquetReader(RecordReader[dict[str, Any]]):
    """Reads record batches from the row group holding `row` on, and cuts them into elements by row number."""

    def __init__(self, filename: str, columns: list[str] | None, batch_size: int | None, row: int) -> None:
        import pyarrow.parquet as pq  # here, so that importing the sources does not load pyarrow

        self._filename = filename
        self._file = open_to_read(filename)  # closed by close()
        try:
            parquet = pq.ParquetFile(self._file)
            metadata = parquet.metadata
            self._group_rows = [metadata.row_group(index).num_rows for index in range(metadata.num_row_groups)]
            self._group_offsets = [_group_offset(metadata.row_group(index)) for index in range(metadata.num_row_groups)]
        except Exception as error:
            # pyarrow opens a file by its footer: the metadata before the last 8 bytes.
            footer = max(os.fstat(self._file.fileno()).st_size - 8, 0)
            self._file.close()
            raise DataLossError(filename, footer, f"not a readable Parquet file ({_one_line(error)})") from None
        first_group = 0
        group_start = 0
        while first_group < len(self._group_rows) and group_start + self._group_rows[first_group] <= row:
            group_start += self._group_rows[first_group]
            first_group += 1
        self._batch_size = batch_size
        self._batches = parquet.iter_batches(
            batch_size=max(batch_size or 0, _READ_ROWS),
            row_groups=range(first_group, len(self._group_rows)),
            columns=columns,
            use_threads=True,
        )
        self._read_row = group_start  # row number of the next row pyarrow returns
        self._skip = row - group_start  # rows to drop from the first reads, to start at `row`
        self._row = row  # row number of the last element batch's first row
        self._sizes: list[int] = []  # rows of each element of the last element batch
        self._pending: Columns | None = None  # rows read but not yet returned (batch_size mode)

    def read_batch(self) -> list[dict[str, Any]]:
        self._row += sum(self._sizes)
        self._sizes = []
        columns = self._read()
        if columns is None:
            if self._pending is not None:  # the file's last, shorter batch
                columns, self._pending = self._pending, None
                self._sizes = [_num_rows(columns)]
                return [columns]
            return []
        if self._batch_size is None:
            names = list(columns)
            rows = [dict(zip(names, values, strict=True)) for values in zip(*columns.values(), strict=True)]
            self._sizes = [1] * len(rows)
            return rows
        if self._pending is not None:
            columns = {name: np.concatenate((self._pending[name], column)) for name, column in columns.items()}
        num_rows = _num_rows(columns)
        whole = num_rows - num_rows % self._batch_size
        self._pending = {name: column[whole:] for name, column in columns.items()} if whole < num_rows else None
        batches = [
            {name: column[start : start + self._batch_size] for name, column in columns.items()}
            for start in range(0, whole, self._batch_size)
        ]
        self._sizes = [self._batch_size] * len(batches)
        return batches or self.read_batch()

    def _read(self) -> Columns | None:
        """The next record batch as numpy columns, after dropping the rows before the start; None at the end."""
        while True:
            try:
                batch = next(self._batches, None)
                if batch is None:
                    return None
                self._read_row += batch.num_rows
                if self._skip >= batch.num_rows:
                    self._skip -= batch.num_rows
                    continue
                if self._skip:
                    batch, self._skip = batch.slice(self._skip), 0
                return {name: _to_numpy(batch.column(index)) for index, name in enumerate(batch.schema.names)}
            except Exception as error:
                raise self._damaged(error) from None

    def _damaged(self, error: Exception) -> DataLossError:
        """The error for rows pyarrow cannot decode. A read spans row groups, so the one named is the first not yet
        read whole: the damage is there or in a later one."""
        group, first_row = 0, 0
        while group < len(self._group_rows) - 1 and first_row + self._group_rows[group] <= self._read_row:
            first_row += self._group_rows[group]
            group += 1
        offset = self._group_offsets[group] if self._group_offsets else 0
        problem = f"cannot decode row group {group} (from row {first_row}) or a later one: {_one_line(error)}"
        return DataLossError(self._filename, offset, problem)

    def position(self, count: int) -> dict[str, Any]:
        return {"row": self._row + sum(self._sizes[:count])}

    def close(self) -> None:
        self._file.close()


def _one_line(error: Exception) -> str:
    return " ".join(str(error).split())


def _group_offset(row_group: Any) -> int:
    """Where a row group's first page starts in the file."""
    columns = [row_group.column(index) for index in range(row_group.num_columns)]
    starts = [c.dictionary_page_offset if c.has_dictionary_page else c.data_page_offset for c in columns]
    return min(starts, default=0)


def _num_rows(columns: Columns) -> int:
    return len(next(iter(columns.values()))) if columns else 0


def _to_numpy(array: Any) -> npt.NDArray[Any]:
    import pyarrow as pa

    if pa.types.is_string(array.type) or pa.types.is_large_string(array.type):
        array = array.cast(pa.binary() if pa.types.is_string(array.type) else pa.large_binary())
    return array.to_numpy(zero_copy_only=False)  # type: ignore[no-any-return]
