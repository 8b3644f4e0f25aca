"""prefetch(buffer_size): a thread runs the input ahead into a bounded buffer."""

from __future__ import annotations

import queue
import threading
import weakref
from typing import Any, TypeVar

from shardflow.data import structure
from shardflow.data.dataset import (
    Dataset,
    DatasetIterator,
    State,
    UnaryDataset,
    UnaryIterator,
    active_options,
    has_bulk_next,
    replay,
)
from shardflow.data.options import AUTOTUNE, Options, autotuned_buffer_size

T = TypeVar("T")

Handover = tuple[State, list[Any], BaseException | None, State]
"""A list passed from the thread: the input's state before its elements, the elements, what the input raised after
them (StopIteration at the end, or an error; None if nothing), and the input's state after all that."""
# How often a blocked producer checks whether it should stop.
_POLL_S = 0.05
# A buffer of n elements is handed over in lists of up to n / 4 elements (a queue of about 4 lists).
_LISTS_PER_BUFFER = 4


class PrefetchDataset(UnaryDataset[T]):
    def __init__(self, input_dataset: Dataset[T], buffer_size: int) -> None:
        super().__init__(input_dataset)
        if not isinstance(buffer_size, int) or (buffer_size < 0 and buffer_size != AUTOTUNE):
            raise ValueError(f"prefetch buffer_size must be a non-negative int or AUTOTUNE, got {buffer_size!r}")
        self._buffer_size = buffer_size

    def _iterator(self) -> DatasetIterator[T]:
        if self._buffer_size == 0:
            return iter(self._input)
        return PrefetchIterator(iter(self._input), self._buffer_size)

    def _cardinality(self) -> int:
        return self._input._cardinality()

    def _element_spec(self) -> Any | None:
        return self._input._element_spec()


class _Sizing:
    """The list length and queue length that hold about `buffer_size` elements."""

    def __init__(self, buffer_size: int) -> None:
        self.list_length = max(1, buffer_size // _LISTS_PER_BUFFER)
        self.queue_length = max(1, -(-buffer_size // self.list_length))


class PrefetchIterator(UnaryIterator[T]):
    """Runs `input_iterator` on a background thread, about `buffer_size` elements ahead (AUTOTUNE: sized from
    the first element against the RAM budget). The thread starts on the first `next()` or on `start()`.

    Elements cross between the threads in lists (handed over early whenever the consumer has nothing; an input with
    `next_many` gives whole lists), because a queue operation per element costs more than producing a simple
    element. Each list carries the input's state before its first element and after its end, so the iterator's
    state is the state after the last list it finished, or the state before the current list plus the elements
    consumed from it: a restore sets the input there and replays those elements, re-running what was buffered but not
    consumed. One `get_state()` per list instead of one per element keeps the sources' state off the hot path; over
    an input that may reorder on restore, every list holds one element, so the state is always an exact one.
    """

    def __init__(self, input_iterator: DatasetIterator[T], buffer_size: int) -> None:
        super().__init__(input_iterator)
        self._buffer_size = buffer_size
        self._options = active_options()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._queue: queue.Queue[Handover] = queue.Queue()
        # The state: the input's state `_base` followed by `_skip` elements.
        self._base = input_iterator.get_state()
        self._skip = 0
        self._elements: list[Any] = []
        self._raised: BaseException | None = None  # what the input raised after `_elements`
        self._end_state: State = self._base
        self._position = 0
        self._finished = False

    def start(self) -> None:
        if self._thread is not None or self._finished:
            return
        self._stop = threading.Event()
        sizing = _Sizing(1 if self._buffer_size == AUTOTUNE else self._buffer_size)
        self._queue = queue.Queue(sizing.queue_length)
        autotune_options = self._options if self._buffer_size == AUTOTUNE else None
        # The thread holds the input, the queue and the stop flag but not this object, so that dropping the
        # iterator without close() still stops it (through the finalizer).
        self._thread = threading.Thread(
            target=_produce,
            args=(self._input, self._queue, self._stop, sizing, autotune_options),
            name="shardflow-prefetch",
            daemon=True,
        )
        weakref.finalize(self, self._stop.set)
        self._thread.start()

    def __next__(self) -> T:
        while self._position == len(self._elements):
            self._next_list()
        element = self._elements[self._position]
        self._consumed(1)
        return element  # type: ignore[no-any-return]

    def next_many(self, max_count: int) -> list[T]:
        while self._position == len(self._elements):
            self._next_list()
        start = self._position
        elements = self._elements[start : start + max_count]
        self._consumed(len(elements))
        return elements

    def _consumed(self, count: int) -> None:
        self._position += count
        if self._position == len(self._elements) and self._raised is None:
            self._base, self._skip = self._end_state, 0
        else:
            self._skip += count

    def _next_list(self) -> None:
        """Raises what the input raised after the current list, or takes the next list from the thread."""
        raised = self._raised
        if raised is not None:
            self._raised = None
            self._base, self._skip = self._end_state, 0
            if isinstance(raised, StopIteration):
                self._finished = True
                self._join()
            raise raised
        if self._finished:
            raise StopIteration
        self.start()
        self._base, self._elements, self._raised, self._end_state = self._queue.get()
        self._skip, self._position = 0, 0

    def get_state(self) -> State:
        return {"input": self._base, "skip": self._skip}

    def set_state(self, state: State) -> None:
        self._join()
        self._input.set_state(state["input"])
        replay(self._input, int(state["skip"]))
        self._base, self._skip = state["input"], int(state["skip"])
        self._elements, self._raised, self._position = [], None, 0
        self._finished = False

    def _join(self) -> None:
        if self._thread is None:
            return
        self._stop.set()
        while self._thread.is_alive():
            _drain(self._queue)
            self._thread.join(_POLL_S)
        self._thread = None

    def close(self) -> None:
        self._join()
        super().close()


def _drain(buffer: queue.Queue[Any]) -> None:
    try:
        while True:
            buffer.get_nowait()
    except queue.Empty:
        pass


def _produce(
    input_iterator: DatasetIterator[Any],
    buffer: queue.Queue[Handover],
    stop: threading.Event,
    sizing: _Sizing,
    autotune_options: Options | None,
) -> None:
    bulk = has_bulk_next(input_iterator)
    before = input_iterator.get_state()
    while not stop.is_set():
        # Over an input that may reorder on restore, every element is its own list, so that the state is exact.
        deterministic = input_iterator.deterministic
        elements: list[Any] = []
        raised: BaseException | None = None
        try:
            if bulk:
                elements = input_iterator.next_many(sizing.list_length if deterministic else 1)
            else:
                elements.append(next(input_iterator))
                while len(elements) < sizing.list_length and buffer.qsize() and deterministic:
                    elements.append(next(input_iterator))
        except BaseException as error:
            raised = error
        if autotune_options is not None and elements:
            sizing = _Sizing(autotuned_buffer_size(structure.leaf_nbytes(elements[0]), autotune_options))
            with buffer.mutex:
                buffer.maxsize = sizing.queue_length
            autotune_options = None
        after = input_iterator.get_state()
        while not stop.is_set():
            try:
                buffer.put((before, elements, raised, after), timeout=_POLL_S)
                break
            except queue.Full:
                continue
        if isinstance(raised, StopIteration):
            return
        before = after
