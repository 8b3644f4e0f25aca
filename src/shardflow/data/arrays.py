"""numpy helpers the batch decoders share."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

Int64Array = npt.NDArray[np.int64]

# Values spanning at most this many integers are told apart with a table rather than a sort.
_MAX_TABLE_SPAN = 1 << 16


def distinct(values: Int64Array) -> tuple[Int64Array, Int64Array]:
    """The distinct values in ascending order, and the index of each value among them (np.unique with
    return_inverse, several times faster for the small spans of record sizes)."""
    if not values.size:
        return values.copy(), np.zeros(0, dtype=np.int64)
    low = int(values.min())
    span = int(values.max()) - low + 1
    if span > _MAX_TABLE_SPAN:
        found, inverse = np.unique(values, return_inverse=True)
        return found.astype(np.int64, copy=False), inverse.reshape(-1).astype(np.int64, copy=False)
    offsets = values - low
    present = np.zeros(span, dtype=bool)
    present[offsets] = True
    found = np.flatnonzero(present)
    table = np.zeros(span, dtype=np.int64)
    table[found] = np.arange(found.size)
    return found + low, table[offsets]
