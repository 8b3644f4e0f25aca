"""prefetch: a background thread, exact state, errors passed through in place, and threads that stop."""

from __future__ import annotations

import gc
import threading
import time
from typing import Any

import pytest

from shardflow import data

D = data.Dataset


def prefetch_threads() -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name == "shardflow-prefetch"]


def wait_until(condition: Any) -> bool:
    deadline = time.monotonic() + 5
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return bool(condition())


def test_prefetch_keeps_the_order_and_the_state_of_the_last_returned_element() -> None:
    iterator = iter(D.range(100).prefetch(10))
    assert [next(iterator) for _ in range(3)] == [0, 1, 2]
    assert iterator.get_state() == {"index": 3}  # not the position the thread has read ahead to
    iterator.close()


def test_prefetch_passes_errors_through_in_place() -> None:
    def fail_on_one(x: Any) -> Any:
        if x == 1:
            raise OSError("unreadable")
        return x

    iterator = iter(D.range(3).map(fail_on_one).prefetch(2))
    assert next(iterator) == 0
    with pytest.raises(OSError, match="unreadable"):
        next(iterator)
    assert list(iterator) == [2]


@pytest.mark.parametrize("buffer_size", [0, 1, data.AUTOTUNE])
def test_prefetch_sizes(buffer_size: int) -> None:
    assert list(D.range(5).prefetch(buffer_size)) == list(range(5))


def test_prefetch_rejects_negative_sizes() -> None:
    with pytest.raises(ValueError, match="prefetch buffer_size must be a non-negative int or AUTOTUNE, got -5"):
        D.range(5).prefetch(-5)


def test_close_stops_the_thread() -> None:
    iterator = iter(D.range(10_000).prefetch(2))
    next(iterator)
    iterator.close()
    assert not [thread for thread in prefetch_threads() if thread.is_alive()]


def test_dropping_an_iterator_stops_its_thread() -> None:
    before = len(prefetch_threads())
    iterator = iter(D.range(10_000).prefetch(2))
    next(iterator)
    del iterator
    gc.collect()
    assert wait_until(lambda: len(prefetch_threads()) <= before)
