"""prefetch(buffer_size): a thread runs the input ahead into a bounded buffer.

Each buffered element carries the input's state after producing it, so the iterator's state is the one attached to
the last element it returned: a restore re-runs what was buffered but not consumed. Elements cross between the
threads in small lists (handed over early whenever the consumer has nothing), because a queue operation per element
costs more than producing a simple element.
"""

from __future__ import annotations

import queue
import threading
import weakref
from typing import Any, TypeVar

from shardflow.data import structure
from shardflow.data.dataset import Dataset, DatasetIterator, State, UnaryDataset, UnaryIterator, active_options
from shardflow.data.options import AUTOTUNE, Options, autotuned_buffer_size

T = TypeVar("T")

_VALUE, _ERROR, _END = 0, 1, 2
Item = tuple[int, Any, State | None]
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


class _Sizing:
    """The list length and queue length that hold about `buffer_size` elements."""

    def __init__(self, buffer_size: int) -> None:
        self.list_length = max(1, buffer_size // _LISTS_PER_BUFFER)
        self.queue_length = max(1, -(-buffer_size // self.list_length))


class PrefetchIterator(UnaryIterator[T]):
    """Runs `input_iterator` on a background thread, about `buffer_size` elements ahead (AUTOTUNE: sized from
    the first element against the RAM budget). The thread starts on the first `next()` or on `start()`."""

    def __init__(self, input_iterator: DatasetIterator[T], buffer_size: int) -> None:
        super().__init__(input_iterator)
        self._buffer_size = buffer_size
        self._options = active_options()
        self._state = input_iterator.get_state()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._queue: queue.Queue[list[Item]] = queue.Queue()
        self._items: list[Item] = []
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
        if self._position == len(self._items):
            if self._finished:
                raise StopIteration
            self.start()
            self._items, self._position = self._queue.get(), 0
        kind, payload, state = self._items[self._position]
        self._position += 1
        if kind == _END:
            self._finished = True
            self._join()
            raise StopIteration
        self._state = state  # type: ignore[assignment]
        if kind == _ERROR:
            raise payload
        return payload  # type: ignore[no-any-return]

    def get_state(self) -> State:
        return self._state

    def set_state(self, state: State) -> None:
        self._join()
        self._input.set_state(state)
        self._state = state
        self._items, self._position = [], 0
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
    buffer: queue.Queue[list[Item]],
    stop: threading.Event,
    sizing: _Sizing,
    autotune_options: Options | None,
) -> None:
    items: list[Item] = []
    while not stop.is_set():
        item: Item
        try:
            element = next(input_iterator)
            item = (_VALUE, element, input_iterator.get_state())
        except StopIteration:
            item = (_END, None, None)
        except BaseException as error:
            item = (_ERROR, error, input_iterator.get_state())
        items.append(item)
        if autotune_options is not None and item[0] == _VALUE:
            sizing = _Sizing(autotuned_buffer_size(structure.leaf_nbytes(item[1]), autotune_options))
            with buffer.mutex:
                buffer.maxsize = sizing.queue_length
            autotune_options = None
        if item[0] == _VALUE and len(items) < sizing.list_length and buffer.qsize():
            continue
        while not stop.is_set():
            try:
                buffer.put(items, timeout=_POLL_S)
                break
            except queue.Full:
                continue
        items = []
        if item[0] == _END:
            return
