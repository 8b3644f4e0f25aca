"""interleave: argument checks, and parallel reading that keeps tf.data's order and exact state."""

from __future__ import annotations

import json
from typing import Any

import pytest

from shardflow import data

D = data.Dataset


def test_map_func_must_return_a_dataset() -> None:
    def not_a_dataset(x: Any) -> Any:
        return [x]

    with pytest.raises(TypeError, match="map_func must return a Dataset, got list"):
        list(D.range(2).interleave(not_a_dataset, cycle_length=1))


@pytest.mark.parametrize(("argument", "value"), [("cycle_length", 0), ("block_length", -2)])
def test_lengths_must_be_positive(argument: str, value: int) -> None:
    lengths: dict[str, Any] = {argument: value}
    with pytest.raises(ValueError, match=f"interleave {argument} must be a positive int"):
        D.range(2).interleave(lambda x: D.range(x), **lengths)


def test_parallel_interleave_equals_sequential_interleave() -> None:
    def open_input(x: Any) -> Any:
        return D.range(x * 10, x * 10 + x % 3 + 2).map(lambda value: value * 2, num_parallel_calls=2)

    sequential = list(D.range(9).interleave(open_input, cycle_length=3, block_length=2))
    parallel = D.range(9).interleave(open_input, cycle_length=3, block_length=2, num_parallel_calls=data.AUTOTUNE)
    assert list(parallel) == sequential


def test_state_records_each_open_input_by_position() -> None:
    iterator = iter(D.range(4).interleave(lambda x: D.range(x * 100, x * 100 + 5), cycle_length=2))
    [next(iterator) for _ in range(3)]
    state = iterator.get_state()
    assert [place["input"] for place in state["places"]] == [{"index": 0}, {"index": 1}]
    assert len(json.dumps(state)) < 300


def test_state_from_another_cycle_length_is_refused() -> None:
    state = iter(D.range(4).interleave(lambda x: D.range(x), cycle_length=2)).get_state()
    other = iter(D.range(4).interleave(lambda x: D.range(x), cycle_length=3))
    with pytest.raises(ValueError, match="cycle_length 2, this pipeline has 3"):
        other.set_state(state)
