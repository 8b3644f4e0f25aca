"""ignore_errors(): skips elements whose production raised, and counts them."""

from __future__ import annotations

import logging
from typing import Any, TypeVar

from shardflow.data.dataset import Dataset, DatasetIterator, State, UnaryDataset, UnaryIterator

T = TypeVar("T")

logger = logging.getLogger(__name__)


class IgnoreErrorsDataset(UnaryDataset[T]):
    def __init__(self, input_dataset: Dataset[T], log_warning: bool) -> None:
        super().__init__(input_dataset)
        self._log_warning = log_warning

    def _iterator(self) -> DatasetIterator[T]:
        return IgnoreErrorsIterator(iter(self._input), self._log_warning)

    def _element_spec(self) -> Any | None:
        return self._input._element_spec()


class IgnoreErrorsIterator(UnaryIterator[T]):
    """`num_skipped` counts the elements skipped so far in this pass (restored with the state).

    An input that raises must move past the failing element, as shardflow's iterators do; one that raises at the
    same position forever would make this loop forever, as it would in tf.data."""

    def __init__(self, input_iterator: DatasetIterator[T], log_warning: bool) -> None:
        super().__init__(input_iterator)
        self._log_warning = log_warning
        self.num_skipped = 0

    def __next__(self) -> T:
        while True:
            try:
                element: T = next(self._input)
                return element
            except StopIteration:
                raise
            except Exception as error:
                self.num_skipped += 1
                if self._log_warning:
                    logger.warning("ignore_errors skipped an element (%d so far): %r", self.num_skipped, error)

    def get_state(self) -> State:
        return {"input": self._input.get_state(), "num_skipped": self.num_skipped}

    def set_state(self, state: State) -> None:
        self._input.set_state(state["input"])
        self.num_skipped = int(state["num_skipped"])
