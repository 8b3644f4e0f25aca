"""Errors the file sources raise: each names the file and where in it the problem is."""

from __future__ import annotations

from shardflow.data.errors import DataLossError, InvalidArgumentError

__all__ = ["CsvRecordError", "DataLossError", "InvalidRecordError"]


class InvalidRecordError(InvalidArgumentError):
    """A record read whole cannot be decoded (e.g. a CSV line with the wrong number of fields)."""

    def __init__(self, filename: str, line: int, problem: str) -> None:
        super().__init__(f"{filename}:{line}: {problem}")
        self.filename = filename
        self.line = line
        self.problem = problem

    def __reduce__(self) -> tuple[type[InvalidRecordError], tuple[str, int, str]]:
        return type(self), (self.filename, self.line, self.problem)


class CsvRecordError(InvalidArgumentError):
    """Record `index` of a batch cannot be decoded; `problem` says why."""

    def __init__(self, index: int, problem: str, record: bytes) -> None:
        super().__init__(f"record {index}: {problem}: {record[:200]!r}")
        self.index = index
        self.problem = problem
