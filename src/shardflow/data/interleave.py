"""interleave and flat_map: tf.data's cycle order over the datasets a function makes from input elements."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from shardflow.data import structure
from shardflow.data.dataset import (
    Dataset,
    DatasetIterator,
    IterationScope,
    State,
    UnaryDataset,
    UnaryIterator,
    has_bulk_next,
    replay,
)
from shardflow.data.options import AUTOTUNE, cpu_budget, resolve_parallelism
from shardflow.data.prefetch import PrefetchIterator


class InterleaveDataset(UnaryDataset[Any]):
    """`cycle_length` inputs are open at once; `block_length` consecutive elements come from each in turn; an exhausted
    input's place is refilled from the next input element before moving on. With `num_parallel_calls` each open input
    is read ahead on its own thread; the order stays tf.data's deterministic order whatever `deterministic` says.
    A place's state is the input's state before the element that opened it plus the opened dataset's own state and a
    number of its elements to replay (those read ahead and already returned), so a restore re-reads that element and
    reopens its dataset at the saved position.
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


# Elements asked of an open input at a time when it hands them over in lists; what it returns may be fewer.
_REFILL_ELEMENTS = 4096

# What `_Place.fill` found: elements to return, an exhausted input, or an outcome to hold back until the elements
# already collected by the caller are returned.
_READY, _EXHAUSTED, _HOLD = 0, 1, 2


class _Place:
    """One of the cycle's open inputs and the elements read from it but not yet returned.

    Its position is `anchor`, the iterator's state before `buffer`, plus the `position` elements of `buffer` already
    returned; once those are all returned and nothing is `pending`, it is the iterator's own state. `pending` is what
    the iterator raised after `buffer` (StopIteration or an error), raised when the cycle reaches it. An input is read
    ahead of the cycle only if replaying it after a restore gives the same elements (it is deterministic)."""

    __slots__ = ("anchor", "buffer", "bulk", "input_state", "iterator", "pending", "position")

    def __init__(self, iterator: DatasetIterator[Any], input_state: State) -> None:
        self.iterator = iterator
        self.input_state = input_state
        self.bulk = has_bulk_next(iterator)
        self.buffer: list[Any] = []
        self.position = 0
        self.anchor: State | None = None
        self.pending: BaseException | None = None

    def available(self) -> int:
        return len(self.buffer) - self.position

    def fill(self, hold: bool, block_length: int) -> int:
        """Reads the next elements once the buffer is used up. With `hold`, an error is not raised but kept for
        when the cycle reaches this input again (_HOLD), as is any read from an input that cannot be replayed."""
        pending = self.pending
        if pending is not None:
            if not isinstance(pending, StopIteration) and hold:
                return _HOLD
            self.pending = self.anchor = None
            if isinstance(pending, StopIteration):
                return _EXHAUSTED
            raise pending
        deterministic = self.iterator.deterministic
        if not hold and not (self.bulk and deterministic):
            # One element, returned at once: the iterator's own state stays exact, no anchor needed.
            try:
                self.buffer, self.position = [next(self.iterator)], 0
            except StopIteration:
                return _EXHAUSTED
            return _READY
        if not deterministic:
            return _HOLD
        anchor = self.iterator.get_state()
        buffer: list[Any] = []
        try:
            if self.bulk:
                buffer = self.iterator.next_many(_REFILL_ELEMENTS)
            else:
                while len(buffer) < block_length:
                    buffer.append(next(self.iterator))
        except Exception as error:
            if not buffer and isinstance(error, StopIteration):
                # Kept for when the cycle reaches this input, if it was read ahead of the cycle.
                self.buffer, self.position, self.anchor, self.pending = [], 0, anchor, error
                return _EXHAUSTED
            if not buffer and not hold:
                raise  # the iterator's own state is past the failed element, as after a failed next()
            self.pending = error
        self.buffer, self.position, self.anchor = buffer, 0, anchor
        return _READY if buffer else _HOLD

    def state(self) -> tuple[State, int]:
        """The iterator's state and the number of elements to replay after it."""
        if self.pending is None and self.position == len(self.buffer):
            return self.iterator.get_state(), 0
        assert self.anchor is not None
        return self.anchor, self.position


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
        place = self._places[self._cycle_index]
        if place is None or place.position == len(place.buffer):
            return self.next_many(1)[0]
        # The common case on its own: the element is already read, the same step next_many takes.
        element = place.buffer[place.position]
        place.position += 1
        self._block_index += 1
        if self._block_index == self._block_length:
            self._next_in_cycle()
        return element

    def next_many(self, max_count: int) -> list[Any]:
        out: list[Any] = []
        places = self._places
        cycle = len(places) * self._block_length
        while len(out) < max_count:
            if (
                max_count - len(out) >= cycle
                and self._block_index == 0
                and self._num_open == len(places)
                and self._full_rounds(max_count, out)
            ):
                continue
            place = places[self._cycle_index]
            if place is None:
                if self._end_of_input:
                    if not self._num_open:
                        break
                    self._next_in_cycle()
                elif out:
                    break  # opening reads the input, whose errors must not overtake the elements in `out`
                else:
                    self._open_next_input()
                continue
            if not place.available():
                outcome = place.fill(bool(out), self._block_length)
                if outcome == _HOLD:
                    break
                if outcome == _EXHAUSTED:
                    self._close_place(self._cycle_index)
                    self._next_in_cycle()
                    continue
            take = min(self._block_length - self._block_index, place.available(), max_count - len(out))
            out += place.buffer[place.position : place.position + take]
            place.position += take
            self._block_index += take
            if self._block_index == self._block_length:
                self._next_in_cycle()
        if not out:
            raise StopIteration
        return out

    def _full_rounds(self, max_count: int, out: list[Any]) -> bool:
        """Appends as many whole cycles (a block from every input in turn) as the inputs' buffers hold, with a slice
        per block rather than a step per element; False if not one whole cycle is buffered."""
        places = [place for place in self._places if place is not None]
        block_length = self._block_length
        for place in places:
            available = place.available()
            if available < block_length and (available or place.fill(True, block_length) != _READY):
                return False
        rounds = min(
            min(place.available() for place in places) // block_length,
            (max_count - len(out)) // (len(places) * block_length),
        )
        if not rounds:
            return False
        order = places[self._cycle_index :] + places[: self._cycle_index]
        if block_length == 1:
            start = len(out)
            out += [None] * (rounds * len(order))
            for offset, place in enumerate(order):
                out[start + offset :: len(order)] = place.buffer[place.position : place.position + rounds]
                place.position += rounds
            return True
        for _ in range(rounds):
            for place in order:
                out += place.buffer[place.position : place.position + block_length]
                place.position += block_length
        return True

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

    def _iterate(self, dataset: Dataset[Any], state: State | None = None, skip: int = 0) -> DatasetIterator[Any]:
        iterator = self._scope.iter(dataset)
        if self._read_ahead:
            iterator = PrefetchIterator(iterator, AUTOTUNE)
        if state is not None:
            iterator.set_state(state)
            replay(iterator, skip)
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
        places: list[State | None] = []
        for place in self._places:
            if place is None:
                places.append(None)
                continue
            state, skip = place.state()
            places.append({"input": place.input_state, "state": state, "skip": skip})
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
        return self._iterate(self._dataset._open(element), saved["state"], int(saved["skip"]))

    def close(self) -> None:
        for index in range(len(self._places)):
            self._close_place(index)
        super().close()
