"""The records of a CSV file as CsvDataset reads them: ended by "\\n", "\\r\\n" or a lone "\\r", where a quoted field
may hold line breaks, and an empty line is a record of one empty field."""

from __future__ import annotations

import re
from typing import Any

from shardflow.data.sources.errors import InvalidRecordError
from shardflow.data.sources.files import ByteStream
from shardflow.data.sources.reader import RecordReader

_LINE_BREAK = re.compile(rb"\r\n|\r|\n")


def _record_pattern(field_delim: bytes) -> re.Pattern[bytes]:
    """One record and its line break, tokenized as tf.data's CSV reader does: a field that starts with a quote
    runs to a quote followed by the delimiter or a line break ("" is an escaped quote, and a quote followed by
    anything else is an error after which the field goes on); any other field runs to the delimiter or a line
    break. Possessive, so that matching is linear."""
    delim = re.escape(field_delim)
    quoted_text = rb'(?:[^"]++|"")*+"'
    quoted = rb'"' + quoted_text + rb"(?:[^" + delim + rb'\r\n"]' + quoted_text + rb")*+"
    unquoted = rb'(?!")[^' + delim + rb"\r\n]*+"
    field = rb"(?:" + quoted + rb"|" + unquoted + rb")"
    return re.compile(rb"(" + field + rb"(?:" + delim + field + rb")*+)(\r\n|\r|\n)")


class CsvRecordReader(RecordReader[bytes]):
    """Splits a stream into records a chunk at a time. Files without quotes (or read with use_quote_delim=False)
    split at line breaks in one call; a chunk with quotes is matched record by record (see `_record_pattern`)."""

    def __init__(
        self, stream: ByteStream, record_index: int, header: bool, field_delim: bytes, use_quote_delim: bool
    ) -> None:
        self.stream = stream
        self._first_record = record_index  # record number (from 0) of the last batch's first record, header included
        self._next_record = record_index
        self._header = header
        self._use_quote_delim = use_quote_delim
        self._record = _record_pattern(field_delim)
        self._pending = b""  # bytes after the last complete record read
        self._region = b""  # the last batch's records as read, with their line breaks
        self._region_offset = stream.offset
        self._ends: list[int] | None = None  # where each record of the region ends (after its line break)
        self._num_skipped = 0  # header records dropped from the front of the last batch
        self._num_records = 0  # records in the last batch, the header included
        self._done = False

    def read_batch(self) -> list[bytes]:
        while not self._done:
            self._first_record = self._next_record
            self._region_offset = self.stream.offset - len(self._pending)
            records = self._read_records()
            self._num_records = len(records)
            self._next_record += len(records)
            self._num_skipped = 1 if self._header and self._first_record == 0 and records else 0
            if self._header and self._first_record == 0 and not records:
                self._done = True  # so that a caller who skips errors goes on with the next file
                raise InvalidRecordError(self.stream.filename, 0, "cannot read the header: the file is empty")
            if len(records) > self._num_skipped:
                return records[self._num_skipped :]
            if not records:
                self._done = True
        return []

    def _read_records(self) -> list[bytes]:
        data = self._pending
        while True:
            chunk = self.stream.read_chunk()
            if chunk:
                data = data + chunk if data else chunk
            records, consumed = self._split(data, at_end=not chunk)
            if records or not chunk:
                self._region, self._pending = data[:consumed], data[consumed:]
                return records

    def _split(self, data: bytes, at_end: bool) -> tuple[list[bytes], int]:
        """The complete records at the start of `data` (all of them `at_end`) and the number of bytes they take, line
        breaks included. Sets `_ends` where matching finds them anyway; otherwise `position` finds them when asked."""
        if self._use_quote_delim and b'"' in data:
            return self._split_quoted(data, at_end)
        self._ends = None
        end = len(data)
        if not at_end:
            # A "\r" that ends the data may be the first half of "\r\n": its record waits for the next chunk.
            end = max(data.rfind(b"\n"), data.rfind(b"\r", 0, len(data) - 1)) + 1
        region = data[:end]
        if not region:
            return [], 0
        records = _LINE_BREAK.split(region) if b"\r" in region else region.split(b"\n")
        if not records[-1]:
            records.pop()  # the line break that ends the region starts no record
        return records, end

    def _split_quoted(self, data: bytes, at_end: bool) -> tuple[list[bytes], int]:
        records: list[bytes] = []
        ends: list[int] = []
        start = 0
        for match in self._record.finditer(data):
            if match.start() != start:
                break  # a record that goes on past `data` (its matches further on are inside it)
            records.append(match.group(1))
            start = match.end()
            ends.append(start)
        if not at_end and records and data.endswith(b"\r") and start == len(data):
            # A "\r" that ends the data may be the first half of "\r\n": its record waits for the next chunk.
            records.pop()
            ends.pop()
            start = ends[-1] if ends else 0
        elif at_end and start < len(data):
            # The last record has no line break; or it opens a quote it never closes, and its parse raises.
            records.append(data[start:])
            start = len(data)
            ends.append(start)
        self._ends = ends
        return records, start

    def position(self, count: int) -> dict[str, Any]:
        records = self._num_skipped + count
        if not records:
            offset = self._region_offset
        elif records == self._num_records:
            offset = self._region_offset + len(self._region)
        else:
            if self._ends is None:
                self._ends = [match.end() for match in _LINE_BREAK.finditer(self._region)]
            offset = self._region_offset + self._ends[records - 1]
        return {"offset": offset, "record_index": self._first_record + records}

    def line_number(self, count: int) -> int:
        """The record number (from 0, the header included) of record `count` of the last batch, for errors."""
        return self._first_record + self._num_skipped + count

    def close(self) -> None:
        self.stream.close()
