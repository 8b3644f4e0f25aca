"""Feature specs for parse_example (FixedLenFeature, VarLenFeature) and the Column every decoding path produces."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

FLOAT = np.dtype(np.float32)
INT64 = np.dtype(np.int64)
STRING = np.dtype(object)  # strings are Python bytes in object arrays

# The oneof field numbers of Feature in example.proto, and the list each holds.
KIND_OF_DTYPE = {STRING: 1, FLOAT: 2, INT64: 3}
KIND_NAMES = {1: "bytes", 2: "float", 3: "int64"}


def example_dtype(dtype: Any) -> np.dtype[Any]:
    """The numpy dtype of a tf.train.Example feature: float32, int64, or object for strings (bytes or str)."""
    if dtype in (bytes, str, np.bytes_, np.str_, object, "string", "bytes", "str"):
        return STRING
    try:
        normalized: np.dtype[Any] = np.dtype(dtype)
    except TypeError:
        normalized = np.dtype(np.void)  # refused below
    if normalized not in (FLOAT, INT64, STRING):
        raise ValueError(f"an Example feature's dtype must be float32, int64 or string (bytes), got {dtype!r}")
    return normalized


@dataclass(frozen=True)
class FixedLenFeature:
    """A feature with exactly prod(shape) values in every record (tf.io.FixedLenFeature). Records without it
    take `default_value` (reshaped to `shape`; a scalar is broadcast), or are an error when it is None."""

    shape: tuple[int, ...]
    dtype: Any
    default_value: Any = None

    def __post_init__(self) -> None:
        shape = (self.shape,) if isinstance(self.shape, int) else tuple(int(size) for size in self.shape)
        if any(size < 0 for size in shape):
            raise ValueError(f"FixedLenFeature shape must be fully defined and >= 0, got {self.shape}")
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "dtype", example_dtype(self.dtype))
        if self.default_value is not None:
            self.default_array()  # fail here, not at the first record that needs it

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def default_array(self) -> npt.NDArray[Any]:
        """The default value as a flat array of `size` values."""
        value = self.default_value
        if self.dtype == STRING:
            value = np.array(value, dtype=object)
            value = np.vectorize(_as_bytes, otypes=[object])(value) if value.size else value
        default = np.asarray(value, dtype=self.dtype).reshape(-1)
        if default.size == 1:
            return np.broadcast_to(default, (self.size,))
        if default.size != self.size:
            raise ValueError(f"default_value has {default.size} values, but shape {list(self.shape)} needs {self.size}")
        return default


@dataclass(frozen=True)
class VarLenFeature:
    """A feature with any number of values per record, parsed into a SparseTensor (tf.io.VarLenFeature)."""

    dtype: Any

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", example_dtype(self.dtype))


@dataclass(frozen=True)
class Column:
    """One feature decoded over a batch: the records that have it (ascending), how many values each has, and the
    values of all of them concatenated (float32, int64, or bytes in an object array)."""

    records: npt.NDArray[np.int64]
    counts: npt.NDArray[np.int64]
    values: npt.NDArray[Any]


def _as_bytes(value: Any) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)
