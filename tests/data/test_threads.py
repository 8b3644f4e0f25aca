"""Thread map under AUTOTUNE: a trial keeps the pool only when it delivers faster than the consumer's thread, and the
elements, their order and the state do not depend on where they were mapped."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from shardflow import data
from shardflow.data import threads

D = data.Dataset


def waits_on_io(x: Any) -> Any:
    time.sleep(0.002)  # releases the GIL, as a read from disk or network does
    return x * 2


def holds_the_gil(x: Any) -> Any:
    total = 0
    for step in range(300):
        total += step * step
    return x * 2 + total % 1


def map_with(map_func: Any, num_parallel_calls: int, size: int = 400) -> data.Dataset[Any]:
    """A map of `size` elements; chunks grow to ~2 ms of work, so the trial needs a few thousand quick elements."""
    options = data.Options()
    options.autotune.cpu_budget = 4
    return D.range(size).map(map_func, num_parallel_calls=num_parallel_calls).with_options(options)


def test_a_map_that_waits_on_io_keeps_its_threads_under_autotune() -> None:
    iterator: Any = iter(map_with(waits_on_io, data.AUTOTUNE))
    assert list(iterator) == [x * 2 for x in range(400)]
    assert iterator._trial is None and not iterator._inline
    iterator.close()


def test_a_map_that_holds_the_gil_gives_the_same_elements_wherever_the_trial_puts_it() -> None:
    iterator: Any = iter(map_with(holds_the_gil, data.AUTOTUNE, 4000))
    assert list(iterator) == [x * 2 for x in range(4000)]
    assert iterator._trial is None  # decided, one way or the other
    iterator.close()


def test_an_explicit_number_of_calls_always_uses_threads() -> None:
    iterator: Any = iter(map_with(holds_the_gil, 2))
    assert list(iterator) == [x * 2 for x in range(400)]
    assert iterator._trial is None and not iterator._inline
    iterator.close()


@pytest.mark.parametrize(("pool_seconds", "inline_seconds", "inline"), [(1.0, 1.0, True), (1.0, 2.0, False)])
def test_the_trial_keeps_the_pool_only_when_it_is_clearly_faster(
    monkeypatch: pytest.MonkeyPatch, pool_seconds: float, inline_seconds: float, inline: bool
) -> None:
    clock = iter([0.0, pool_seconds, 5.0, 5.0 + inline_seconds])
    monkeypatch.setattr(time, "perf_counter", lambda: next(clock))  # the module threads reads its clock from
    trial = threads._Trial()
    for _ in range(threads._SETTLE_CHUNKS + threads._WINDOW_CHUNKS):
        assert not trial.inline and trial.received(10, inline=False) is None
    assert trial.inline
    assert trial.received(10, inline=False) is None  # still in flight on the pool: not timed
    decisions = []
    for _ in range(threads._WINDOW_CHUNKS):
        trial.submitting_inline()
        decisions.append(trial.received(10, inline=True))
    assert decisions[:-1] == [None] * (threads._WINDOW_CHUNKS - 1) and decisions[-1] is inline


@pytest.mark.parametrize("taken", [5, 1500, 3990])
def test_a_state_saved_before_or_after_the_switch_resumes_exactly(taken: int) -> None:
    iterator = iter(map_with(holds_the_gil, data.AUTOTUNE, 4000))
    head = [next(iterator) for _ in range(taken)]
    state = json.loads(json.dumps(iterator.get_state()))
    iterator.close()
    restored = iter(map_with(holds_the_gil, data.AUTOTUNE, 4000))
    restored.set_state(state)
    assert head + list(restored) == [x * 2 for x in range(4000)]
    restored.close()
