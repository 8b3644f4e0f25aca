"""Parallel map: chunks of elements in flight on threads (threads.py) or processes (processes.py), with exact state."""

from __future__ import annotations

import abc
import collections
import time
from collections.abc import Callable
from typing import Any

from shardflow.data.dataset import DatasetIterator, State, UnaryIterator, has_bulk_next, replay
from shardflow.data.mapping import apply_map

Outcome = tuple[Any, Exception | None]
"""A mapped element, or the error its map_func raised."""


Position = tuple[State, int]
"""An input position: the input's state followed by a number of elements to replay."""


class OrderLedger:
    """Which produced elements the consumer has been given, as a resumable position.

    Elements are numbered in the order the input produced them. The state is the input's position after the longest
    prefix of elements that were all returned, plus the offsets past that prefix of elements already returned out
    of order (at most the number in flight). A restore re-reads from the prefix and drops those offsets, so even a
    non-deterministic iterator resumes with exactly the elements it had not yet returned."""

    def __init__(self, position: Position, returned_offsets: list[int] | None = None) -> None:
        self._prefix = 0
        self._prefix_position = position
        self._next_number = 0
        self._positions: dict[int, Position] = {}
        self._returned = set(returned_offsets or ())

    @classmethod
    def from_state(cls, state: State) -> OrderLedger:
        return cls((state["input"], state["skip"]), state["returned"])

    def produced(self, position: Position) -> int | None:
        """Numbers the next input element, which ends at `position`; None if it was returned before a restore
        and must be dropped."""
        number = self._next_number
        self._next_number += 1
        self._positions[number] = position
        if number in self._returned:
            self._advance()
            return None
        return number

    def produced_run(self, anchor: State, count: int) -> list[int]:
        """`produced` for `count` elements read one after another from `anchor` (the first ends at (anchor, 1)),
        when none was returned before a restore (`replaying` is False)."""
        first = self._next_number
        self._next_number += count
        numbers = range(first, first + count)
        positions = [(anchor, skip) for skip in range(1, count + 1)]
        self._positions.update(zip(numbers, positions, strict=True))
        return list(numbers)

    @property
    def replaying(self) -> bool:
        """Whether elements returned before a restore are still to be produced (and dropped)."""
        return bool(self._returned) and max(self._returned) >= self._next_number

    def returned(self, number: int) -> None:
        self._returned.add(number)
        self._advance()

    def returned_many(self, numbers: list[int]) -> None:
        """`returned` for each of `numbers`, without a step per element when they extend the prefix."""
        if numbers and numbers[0] == self._prefix and not self._returned and numbers[-1] - numbers[0] < len(numbers):
            positions = self._positions
            self._prefix_position = positions[numbers[-1]]
            for number in numbers:
                del positions[number]
            self._prefix += len(numbers)
            return
        for number in numbers:
            self.returned(number)

    def _advance(self) -> None:
        while self._prefix in self._returned:
            self._returned.remove(self._prefix)
            self._prefix_position = self._positions.pop(self._prefix)
            self._prefix += 1

    def state(self) -> State:
        input_state, skip = self._prefix_position
        returned = sorted(number - self._prefix for number in self._returned)
        return {"input": input_state, "skip": skip, "returned": returned}


def map_chunk(map_func: Callable[..., Any], elements: list[Any]) -> tuple[list[Outcome], float]:
    """Outcomes of `map_func` on each element, and the seconds they took."""
    started = time.perf_counter()
    outcomes: list[Outcome] = []
    for element in elements:
        try:
            outcomes.append((apply_map(map_func, element), None))
        except Exception as error:
            outcomes.append((None, error))
    return outcomes, time.perf_counter() - started


class _Done:
    """A chunk's outcomes waiting for the consumer, from `position` on; `errors` is None when it holds none."""

    __slots__ = ("errors", "numbers", "position", "values")

    def __init__(self, numbers: list[int], values: list[Any], errors: list[Exception | None] | None) -> None:
        self.numbers = numbers
        self.values = values
        self.errors = errors
        self.position = 0


class _Chunk:
    __slots__ = ("error", "handle", "numbers")

    def __init__(self, handle: Any, numbers: list[int], error: Exception | None = None) -> None:
        self.handle = handle  # None for an input error, which needs no worker
        self.numbers = numbers
        self.error = error


