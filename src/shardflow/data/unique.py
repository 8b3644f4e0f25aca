"""unique(): each distinct element once, in order of first appearance."""

from __future__ import annotations

from typing import Any, TypeVar

import numpy as np

from shardflow.data import structure
from shardflow.data.dataset import DatasetIterator, State, UnaryDataset, UnaryIterator, has_bulk_next

T = TypeVar("T")

_SUPPORTED = (np.dtype(np.int32), np.dtype(np.int64))


def _key(element: Any) -> Any:
    """A hashable key equal for equal elements: the value itself for scalars and bytes, else shape and contents."""
    if isinstance(element, bytes | np.int64 | np.int32):
        return element
    if isinstance(element, np.ndarray):
        if element.dtype in _SUPPORTED:
            return element.shape, element.tobytes()
        if element.dtype == object:
            items = element.reshape(-1).tolist()
            if all(isinstance(item, bytes) for item in items):
                return element.shape, tuple(items)
    if structure.is_structure(element):
        raise TypeError("unique supports only elements with a single component, not a tuple or dict")
    raise TypeError(
        f"unique supports only int32, int64 and bytes elements, got {type(element).__name__} "
        f"{getattr(element, 'dtype', '')}"
    )


class UniqueDataset(UnaryDataset[T]):
    def _iterator(self) -> DatasetIterator[T]:
        return _UniqueIterator(iter(self._input))


class _UniqueIterator(UnaryIterator[T]):
    """The elements seen so far are data, not a position: the state is the pass's start and the number of input
    elements read, and a restore reads them again to rebuild the set."""

    def __init__(self, input_iterator: DatasetIterator[T]) -> None:
        super().__init__(input_iterator)
        self._start = input_iterator.get_state()
        self._seen: set[Any] = set()
        self._num_read = 0

    def __next__(self) -> T:
        while True:
            try:
                element: T = next(self._input)
            except StopIteration:
                raise
            except Exception:
                self._num_read += 1  # the input moved past the failing element
                raise
            self._num_read += 1
            key = _key(element)
            if key not in self._seen:
                self._seen.add(key)
                return element

    def next_many(self, max_count: int) -> list[T]:
        if not has_bulk_next(self._input):
            return [next(self)]
        out: list[T] = []
        seen = self._seen
        while not out:
            try:
                elements = self._input.next_many(max_count)
            except StopIteration:
                raise
            except Exception:
                self._num_read += 1
                raise
            self._num_read += len(elements)
            for element in elements:
                key = _key(element)
                if key not in seen:
                    seen.add(key)
                    out.append(element)
        return out

    def get_state(self) -> State:
        return {"start": self._start, "num_read": self._num_read}

    def set_state(self, state: State) -> None:
        self._input.set_state(state["start"])
        self._seen.clear()
        remaining = self._num_read = int(state["num_read"])
        bulk = has_bulk_next(self._input)
        while remaining:
            try:
                elements = self._input.next_many(remaining) if bulk else [next(self._input)]
            except StopIteration:
                break
            except Exception:
                remaining -= 1
                continue
            remaining -= len(elements)
            self._seen.update(map(_key, elements))
