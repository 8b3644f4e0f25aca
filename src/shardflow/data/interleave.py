"""interleave and flat_map: tf.data's cycle order over the datasets a function makes from input elements."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from shardflow.data import structure
from shardflow.data.dataset import Dataset, DatasetIterator, IterationScope, State, UnaryDataset, UnaryIterator
from shardflow.data.options import AUTOTUNE, cpu_budget, resolve_parallelism
from shardflow.data.prefetch import PrefetchIterator


class InterleaveDataset(UnaryDataset[Any]):
    """`cycle_length` inputs are open at once; `block_length` consecutive elements come from each in turn; an exhausted
    input's place is refilled from the next input element before moving on. With `num_parallel_calls` each open input
    is read ahead on its own thread; the order stays tf.data's deterministic order whatever `deterministic` says.
    A place's state is the input's state before the element that opened it plus the opened dataset's own state, so a
    restore re-reads that element and reopens its dataset at the saved position.
    """

    def __init__(
        self,
        input_dataset: Dataset[Any],
        map_func: Callable[..., Dataset[Any]],
        cycle_length: int | None = None,
        block_length: int | None = None,
        num_parallel_calls: int | None = None,
        deterministic: bool | None = None,
    ) -> None:
        super().__init__(input_dataset)
        if not callable(map_func):
            raise TypeError(
                f"interleave expects a callable map_func returning a Dataset, got {type(map_func).__name__}"
            )
        for name, value in (("cycle_length", cycle_length), ("block_length", block_length)):
            if value is not None and value != AUTOTUNE and (not isinstance(value, int) or value < 1):
                raise ValueError(f"interleave {name} must be a positive int, None or AUTOTUNE, got {value!r}")
        if block_length == AUTOTUNE:
            raise ValueError("interleave block_length cannot be AUTOTUNE; give a positive int or None for 1")
        resolve_parallelism(num_parallel_calls)
        self._map_func = map_func
        self._cycle_length = cycle_length
        self._block_length = block_length or 1
        self._num_parallel_calls = num_parallel_calls
        self._deterministic = deterministic

    def _iterator(self) -> DatasetIterator[Any]:
        cycle_length = self._cycle_length
        if cycle_length is None or cycle_length == AUTOTUNE:
            cycle_length = cpu_budget()
        read_ahead = resolve_parallelism(self._num_parallel_calls) > 0
        return _InterleaveIterator(self, iter(self._input), cycle_length, read_ahead)

    def _open(self, element: Any) -> Dataset[Any]:
        dataset = structure.call_with_element(self._map_func, element)
        if not isinstance(dataset, Dataset):
            raise TypeError(f"interleave/flat_map map_func must return a Dataset, got {type(dataset).__name__}")
        return dataset


class _Place:
    """One of the cycle's open inputs."""

    __slots__ = ("input_state", "iterator")

    def __init__(self, iterator: DatasetIterator[Any], input_state: State) -> None:
        self.iterator = iterator
        self.input_state = input_state


class _InterleaveIterator(UnaryIterator[Any]):
    def __init__(
        self, dataset: InterleaveDataset, input_iterator: DatasetIterator[Any], cycle_length: int, read_ahead: bool
    ) -> None:
        super().__init__(input_iterator)
        self._dataset = dataset
        self._block_length = dataset._block_length
        self._read_ahead = read_ahead
        self._scope = IterationScope()
        self._places: list[_Place | None] = [None] * cycle_length
        self._num_open = 0
        self._cycle_index = 0
        self._block_index = 0
        self._end_of_input = False

    def __next__(self) -> Any:
        while not self._end_of_input or self._num_open > 0:
            place = self._places[self._cycle_index]
            if place is None:
                if self._end_of_input:
                    self._next_in_cycle()
                else:
                    self._open_next_input()
                continue
            try:
                element = next(place.iterator)
            except StopIteration:
                self._close_place(self._cycle_index)
                self._next_in_cycle()
                continue
            self._block_index += 1
            if self._block_index == self._block_length:
                self._next_in_cycle()
            return element
        raise StopIteration

    def _next_in_cycle(self) -> None:
        self._block_index = 0
        self._cycle_index = (self._cycle_index + 1) % len(self._places)

    def _open_next_input(self) -> None:
        input_state = self._input.get_state()
        try:
            element = next(self._input)
        except StopIteration:
            self._end_of_input = True
            return
        self._places[self._cycle_index] = _Place(self._iterate(self._dataset._open(element)), input_state)
        self._num_open += 1

    def _iterate(self, dataset: Dataset[Any], state: State | None = None) -> DatasetIterator[Any]:
        iterator = self._scope.iter(dataset)
        if self._read_ahead:
            iterator = PrefetchIterator(iterator, AUTOTUNE)
        if state is not None:
            iterator.set_state(state)
        if isinstance(iterator, PrefetchIterator):
            iterator.start()
        return iterator

    def _close_place(self, index: int) -> None:
        place = self._places[index]
        if place is not None:
            place.iterator.close()
            self._places[index] = None
            self._num_open -= 1

    @property
    def deterministic(self) -> bool:
        return self._input.deterministic and all(place.iterator.deterministic for place in self._places if place)

    def get_state(self) -> State:
        places = [
            None if place is None else {"input": place.input_state, "state": place.iterator.get_state()}
            for place in self._places
        ]
        return {
            "input": self._input.get_state(),
            "cycle_index": self._cycle_index,
            "block_index": self._block_index,
            "end_of_input": self._end_of_input,
            "places": places,
        }

    def set_state(self, state: State) -> None:
        if len(state["places"]) != len(self._places):
            raise ValueError(
                f"interleave state has cycle_length {len(state['places'])}, this pipeline has {len(self._places)}"
            )
        for index in range(len(self._places)):
            self._close_place(index)
        self._input.set_state(state["input"])
        self._cycle_index, self._block_index = int(state["cycle_index"]), int(state["block_index"])
        self._end_of_input = bool(state["end_of_input"])
        for index, saved in enumerate(state["places"]):
            if saved is not None:
                self._places[index] = _Place(self._reopen(saved), saved["input"])
                self._num_open += 1

    def _reopen(self, saved: State) -> DatasetIterator[Any]:
        reader = self._scope.iter(self._dataset._input)
        try:
            reader.set_state(saved["input"])
            element = next(reader)
        finally:
            reader.close()
        return self._iterate(self._dataset._open(element), saved["state"])

    def close(self) -> None:
        for index in range(len(self._places)):
            self._close_place(index)
        super().close()
