"""Parallel map on a thread pool, and the ledger that keeps a parallel iterator's state exact.

Threads suit map functions that release the GIL (numpy, decoding, I/O); Python-heavy functions belong in
processes (processes.py). Both pull the input on the consumer's thread and keep a bounded number of elements
in flight; each in-flight element remembers the input's state after it was produced.
"""

from __future__ import annotations

import collections
import concurrent.futures
from collections.abc import Callable
from typing import Any

from shardflow.data.dataset import DatasetIterator, State, UnaryIterator
from shardflow.data.mapping import apply_map


class OrderLedger:
    """Which produced elements the consumer has been given, as a resumable position.

    Elements are numbered in the order the input produced them. The state is the input's state after the longest
    prefix of elements that were all returned, plus the offsets past that prefix of elements already returned out
    of order (at most the number in flight). A restore re-reads from the prefix and drops those offsets, so even a
    non-deterministic iterator resumes with exactly the elements it had not yet returned."""

    def __init__(self, input_state: State, returned_offsets: list[int] | None = None) -> None:
        self._prefix = 0
        self._prefix_state = input_state
        self._next_number = 0
        self._states: dict[int, State] = {}
        self._returned = set(returned_offsets or ())

    @classmethod
    def from_state(cls, state: State) -> OrderLedger:
        return cls(state["input"], state["returned"])

    def produced(self, input_state: State) -> int | None:
        """Numbers the next input element; None if it was returned before a restore and must be dropped."""
        number = self._next_number
        self._next_number += 1
        self._states[number] = input_state
        if number in self._returned:
            self._advance()
            return None
        return number

    def returned(self, number: int) -> None:
        self._returned.add(number)
        self._advance()

    def _advance(self) -> None:
        while self._prefix in self._returned:
            self._returned.remove(self._prefix)
            self._prefix_state = self._states.pop(self._prefix)
            self._prefix += 1

    def state(self) -> State:
        return {"input": self._prefix_state, "returned": sorted(number - self._prefix for number in self._returned)}


class ThreadMapIterator(UnaryIterator[Any]):
    def __init__(
        self, input_iterator: DatasetIterator[Any], map_func: Callable[..., Any], parallelism: int, deterministic: bool
    ) -> None:
        super().__init__(input_iterator)
        self._map_func = map_func
        self._parallelism = parallelism
        self._deterministic = deterministic
        # Twice the threads in flight, so that a thread finishing never waits for the consumer to refill.
        self._capacity = 2 * parallelism
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._pending: collections.deque[tuple[int, concurrent.futures.Future[Any]]] = collections.deque()
        self._ledger = OrderLedger(input_iterator.get_state())
        self._input_done = False

    def __next__(self) -> Any:
        self._top_up()
        if not self._pending:
            raise StopIteration
        if self._deterministic:
            number, future = self._pending.popleft()
        else:
            number, future = self._first_done()
        self._ledger.returned(number)
        return future.result()

    def _first_done(self) -> tuple[int, concurrent.futures.Future[Any]]:
        concurrent.futures.wait([future for _, future in self._pending], return_when=concurrent.futures.FIRST_COMPLETED)
        for index, (number, future) in enumerate(self._pending):
            if future.done():
                del self._pending[index]
                return number, future
        raise AssertionError("wait returned without a finished future")

    def _top_up(self) -> None:
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(self._parallelism, thread_name_prefix="shardflow-map")
        while not self._input_done and len(self._pending) < self._capacity:
            future: concurrent.futures.Future[Any] | None = None
            try:
                element = next(self._input)
            except StopIteration:
                self._input_done = True
                return
            except Exception as error:
                future = concurrent.futures.Future()
                future.set_exception(error)
            number = self._ledger.produced(self._input.get_state())
            if number is None:
                continue
            if future is None:
                future = self._pool.submit(apply_map, self._map_func, element)
            self._pending.append((number, future))

    def get_state(self) -> State:
        return self._ledger.state()

    def set_state(self, state: State) -> None:
        self._drop_pending()
        self._input.set_state(state["input"])
        self._ledger = OrderLedger.from_state(state)
        self._input_done = False

    def _drop_pending(self) -> None:
        for _, future in self._pending:
            future.cancel()
        self._pending.clear()

    def close(self) -> None:
        self._drop_pending()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        super().close()
