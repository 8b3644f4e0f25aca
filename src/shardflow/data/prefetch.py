"""prefetch(buffer_size): a thread runs the input ahead into a bounded buffer.

Each buffered element carries the input's state after producing it, so the iterator's state is the one attached to
the last element it returned: a restore re-runs what was buffered but not consumed.
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
# How often a blocked producer checks whether it should stop.
_POLL_S = 0.05


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


class PrefetchIterator(UnaryIterator[T]):
    """Runs `input_iterator` on a background thread, at most `buffer_size` elements ahead (AUTOTUNE: sized from
    the first element against the RAM budget). The thread starts on the first `next()` or on `start()`."""

    def __init__(self, input_iterator: DatasetIterator[T], buffer_size: int) -> None:
        super().__init__(input_iterator)
        self._buffer_size = buffer_size
        self._options = active_options()
        self._state = input_iterator.get_state()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._queue: queue.Queue[tuple[int, Any, State | None]] = queue.Queue()
        self._finished = False

    def start(self) -> None:
        if self._thread is not None or self._finished:
            return
        self._stop = threading.Event()
        self._queue = queue.Queue(1 if self._buffer_size == AUTOTUNE else self._buffer_size)
        autotune_options = self._options if self._buffer_size == AUTOTUNE else None
        # The thread holds the input, the queue and the stop flag but not this object, so that dropping the
        # iterator without close() still stops it (through the finalizer).
        self._thread = threading.Thread(
            target=_produce,
            args=(self._input, self._queue, self._stop, autotune_options),
            name="shardflow-prefetch",
            daemon=True,
        )
        weakref.finalize(self, self._stop.set)
        self._thread.start()

    def __next__(self) -> T:
        if self._finished:
            raise StopIteration
        self.start()
        kind, payload, state = self._queue.get()
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
    buffer: queue.Queue[tuple[int, Any, State | None]],
    stop: threading.Event,
    autotune_options: Options | None,
) -> None:
    while not stop.is_set():
        item: tuple[int, Any, State | None]
        try:
            element = next(input_iterator)
            item = (_VALUE, element, input_iterator.get_state())
        except StopIteration:
            item = (_END, None, None)
        except BaseException as error:
            item = (_ERROR, error, input_iterator.get_state())
        if autotune_options is not None and item[0] == _VALUE:
            with buffer.mutex:
                buffer.maxsize = autotuned_buffer_size(structure.leaf_nbytes(item[1]), autotune_options)
            autotune_options = None
        while not stop.is_set():
            try:
                buffer.put(item, timeout=_POLL_S)
                break
            except queue.Full:
                continue
        if item[0] == _END:
            return
