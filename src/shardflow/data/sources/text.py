"""TextLineDataset: the lines of text files, without their line endings."""

from __future__ import annotations

import itertools
from typing import Any

from shardflow.data.element_spec import STRING, TensorSpec
from shardflow.data.sources.files import ByteStream, compression_type_name
from shardflow.data.sources.reader import FileDataset, RecordReader


class TextLineDataset(FileDataset[bytes]):
    """The lines of one or more text files, as tf.data.TextLineDataset: "\\n" ends a line and every "\\r" is
    dropped, so "\\r\\n" endings go; a last line without a newline is kept unless it is empty.

    `skip_header_lines` (not in tf.data) drops that many lines at the start of every file.
    Iterator state: {"file_index", "offset": byte offset of the next line, "record_index": lines read}.
    """

    def __init__(
        self,
        filenames: object,
        compression_type: str | None = None,
        buffer_size: int | None = None,
        num_parallel_reads: int | None = None,
        *,
        skip_header_lines: int = 0,
    ) -> None:
        super().__init__(filenames, num_parallel_reads)
        if skip_header_lines < 0:
            raise ValueError(f"skip_header_lines must be >= 0, got {skip_header_lines}")
        self.compression_type = compression_type_name(compression_type)
        self.buffer_size = buffer_size
        self.skip_header_lines = skip_header_lines

    def open_reader(self, filename: str, position: dict[str, Any] | None) -> LineReader:
        position = position or {}
        stream = ByteStream(filename, self.compression_type, self.buffer_size, int(position.get("offset", 0)))
        return LineReader(stream, int(position.get("record_index", 0)), self.skip_header_lines)

    def _element_spec(self) -> TensorSpec:
        return STRING


class LineReader(RecordReader[bytes]):
    """Splits a stream into lines a chunk at a time; record_index counts lines read, header lines included."""

    def __init__(self, stream: ByteStream, record_index: int = 0, skip_header_lines: int = 0) -> None:
        self.stream = stream
        self.first_record = record_index  # line number (from 0) of the last batch's first line, header included
        self._next_record = record_index
        self._skip_header_lines = skip_header_lines
        self._pending = b""  # bytes after the last newline read
        self._region = b""  # the last batch's lines as read: "\r" kept, the newline that ends it not
        self._region_offset = self._region_end = stream.offset
        self._num_skipped = 0  # header lines dropped from the front of the last batch
        self._num_lines = 0  # lines in the last batch, header lines included
        self._line_ends: list[int] | None = None  # where each line of the region ends (after its newline)

    def read_batch(self) -> list[bytes]:
        while True:
            self.first_record = self._next_record
            self._region_offset = self.stream.offset - len(self._pending)
            lines = self._read_lines()
            self._region_end = self.stream.offset - len(self._pending)
            self._num_lines, self._line_ends = len(lines), None
            self._next_record += len(lines)
            self._num_skipped = min(max(self._skip_header_lines - self.first_record, 0), len(lines))
            if not self._num_skipped:
                return lines
            if len(lines) > self._num_skipped:
                return lines[self._num_skipped :]

    def _read_lines(self) -> list[bytes]:
        data = self._pending
        while True:
            chunk = self.stream.read_chunk()
            if not chunk:
                self._pending = b""
                self._region = data
                last = data.replace(b"\r", b"")
                return [last] if last else []
            data = data + chunk if data else chunk
            end = data.rfind(b"\n")
            if end >= 0:
                self._region, self._pending = data[:end], data[end + 1 :]
                region = self._region.replace(b"\r", b"") if b"\r" in self._region else self._region
                return region.split(b"\n")

    def position(self, count: int) -> dict[str, Any]:
        """Where each line of the batch ends is found in the raw region once, when a state is first asked for."""
        lines = self._num_skipped + count
        if not lines:
            offset = self._region_offset
        elif lines == self._num_lines:
            offset = self._region_end
        else:
            if self._line_ends is None:
                lengths = map(len, self._region.split(b"\n"))
                self._line_ends = list(itertools.accumulate(length + 1 for length in lengths))
            offset = self._region_offset + self._line_ends[lines - 1]
        return {"offset": offset, "record_index": self.first_record + lines}

    def close(self) -> None:
        self.stream.close()
