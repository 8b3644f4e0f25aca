"""repeat, take, skip, shard, concatenate and enumerate: argument checks and state across epochs."""

from __future__ import annotations

import json

import numpy as np
import pytest

from shardflow import data

D = data.Dataset


def test_shard_names_the_valid_index_range() -> None:
    with pytest.raises(ValueError, match=r"shard index must be in \[0, num_shards=3\), got 3"):
        D.range(5).shard(3, 3)
    with pytest.raises(ValueError, match="num_shards must be a positive int"):
        D.range(5).shard(0, 0)


def test_take_and_skip_reject_counts_that_are_not_ints() -> None:
    with pytest.raises(TypeError, match=r"take count must be an int \(negative for all\), got 1.5"):
        D.range(5).take(1.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="skip count"):
        D.range(5).skip("3")  # type: ignore[arg-type]


def test_repeat_state_carries_the_epoch() -> None:
    dataset = D.range(3).repeat(3)
    iterator = iter(dataset)
    [next(iterator) for _ in range(4)]
    state = json.loads(json.dumps(iterator.get_state()))
    assert state["epoch"] == 1
    restored = iter(dataset)
    restored.set_state(state)
    assert list(restored) == [1, 2, 0, 1, 2]


def test_repeat_restored_at_an_epoch_end_moves_to_the_next_epoch() -> None:
    dataset = D.range(2).repeat(2)
    iterator = iter(dataset)
    [next(iterator) for _ in range(2)]
    restored = iter(dataset)
    restored.set_state(iterator.get_state())
    assert list(restored) == [0, 1]


def test_concatenate_rejects_a_non_dataset() -> None:
    with pytest.raises(TypeError, match=r"concatenate expects a shardflow\.data\.Dataset"):
        D.range(2).concatenate([1, 2])  # type: ignore[arg-type]


def test_enumerate_counts_from_start_as_int64() -> None:
    index, value = next(iter(D.from_tensors(b"x").enumerate(start=7)))
    assert isinstance(index, np.int64) and index == 7 and value == b"x"
