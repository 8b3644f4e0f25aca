"""The errors shardflow.data raises, named as in tf.errors so that `except tf.errors.X` ports as
`except shardflow.data.errors.X`. Each also subclasses the Python exception it resembles, so code that catches
FileNotFoundError or ValueError keeps working."""

from __future__ import annotations


class OpError(Exception):
    """The base of the errors below, as tf.errors.OpError; `error_code` is tf's numeric code."""

    error_code = 2  # UNKNOWN

    @property
    def message(self) -> str:
        return str(self)


class InvalidArgumentError(OpError, ValueError):
    """An argument or an element is not valid for the operation (a batch_size of 0, a malformed record)."""

    error_code = 3


class NotFoundError(OpError, FileNotFoundError):
    """A file to read does not exist. Built like FileNotFoundError: (errno, strerror, filename)."""

    error_code = 5


class PermissionDeniedError(OpError, PermissionError):
    """A file cannot be read or written with this process's permissions."""

    error_code = 7


class ResourceExhaustedError(OpError, MemoryError):
    """A buffer or budget is exhausted."""

    error_code = 8


class FailedPreconditionError(OpError, RuntimeError):
    """The pipeline is not in a state where the operation is allowed (e.g. a cardinality assertion that fails)."""

    error_code = 9


class OutOfRangeError(OpError):
    """`iterator.get_next()` past the last element, as in tf.data; `next(iterator)` raises StopIteration instead.

    Deliberately not a StopIteration: raised inside a generator it would turn into RuntimeError (PEP 479), and
    raised inside a map function it would silently end the outer pipeline. Nor an IndexError, which code catches
    around subscripts."""

    error_code = 11


class UnimplementedError(OpError, NotImplementedError):
    """The operation is part of tf.data's API but not of shardflow's."""

    error_code = 12


class DataLossError(OpError, ValueError):
    """A file is corrupt or truncated: `filename` and `offset` (bytes into the uncompressed stream) say where."""

    error_code = 15

    def __init__(self, filename: str, offset: int, problem: str) -> None:
        super().__init__(f"{filename}: {problem} at byte offset {offset}")
        self.filename = filename
        self.offset = offset
        self.problem = problem

    def __reduce__(self) -> tuple[type[DataLossError], tuple[str, int, str]]:
        return type(self), (self.filename, self.offset, self.problem)


__all__ = [
    "DataLossError",
    "FailedPreconditionError",
    "InvalidArgumentError",
    "NotFoundError",
    "OpError",
    "OutOfRangeError",
    "PermissionDeniedError",
    "ResourceExhaustedError",
    "UnimplementedError",
]
