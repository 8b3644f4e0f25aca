"""Endless sources: counter(start, step) and random(seed)."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np

from shardflow.data.cardinality import INFINITE_CARDINALITY
from shardflow.data.dataset import Dataset, DatasetIterator, State, current_epochs
from shardflow.data.randomness import RandomStream, resolve_seed

# Mixed into the random stream's seed, so that another op given the same seed draws other numbers.
_STREAM_TAG = 0x7A4D
# Random values converted ahead at a time, so that one-at-a-time reads cost no numpy call.
_BUFFERED = 1024


class CounterDataset(Dataset[Any]):
    def __init__(self, start: int, step: int, dtype: Any) -> None:
        # A tf.DType names its numpy type, so that counter(dtype=tf.int32) ports unchanged.
        self._dtype = np.dtype(getattr(dtype, "as_numpy_dtype", dtype))
        if self._dtype.kind not in "iuf":
            raise TypeError(f"counter dtype must be a numeric numpy dtype, got {self._dtype}")
        self._start, self._step = start, step

    def _iterator(self) -> DatasetIterator[Any]:
        return _CounterIterator(self)

    def _cardinality(self) -> int:
        return INFINITE_CARDINALITY


class _CounterIterator(DatasetIterator[Any]):
    def __init__(self, dataset: CounterDataset) -> None:
        self._dataset = dataset
        self._index = 0

    def __next__(self) -> Any:
        self._index += 1
        dataset = self._dataset
        return dataset._dtype.type(dataset._start + (self._index - 1) * dataset._step)

    def next_many(self, max_count: int) -> list[Any]:
        dataset = self._dataset
        indices = np.arange(self._index, self._index + max_count, dtype=np.int64)
        self._index += max_count
        return list((dataset._start + indices * dataset._step).astype(dataset._dtype))

    def get_state(self) -> State:
        return {"index": self._index}

    def set_state(self, state: State) -> None:
        self._index = int(state["index"])


class RandomDataset(Dataset[np.int64]):
    """int64 scalars uniform in [0, 2**32), as tf.data's random() yields. As in tf.data, seed=None draws one seed
    for this dataset, and every pass repeats the same numbers unless `rerandomize_each_iteration`."""

    def __init__(self, seed: int | None, rerandomize_each_iteration: bool | None) -> None:
        self._seed = resolve_seed(seed)
        self._rerandomize = bool(rerandomize_each_iteration)
        self._passes = itertools.count()

    def _iterator(self) -> DatasetIterator[np.int64]:
        epochs = (current_epochs() or (next(self._passes),)) if self._rerandomize else ()
        return _RandomIterator((self._seed, *epochs))

    def _cardinality(self) -> int:
        return INFINITE_CARDINALITY


class _RandomIterator(DatasetIterator[np.int64]):
    """State: the seed and epochs the numbers come from, and how many were drawn."""

    def __init__(self, entropy: tuple[int, ...]) -> None:
        self._stream = RandomStream((_STREAM_TAG, *entropy))
        self._buffer: list[np.int64] = []  # the values from stream position `_buffer_start` on
        self._buffer_start = 0

    def __next__(self) -> np.int64:
        offset = self._stream.position - self._buffer_start
        if offset >= len(self._buffer):
            return self.next_many(1)[0]
        self._stream.advance(1)
        return self._buffer[offset]

    def next_many(self, max_count: int) -> list[np.int64]:
        offset = self._stream.position - self._buffer_start
        if offset >= len(self._buffer):
            # The high 32 bits of each word: tf.data's random() yields values in [0, 2**32).
            self._buffer = list((self._stream.peek(max(max_count, _BUFFERED)) >> np.uint64(32)).astype(np.int64))
            self._buffer_start, offset = self._stream.position, 0
        values = self._buffer[offset : offset + max_count]
        self._stream.advance(len(values))
        return values

    def get_state(self) -> State:
        return {"entropy": list(self._stream.entropy), "drawn": self._stream.position}

    def set_state(self, state: State) -> None:
        self._stream = RandomStream(tuple(state["entropy"]))
        self._stream.position = int(state["drawn"])
        self._buffer, self._buffer_start = [], 0
