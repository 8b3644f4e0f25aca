"""ignore_errors: skips elements whose production raised, counts every skip, and keeps the count in its state."""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest

from shardflow import data

D = data.Dataset


def fail_on_multiples_of_three(x: Any) -> Any:
    if x % 3 == 0:
        raise ValueError(f"record {x} is corrupt")
    return x


@pytest.mark.parametrize(
    "options",
    [{}, {"num_parallel_calls": 2}, {"num_parallel_calls": 2, "use_processes": True}],
    ids=["inline", "threads", "processes"],
)
def test_ignore_errors_skips_and_counts(options: dict[str, Any]) -> None:
    iterator = iter(D.range(10).map(fail_on_multiples_of_three, **options).prefetch(2).ignore_errors())
    assert list(iterator) == [1, 2, 4, 5, 7, 8]
    assert iterator.num_skipped == 4  # type: ignore[attr-defined]
    iterator.close()


def test_the_skip_count_is_part_of_the_state() -> None:
    dataset = D.range(10).map(fail_on_multiples_of_three).ignore_errors()
    iterator = iter(dataset)
    [next(iterator) for _ in range(3)]
    state = json.loads(json.dumps(iterator.get_state()))
    assert state["num_skipped"] == 2
    restored = iter(dataset)
    restored.set_state(state)
    assert list(restored) == [5, 7, 8]
    assert restored.num_skipped == 4  # type: ignore[attr-defined]


def test_log_warning_logs_each_skip(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="shardflow.data.errors"):
        list(D.range(4).map(fail_on_multiples_of_three).ignore_errors(log_warning=True))
    assert "record 3 is corrupt" in caplog.text


def test_without_ignore_errors_the_error_reaches_the_caller() -> None:
    with pytest.raises(ValueError, match="record 0 is corrupt"):
        list(D.range(4).map(fail_on_multiples_of_three).batch(2))
