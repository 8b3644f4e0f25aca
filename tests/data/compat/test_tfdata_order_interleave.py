"""Element sequences of shardflow.data equal tf.data's: interleave, flat_map, filter and the positional ops."""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import tensorflow as tf

from shardflow import data

Pipeline = Callable[[Any], Any]


def run_both(pipeline: Pipeline) -> tuple[list[Any], list[Any]]:
    return list(pipeline(data.Dataset)), list(pipeline(tf.data.Dataset).as_numpy_iterator())


def uneven(D: Any, x: Any) -> Any:
    """Input x opens x * 10, x * 10 + 1, ... with x % 4 + 1 elements, so inputs end at different times."""
    return D.range(x * 10, x * 10 + x % 4 + 1)


@pytest.mark.parametrize(("cycle_length", "block_length"), [(1, 1), (2, 1), (3, 2), (4, 3), (5, 1), (8, 2)])
def test_interleave_equals_tf(cycle_length: int, block_length: int, same_elements: Any) -> None:
    same_elements(
        *run_both(
            lambda D: D.range(1, 8).interleave(
                lambda x: uneven(D, x), cycle_length=cycle_length, block_length=block_length
            )
        )
    )


@pytest.mark.parametrize(("cycle_length", "block_length"), [(2, 1), (3, 2), (4, 4)])
def test_parallel_deterministic_interleave_equals_tf(cycle_length: int, block_length: int, same_elements: Any) -> None:
    same_elements(
        *run_both(
            lambda D: D.range(1, 8).interleave(
                lambda x: uneven(D, x),
                cycle_length=cycle_length,
                block_length=block_length,
                num_parallel_calls=2,
                deterministic=True,
            )
        )
    )


def test_interleave_of_batched_dicts_equals_tf(same_elements: Any) -> None:
    same_elements(
        *run_both(
            lambda D: D.range(3).interleave(
                lambda x: D.zip({"x": D.range(x, x + 5), "y": D.range(5)}).batch(2), cycle_length=2, block_length=2
            )
        )
    )


@pytest.mark.parametrize(
    "pipeline",
    [
        lambda D: D.range(1, 6).flat_map(lambda x: uneven(D, x)),
        lambda D: D.range(4).flat_map(lambda x: D.range(0)),
        lambda D: D.range(3).flat_map(lambda x: D.from_tensors(x).repeat(2)).flat_map(lambda y: D.range(y + 1)),
    ],
    ids=["uneven", "all_empty", "nested"],
)
def test_flat_map_equals_tf(pipeline: Pipeline, same_elements: Any) -> None:
    same_elements(*run_both(pipeline))


@pytest.mark.parametrize(
    "pipeline",
    [
        lambda D: D.range(20).filter(lambda x: x % 3 == 0),
        lambda D: D.range(5).filter(lambda x: x > 10),
        lambda D: D.zip((D.range(10), D.range(10, 20))).filter(lambda a, b: (a + b) % 4 == 0),
    ],
    ids=["modulo", "none_kept", "tuple_unpacked"],
)
def test_filter_equals_tf(pipeline: Pipeline, same_elements: Any) -> None:
    same_elements(*run_both(pipeline))


@pytest.mark.parametrize(
    "pipeline",
    [
        lambda D: D.range(3).repeat(3),
        lambda D: D.range(3).repeat(0),
        lambda D: D.range(3).repeat().take(8),
        lambda D: D.range(0).repeat().take(3),
        lambda D: D.range(3).repeat(2).repeat(2),
        lambda D: D.range(10).skip(3),
        lambda D: D.range(10).skip(30),
        lambda D: D.range(10).skip(-1),
        lambda D: D.range(10).take(4),
        lambda D: D.range(10).take(-1),
        lambda D: D.range(10).take(0),
        lambda D: D.range(10).skip(2).take(5).repeat(2),
        lambda D: D.range(4).concatenate(D.range(10, 13)),
        lambda D: D.range(0).concatenate(D.range(2)).concatenate(D.range(0)),
    ],
    ids=[
        "repeat",
        "repeat_0",
        "repeat_forever_take",
        "repeat_empty_forever",
        "repeat_nested",
        "skip",
        "skip_past_end",
        "skip_all",
        "take",
        "take_all",
        "take_0",
        "skip_take_repeat",
        "concatenate",
        "concatenate_empty",
    ],
)
def test_positional_ops_equal_tf(pipeline: Pipeline, same_elements: Any) -> None:
    same_elements(*run_both(pipeline))


@pytest.mark.parametrize(("num_shards", "index"), [(1, 0), (3, 0), (3, 2), (4, 1), (12, 11), (15, 3)])
def test_shard_equals_tf(num_shards: int, index: int, same_elements: Any) -> None:
    same_elements(*run_both(lambda D: D.range(13).shard(num_shards, index)))


def test_shard_then_interleave_then_batch_equals_tf(same_elements: Any) -> None:
    same_elements(
        *run_both(
            lambda D: (
                D.range(12)
                .shard(2, 1)
                .interleave(lambda x: uneven(D, x), cycle_length=3, block_length=2)
                .batch(4)
                .enumerate()
            )
        )
    )


def test_map_of_dict_elements_equals_tf(same_elements: Any) -> None:
    values = {"a": np.arange(8, dtype=np.int64), "b": np.arange(8, dtype=np.float64) / 2}
    same_elements(
        *run_both(lambda D: D.from_tensor_slices(values).map(lambda e: {"sum": e["a"] + 1, "b": e["b"]}).batch(3))
    )
