"""assert_cardinality, which states the count of a pipeline where tf.data's rules cannot know it."""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import Any, TypeVar

from shardflow.data.cardinality import INFINITE_CARDINALITY, UNKNOWN_CARDINALITY
from shardflow.data.dataset import Dataset, DatasetIterator, State, UnaryDataset, UnaryIterator
from shardflow.data.errors import FailedPreconditionError

T = TypeVar("T")


class AssertCardinalityDataset(UnaryDataset[T]):
    """The input, declared to have `expected` elements: `cardinality()` returns it, and iteration raises
    FailedPreconditionError as soon as the input yields more, or ends with fewer."""

    def __init__(self, input_dataset: Dataset[T], expected: int) -> None:
        super().__init__(input_dataset)
        if not isinstance(expected, numbers.Integral) or isinstance(expected, bool) or expected < INFINITE_CARDINALITY:
            raise ValueError(f"assert_cardinality expects a count >= 0 or INFINITE_CARDINALITY, got {expected!r}")
        self._expected: int = int(expected)

    def _iterator(self) -> DatasetIterator[T]:
        return _AssertCardinalityIterator(iter(self._input), self._expected)

    def _cardinality(self) -> int:
        return self._expected

    def _element_spec(self) -> Any:
        return self._input._element_spec()


class _AssertCardinalityIterator(UnaryIterator[T]):
    def __init__(self, input_iterator: DatasetIterator[T], expected: int) -> None:
        super().__init__(input_iterator)
        self._expected = expected
        self._num_seen = 0

    def __next__(self) -> T:
        try:
            element: T = next(self._input)
        except StopIteration:
            if self._expected != self._num_seen:
                raise FailedPreconditionError(
                    f"assert_cardinality: the input has {self._num_seen} elements, expected {_describe(self._expected)}"
                ) from None
            raise
        self._num_seen += 1
        if 0 <= self._expected < self._num_seen:
            raise FailedPreconditionError(
                f"assert_cardinality: the input has more than the {self._expected} elements expected"
            )
        return element

    def get_state(self) -> State:
        return {"input": self._input.get_state(), "num_seen": self._num_seen}

    def set_state(self, state: State) -> None:
        self._input.set_state(state["input"])
        self._num_seen = int(state["num_seen"])


def _describe(count: int) -> str:
    return {INFINITE_CARDINALITY: "an infinite number", UNKNOWN_CARDINALITY: "an unknown number"}.get(count, str(count))


def assert_cardinality(expected_cardinality: int) -> Callable[[Dataset[T]], Dataset[T]]:
    """For `dataset.apply(...)`, as tf.data.experimental.assert_cardinality."""
    return lambda dataset: AssertCardinalityDataset(dataset, expected_cardinality)
