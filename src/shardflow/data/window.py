"""window(size, shift, stride): a dataset of windows, each the element structure with a Dataset at every leaf."""

from __future__ import annotations

import collections
from typing import Any

from shardflow.data import batching, structure
from shardflow.data.dataset import Dataset, DatasetIterator, State, UnaryDataset, UnaryIterator
from shardflow.data.errors import InvalidArgumentError
from shardflow.data.sources.in_memory import ElementsDataset


def _positive(value: Any, argument: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise InvalidArgumentError(f"window {argument} must be a positive int, got {value!r}")
    return value


class WindowDataset(UnaryDataset[Any]):
    """Window k holds elements k*shift + j*stride for j < size; windows that run past the end are shorter
    (dropped with `drop_remainder`), as in tf.data."""

    def __init__(
        self, input_dataset: Dataset[Any], size: int, shift: int | None, stride: int, drop_remainder: bool
    ) -> None:
        super().__init__(input_dataset)
        self._size = _positive(size, "size")
        self._shift = self._size if shift is None else _positive(shift, "shift")
        self._stride = _positive(stride, "stride")
        self._drop_remainder = drop_remainder

    def _iterator(self) -> DatasetIterator[Any]:
        return _WindowIterator(iter(self._input), self)

    def _cardinality(self) -> int:
        known = self._input._cardinality()
        if known < 0:
            return known
        if not self._drop_remainder:
            return -(-known // self._shift)
        last_start = known - 1 - (self._size - 1) * self._stride
        return last_start // self._shift + 1 if last_start >= 0 else 0


class _WindowIterator(UnaryIterator[Any]):
    """Buffers the span of the next window, with the input's state before each element that starts a window.
    State: where the next window starts, as (input state, elements to skip from there)."""

    def __init__(self, input_iterator: DatasetIterator[Any], dataset: WindowDataset) -> None:
        super().__init__(input_iterator)
        self._size, self._shift, self._stride = dataset._size, dataset._shift, dataset._stride
        self._drop_remainder = dataset._drop_remainder
        self._span = (self._size - 1) * self._stride + 1
        self._buffer: collections.deque[tuple[State | None, Any]] = collections.deque()
        self._to_skip = 0
        self._input_done = False

    def __next__(self) -> Any:
        while self._to_skip and not self._input_done:
            try:
                next(self._input)
                self._to_skip -= 1
            except StopIteration:
                self._input_done = True
        while len(self._buffer) < self._span and not self._input_done:
            # The front of the buffer always starts a window, and so does every shift-th element after it.
            before = self._input.get_state() if len(self._buffer) % self._shift == 0 else None
            try:
                self._buffer.append((before, next(self._input)))
            except StopIteration:
                self._input_done = True
        if not self._buffer:
            raise StopIteration
        elements = [element for _, element in list(self._buffer)[:: self._stride]]
        if len(elements) < self._size and self._drop_remainder:
            raise StopIteration
        dropped = min(self._shift, len(self._buffer))
        for _ in range(dropped):
            self._buffer.popleft()
        self._to_skip = self._shift - dropped
        columns, treedef = batching.group_leaves(elements, "window")
        return structure.pack(treedef, [ElementsDataset(column) for column in columns])

    def get_state(self) -> State:
        if self._buffer:
            return {"input": self._buffer[0][0], "skip": 0}  # the front starts a window, so it has a state
        return {"input": self._input.get_state(), "skip": self._to_skip}

    def set_state(self, state: State) -> None:
        self._input.set_state(state["input"])
        self._buffer.clear()
        self._to_skip = int(state["skip"])
        self._input_done = False
