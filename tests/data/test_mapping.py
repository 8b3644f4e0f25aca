"""map and filter: calling conventions, conversions, thread parallelism and error messages."""

from __future__ import annotations

import random
import threading
import time
from typing import Any

import numpy as np
import pytest

from shardflow import data

D = data.Dataset


def test_map_unpacks_tuples_but_not_dicts() -> None:
    pairs = D.zip((D.range(3), D.range(10, 13)))
    assert list(pairs.map(lambda a, b: a + b)) == [10, 12, 14]
    assert list(D.from_tensors({"a": 1}).map(lambda element: element["a"] + 1)) == [2]


def test_map_converts_strings_it_returns_to_bytes() -> None:
    assert list(D.range(2).map(lambda x: {"name": f"item-{x}"})) == [{"name": b"item-0"}, {"name": b"item-1"}]


def test_map_rejects_a_non_callable() -> None:
    with pytest.raises(TypeError, match="map expects a callable map_func"):
        D.range(2).map(3)  # type: ignore[arg-type]


def test_map_rejects_a_bad_num_parallel_calls() -> None:
    with pytest.raises(ValueError, match="num_parallel_calls must be a positive int, None or AUTOTUNE, got 0"):
        D.range(2).map(lambda x: x, num_parallel_calls=0)


def slow_identity(x: Any) -> Any:
    time.sleep(random.uniform(0, 0.003))
    return x


def test_thread_map_keeps_the_input_order_by_default() -> None:
    assert list(D.range(60).map(slow_identity, num_parallel_calls=4)) == list(range(60))


def test_thread_map_runs_calls_concurrently() -> None:
    barrier = threading.Barrier(3, timeout=10)

    def wait_for_two_others(x: Any) -> Any:
        barrier.wait()  # only returns if three calls run at once
        return x

    assert list(D.range(3).map(wait_for_two_others, num_parallel_calls=3)) == [0, 1, 2]


def test_non_deterministic_thread_map_returns_every_element_once() -> None:
    mapped = D.range(60).map(slow_identity, num_parallel_calls=4, deterministic=False)
    assert sorted(mapped) == list(range(60))


def test_thread_map_error_surfaces_at_its_element_and_the_iterator_goes_on() -> None:
    def fail_on_two(x: Any) -> Any:
        if x == 2:
            raise KeyError("two")
        return x

    iterator = iter(D.range(5).map(fail_on_two, num_parallel_calls=2))
    assert [next(iterator), next(iterator)] == [0, 1]
    with pytest.raises(KeyError, match="two"):
        next(iterator)
    assert list(iterator) == [3, 4]


def test_filter_accepts_numpy_booleans() -> None:
    assert list(D.range(6).filter(lambda x: np.array(x % 2 == 0))) == [0, 2, 4]


def test_filter_names_a_non_scalar_predicate_result() -> None:
    with pytest.raises(TypeError, match=r"filter predicate must return a scalar bool, got ndarray \(2,\)"):
        list(D.from_tensors(np.arange(2)).filter(lambda x: x > 0))


def test_map_converts_returned_string_arrays_to_object_arrays_of_bytes() -> None:
    (names,) = list(D.range(1).map(lambda x: np.array(["a", "bc"])))
    assert names.dtype == object and names.tolist() == [b"a", b"bc"]
