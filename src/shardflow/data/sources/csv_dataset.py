"""CsvDataset: the decoded rows of CSV files, a chunk of lines decoded at a time."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from shardflow.data.sources.csv import decode_lines
from shardflow.data.sources.csv_format import CsvFormat
from shardflow.data.sources.csv_records import CsvRecordReader
from shardflow.data.sources.errors import CsvRecordError, InvalidRecordError
from shardflow.data.sources.files import ByteStream, compression_type_name
from shardflow.data.sources.reader import FileDataset, RecordReader

Row = tuple[Any, ...]


class CsvDataset(FileDataset[Row]):
    """The records of CSV files as tuples of numpy scalars, one per column of `record_defaults`
    (tf.data.experimental.CsvDataset). A record that cannot be decoded raises InvalidRecordError naming the file
    and line, after the records before it; iterating on continues after it.

    Records end at "\n", "\r\n" or a lone "\r", except inside a quoted field; an empty line is a record of one empty
    field; a file with `header` must have one. Iterator state: {"file_index", "offset": byte offset of the next
    record, "record_index": records read, header included}.
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
        csv_format = self.csv_format
        records = CsvRecordReader(
            stream,
            int(position.get("record_index", 0)),
            self.header,
            csv_format.field_delim,
            csv_format.use_quote_delim,
        )
        return CsvReader(records, csv_format)


class CsvReader(RecordReader[Row]):
    """Decodes each batch of lines a column at a time; a bad line splits the batch around it."""

    def __init__(self, lines: CsvRecordReader, csv_format: CsvFormat) -> None:
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
            columns = decode_lines(lines, self._csv_format, empty_record_is_a_field=True)
        except CsvRecordError as error:
            if error.index == 0:
                self._rest = lines[1:]
                offset = self._lines.position(self._start)["offset"]
                self._start += 1  # the bad line counts as read
                line_number = self._lines.position(self._start)["record_index"]
                filename = self._lines.stream.filename
                raise InvalidRecordError(filename, line_number, error.problem, offset) from None
            # The rows before the bad line come first; the next call decodes the bad line again and raises.
            self._rest = lines[error.index :]
            lines = lines[: error.index]
            columns = decode_lines(lines, self._csv_format, empty_record_is_a_field=True)
        rows = list(zip(*columns, strict=True))
        self._size = len(rows)
        return rows

    def position(self, count: int) -> dict[str, Any]:
        return self._lines.position(self._start + count)

    def close(self) -> None:
        self._lines.close()
