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


def test_prefetch_state_is_where_the_consumer_is_not_where_the_thread_read_ahead_to() -> None:
    iterator = iter(D.range(100).prefetch(10))
    assert [next(iterator) for _ in range(3)] == [0, 1, 2]
    time.sleep(0.05)  # let the thread run ahead
    state = iterator.get_state()
    iterator.close()
    assert state["input"]["index"] + state["skip"] == 3
    restored = iter(D.range(100).prefetch(10))
    restored.set_state(state)
    assert next(restored) == 3
    restored.close()


def test_prefetch_over_a_non_deterministic_map_records_exact_states() -> None:
    def make() -> data.Dataset[Any]:
        return D.range(50).map(lambda x: x, num_parallel_calls=3, deterministic=False).prefetch(8)

    iterator = iter(make())
    head = [next(iterator) for _ in range(7)]
    state = iterator.get_state()
    rest = list(iterator)
    assert state["skip"] == 0  # a state after an element, not one to replay from
    restored = iter(make())
    restored.set_state(state)
    assert sorted(head + list(restored)) == sorted(head + rest) == list(range(50))


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