class ChunkedMapIterator(UnaryIterator[Any], abc.ABC):
    """Keeps chunks in flight on workers and returns their elements in input order, or chunk by chunk as they
    finish when not `deterministic`. An error raised by the input or by `map_func` is raised at its element's
    place; the iterator then goes on with the next element.

    Threads suit map functions that release the GIL (numpy, decoding, I/O); Python-heavy functions belong in
    processes. Both read the input on the consumer's thread, keep a bounded number of chunks in flight, and grow a chunk
    until it takes a few milliseconds, so that per-chunk overhead stays small next to the work.
    """

    _target_chunk_s = 0.002
    _max_chunk_elements = 64

    def __init__(
        self, input_iterator: DatasetIterator[Any], map_func: Callable[..., Any], parallelism: int, deterministic: bool
    ) -> None:
        super().__init__(input_iterator)
        self._map_func = map_func
        self._parallelism = parallelism
        self._deterministic = deterministic
        self._pending: collections.deque[_Chunk] = collections.deque()
        self._ready: collections.deque[_Done] = collections.deque()
        self._ledger = OrderLedger((input_iterator.get_state(), 0))
        self._chunk_size = 1
        self._input_done = False

    @abc.abstractmethod
    def _has_room(self) -> bool:
        """Whether another chunk may be submitted now."""

    @abc.abstractmethod
    def _submit(self, elements: list[Any]) -> Any:
        """Starts mapping `elements`; returns a handle for `_collect`."""

    @abc.abstractmethod
    def _collect(self, handle: Any) -> tuple[list[Outcome], float]:
        """Waits for a submitted chunk: its outcomes and the seconds the map took."""

    @abc.abstractmethod
    def _wait_any(self, handles: list[Any]) -> int:
        """Waits until one of the submitted chunks (in submission order) is done; returns its index."""

    def __next__(self) -> Any:
        done = self._next_done()
        index = done.position
        self._consumed(done, index + 1)
        self._ledger.returned(done.numbers[index])
        error = None if done.errors is None else done.errors[index]
        if error is not None:
            raise error
        return done.values[index]

    def next_many(self, max_count: int) -> list[Any]:
        done = self._next_done()
        start = done.position
        end = min(start + max_count, len(done.numbers))
        if done.errors is not None:
            end = next((index for index in range(start, end) if done.errors[index] is not None), end)
            if end == start:
                return [next(self)]  # raises the error
        self._consumed(done, end)
        self._ledger.returned_many(done.numbers[start:end])
        return done.values[start:end]

    def _next_done(self) -> _Done:
        """The chunk whose outcomes come next, waiting for one if none is ready."""
        while not self._ready:
            self._submit_while_room()
            if not self._pending:
                raise StopIteration
            index = 0 if self._deterministic else self._finished_index()
            chunk = self._pending[index]
            del self._pending[index]
            self._ready.append(self._outcomes(chunk))
        return self._ready[0]

    def _consumed(self, done: _Done, position: int) -> None:
        done.position = position
        if position == len(done.numbers):
            self._ready.popleft()

    def _finished_index(self) -> int:
        for index, chunk in enumerate(self._pending):
            if chunk.handle is None:
                return index
        return self._wait_any([chunk.handle for chunk in self._pending])

    def _outcomes(self, chunk: _Chunk) -> _Done:
        if chunk.handle is None:
            return _Done(chunk.numbers, [None], [chunk.error])
        outcomes, seconds = self._collect(chunk.handle)
        fits = int(self._target_chunk_s * len(outcomes) / max(seconds, 1e-6))
        self._chunk_size = max(1, min(self._max_chunk_elements, fits))
        errors = [error for _, error in outcomes]
        return _Done(chunk.numbers, [value for value, _ in outcomes], errors if any(errors) else None)

    def _submit_while_room(self) -> None:
        bulk = has_bulk_next(self._input)
        while not self._input_done and self._has_room():
            # One get_state() per chunk: an element's position is the chunk's start plus the elements read since,
            # unless the input may reorder on restore, where only a state per element is exact.
            anchor, exact = self._input.get_state(), self._input.deterministic
            if bulk and exact and not self._ledger.replaying:
                elements, numbers, failed = self._read_run(anchor)
            else:
                elements, numbers, failed = self._read_each(anchor, exact)
            if elements:
                self._pending.append(_Chunk(self._submit(elements), numbers))
            if failed is not None:
                self._pending.append(failed)

    def _read_run(self, anchor: State) -> tuple[list[Any], list[int], _Chunk | None]:
        """A chunk's elements read with `next_many`, numbered a run at a time, and the input error after them."""
        elements: list[Any] = []
        try:
            while len(elements) < self._chunk_size:
                elements += self._input.next_many(self._chunk_size - len(elements))
        except StopIteration:
            self._input_done = True
        except Exception as error:
            numbers = self._ledger.produced_run(anchor, len(elements) + 1)
            return elements, numbers[:-1], _Chunk(None, numbers[-1:], error)
        return elements, self._ledger.produced_run(anchor, len(elements)), None

    def _read_each(self, anchor: State, exact: bool) -> tuple[list[Any], list[int], _Chunk | None]:
        """A chunk's elements read one by one, and the input error after them."""
        elements: list[Any] = []
        numbers: list[int] = []
        pulled = 0
        while len(elements) < self._chunk_size:
            error: Exception | None = None
            try:
                element = next(self._input)
            except StopIteration:
                self._input_done = True
                break
            except Exception as raised:
                error = raised
            pulled += 1
            number = self._ledger.produced((anchor, pulled) if exact else (self._input.get_state(), 0))
            if number is None:
                continue
            if error is not None:
                # An input error keeps its place: the chunk so far goes first, then the error.
                return elements, numbers, _Chunk(None, [number], error)
            elements.append(element)
            numbers.append(number)
        return elements, numbers, None

    @property
    def deterministic(self) -> bool:
        return self._deterministic and self._input.deterministic

    def get_state(self) -> State:
        return self._ledger.state()

    def set_state(self, state: State) -> None:
        self._drop_pending()
        self._ready.clear()
        self._input.set_state(state["input"])
        replay(self._input, int(state["skip"]))
        self._ledger = OrderLedger.from_state(state)
        self._input_done = False

    def _drop_pending(self) -> None:
        while self._pending:
            chunk = self._pending.popleft()
            if chunk.handle is not None:
                self._discard(chunk.handle)

    def _discard(self, handle: Any) -> None:
        """Forgets a submitted chunk whose outcomes are no longer wanted."""
        self._collect(handle)
