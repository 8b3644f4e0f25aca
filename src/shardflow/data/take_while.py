"""take_while(predicate): elements up to the first one for which the predicate is false."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

from shardflow.data import structure
from shardflow.data.dataset import Dataset, DatasetIterator, State, UnaryDataset, UnaryIterator

T = TypeVar("T")


def scalar_bool(value: Any, operation: str) -> bool:
    """A predicate's result, which must be a scalar bool as in tf.data."""
    if isinstance(value, bool | np.bool_) or (
        isinstance(value, np.ndarray) and value.shape == () and value.dtype == bool
    ):
        return bool(value)
    raise TypeError(
        f"{operation} predicate must return a scalar bool, got {type(value).__name__} {np.shape(value)}; "
        "reduce it with np.all / np.any"
    )


class TakeWhileDataset(UnaryDataset[T]):
    def __init__(self, input_dataset: Dataset[T], predicate: Callable[..., Any]) -> None:
        super().__init__(input_dataset)
        if not callable(predicate):
            raise TypeError(f"take_while expects a callable predicate, got {type(predicate).__name__}")
        self._predicate = predicate

    def _iterator(self) -> DatasetIterator[T]:
        return _TakeWhileIterator(iter(self._input), self._predicate)


class _TakeWhileIterator(UnaryIterator[T]):
    def __init__(self, input_iterator: DatasetIterator[T], predicate: Callable[..., Any]) -> None:
        super().__init__(input_iterator)
        self._predicate = predicate
        self._done = False

    def __next__(self) -> T:
        if self._done:
            raise StopIteration
        element: T = next(self._input)
        if not scalar_bool(structure.call_with_element(self._predicate, element), "take_while"):
            self._done = True
            raise StopIteration
        return element

    def get_state(self) -> State:
        return {"input": self._input.get_state(), "done": self._done}

    def set_state(self, state: State) -> None:
        self._input.set_state(state["input"])
        self._done = bool(state["done"])
