"""Parallel map on a thread pool, for map functions that release the GIL; under AUTOTUNE, on the consumer's thread
when that is as fast."""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable
from typing import Any

from shardflow.data.dataset import DatasetIterator, State
from shardflow.data.parallel import ChunkedMapIterator, Outcome, map_chunk

Handle = tuple[concurrent.futures.Future[tuple[list[Outcome], float]], bool]
"""A submitted chunk, and whether it was mapped on the consumer's thread."""

# AUTOTUNE's trial: chunks on the pool to settle the chunk size, then a window of chunks timed on the pool (kept
# full, so that its rate is a steady one) and one on the consumer's thread. The consumer's thread is kept unless the
# pool delivered this much faster: threads that only take turns at the GIL cost more than they give.
_SETTLE_CHUNKS = 4
_WINDOW_CHUNKS = 8
_POOL_MIN_GAIN = 1.1


class _Trial:
    """Times a window of chunks on the pool, then one on the consumer's thread; `received` says which was faster."""

    def __init__(self) -> None:
        self.pool_received = 0
        self.inline_received = 0
        self.elements = 0
        self.started = 0.0
        self.pool_rate: float | None = None  # elements per second; once known, chunks are mapped inline

    @property
    def inline(self) -> bool:
        """Whether chunks submitted now are mapped on the consumer's thread."""
        return self.pool_rate is not None

    def submitting_inline(self) -> None:
        if not self.inline_received and not self.elements:
            self.started = time.perf_counter()  # the consumer's window starts with its first chunk

    def received(self, num_elements: int, inline: bool) -> bool | None:
        """Counts a chunk the consumer received; once both windows are timed, whether to map inline from now on."""
        if not inline:
            self.pool_received += 1
            if self.pool_received == _SETTLE_CHUNKS:
                self.started = time.perf_counter()
            elif _SETTLE_CHUNKS < self.pool_received <= _SETTLE_CHUNKS + _WINDOW_CHUNKS:
                self.elements += num_elements
                if self.pool_received == _SETTLE_CHUNKS + _WINDOW_CHUNKS:
                    self.pool_rate = self.elements / max(time.perf_counter() - self.started, 1e-9)
                    self.elements = 0
            return None
        self.inline_received += 1
        self.elements += num_elements
        if self.inline_received < _WINDOW_CHUNKS or self.pool_rate is None:
            return None
        inline_rate = self.elements / max(time.perf_counter() - self.started, 1e-9)
        return self.pool_rate < _POOL_MIN_GAIN * inline_rate


class ThreadMapIterator(ChunkedMapIterator):
    """Chunks mapped on `parallelism` threads. With AUTOTUNE (`autotuned`), a short trial compares the pool with
    mapping on the consumer's thread, where the input is read anyway: a map_func that holds the GIL (Python, small
    numpy steps) gains nothing from threads taking turns, while one that waits on I/O or releases the GIL does."""

    def __init__(
        self,
        input_iterator: DatasetIterator[Any],
        map_func: Callable[..., Any],
        parallelism: int,
        deterministic: bool,
        autotuned: bool = False,
    ) -> None:
        super().__init__(input_iterator, map_func, parallelism, deterministic)
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._trial = _Trial() if autotuned else None
        self._inline = False

    def _has_room(self) -> bool:
        inline = self._inline or (self._trial is not None and self._trial.inline)
        # On the pool, twice the threads in flight, so that a thread finishing never waits for the consumer.
        return len(self._pending) < (1 if inline else 2 * self._parallelism)

    def _submit(self, elements: list[Any]) -> Handle:
        if self._inline or (self._trial is not None and self._trial.inline):
            if self._trial is not None:
                self._trial.submitting_inline()
            done: concurrent.futures.Future[tuple[list[Outcome], float]] = concurrent.futures.Future()
            done.set_result(map_chunk(self._map_func, elements))
            return done, True
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(self._parallelism, thread_name_prefix="shardflow-map")
        return self._pool.submit(map_chunk, self._map_func, elements), False

    def _collect(self, handle: Handle) -> tuple[list[Outcome], float]:
        future, inline = handle
        outcomes, seconds = future.result()
        if self._trial is not None:
            decision = self._trial.received(len(outcomes), inline)
            if decision is not None:
                self._inline, self._trial = decision, None
        return outcomes, seconds

    def set_state(self, state: State) -> None:
        super().set_state(state)
        if self._trial is not None:
            self._trial = _Trial()  # chunks in flight were dropped: time both windows again

    def _wait_any(self, handles: list[Handle]) -> int:
        concurrent.futures.wait([future for future, _ in handles], return_when=concurrent.futures.FIRST_COMPLETED)
        return next(index for index, (future, _) in enumerate(handles) if future.done())

    def _discard(self, handle: Handle) -> None:
        handle[0].cancel()

    def close(self) -> None:
        self._drop_pending()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        super().close()
