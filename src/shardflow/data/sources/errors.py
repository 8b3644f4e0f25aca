"""Errors the file sources raise: each names the file and where in it the problem is."""

from __future__ import annotations

from shardflow.data.errors import DataLossError, InvalidArgumentError

__all__ = ["CsvRecordError", "DataLossError", "InvalidRecordError"]


class InvalidRecordError(InvalidArgumentError):
    """A record read whole cannot be decoded (e.g. a CSV line with the wrong number of fields): `line` counts from 1,
    `offset` is where the record starts (bytes into the uncompressed stream) where it is known."""

    def __init__(self, filename: str, line: int, problem: str, offset: int | None = None) -> None:
        where = "" if offset is None else f" at byte offset {offset}"
        super().__init__(f"{filename}:{line}: {problem}{where}")
        self.filename = filename
        self.line = line
        self.problem = problem
        self.offset = offset

    def __reduce__(self) -> tuple[type[InvalidRecordError], tuple[str, int, str, int | None]]:
        return type(self), (self.filename, self.line, self.problem, self.offset)


class CsvRecordError(InvalidArgumentError):
    """Record `index` of a batch cannot be decoded; `problem` says why."""

    def __init__(self, index: int, problem: str, record: bytes) -> None:
        super().__init__(f"record {index}: {problem}: {record[:200]!r}")
        self.index = index
        self.problem = problem
