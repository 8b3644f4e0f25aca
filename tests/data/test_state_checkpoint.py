"""Iterator state: small JSON, and a fresh iterator restored from it continues with exactly the same elements."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardflow import data

D = data.Dataset
MakePipeline = Callable[[], data.Dataset[Any]]


def json_round_trip(state: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(state))


def resumed_sequence(make: MakePipeline, k: int) -> tuple[list[Any], list[Any]]:
    """(k elements, then the rest from a new iterator restored from the JSON state) and the uninterrupted run."""
    expected = list(make())
    iterator = iter(make())
    head = [next(iterator) for _ in range(k)]
    state = json_round_trip(iterator.get_state())
    iterator.close()
    restored = iter(make())
    restored.set_state(state)
    tail = list(restored)
    restored.close()
    return head + tail, expected


def test_shuffle_10k_state_is_under_1kb_where_tf_data_saves_megabytes() -> None:
    iterator = iter(D.range(100_000).shuffle(10_000, seed=7))
    for _ in range(12_345):
        next(iterator)
    assert len(json.dumps(iterator.get_state())) <= 1024


def test_shuffle_10k_map_batch_prefetch_state_is_under_1kb() -> None:
    pipeline = (
        D.range(100_000)
        .shuffle(10_000, seed=7)
        .map(lambda x: {"x": x, "double": x * 2}, num_parallel_calls=2)
        .batch(64)
        .prefetch(4)
    )
    iterator = iter(pipeline)
    for _ in range(300):
        next(iterator)
    size = len(json.dumps(iterator.get_state()))
    iterator.close()
    assert size <= 1024


def write_shards(directory: Path, num_files: int, records_per_file: int) -> str:
    for file_index in range(num_files):
        lines = [f"{file_index}:{record}" for record in range(records_per_file + file_index)]
        (directory / f"shard-{file_index}.txt").write_text("\n".join(lines) + "\n")
    return str(directory / "shard-*.txt")


def read_lines(filename: bytes) -> Any:
    with open(filename, "rb") as lines:
        for line in lines:
            yield line.rstrip(b"\n")


def file_pipeline(pattern: str, num_parallel_calls: int | None) -> MakePipeline:
    return lambda: (
        D.list_files(pattern, seed=5)
        .interleave(
            lambda name: D.from_generator(read_lines, args=(name,)),
            cycle_length=3,
            block_length=2,
            num_parallel_calls=num_parallel_calls,
        )
        .shuffle(16, seed=2)
        .batch(5)
        .prefetch(3)
    )


@pytest.mark.parametrize("num_parallel_calls", [None, 2])
@pytest.mark.parametrize("k", [0, 1, 7, 18])
def test_file_interleave_shuffle_batch_prefetch_resumes_exactly(
    tmp_path: Path, num_parallel_calls: int | None, k: int, same_elements: Any
) -> None:
    make = file_pipeline(write_shards(tmp_path, 5, 17), num_parallel_calls)
    same_elements(*resumed_sequence(make, k))


def test_shuffle_with_repeat_resumes_across_epoch_boundaries(same_elements: Any) -> None:
    def make() -> data.Dataset[Any]:
        return D.range(50).shuffle(20, seed=1).repeat(3)

    for k in (19, 20, 49, 50, 51, 99, 149):
        same_elements(*resumed_sequence(make, k))
    epochs = np.array(list(make())).reshape(3, 50)
    assert not np.array_equal(epochs[0], epochs[1])  # reshuffled each epoch


def test_repeat_of_a_shuffled_file_list_resumes_in_a_later_epoch(tmp_path: Path, same_elements: Any) -> None:
    pattern = write_shards(tmp_path, 4, 3)

    def make() -> data.Dataset[Any]:
        return (
            D.list_files(pattern, seed=9)
            .repeat(3)
            .interleave(lambda name: D.from_generator(read_lines, args=(name,)), cycle_length=2)
        )

    for k in (5, 14, 30):
        same_elements(*resumed_sequence(make, k))


@pytest.mark.parametrize("deterministic", [True, False])
def test_thread_map_batch_prefetch_resumes_exactly(deterministic: bool) -> None:
    def make() -> data.Dataset[Any]:
        return D.range(200).map(lambda x: x * 3, num_parallel_calls=4, deterministic=deterministic).batch(7).prefetch(2)

    head_and_tail, expected = resumed_sequence(make, 9)
    if deterministic:
        assert [batch.tolist() for batch in head_and_tail] == [batch.tolist() for batch in expected]
    else:
        # Out of order is allowed, but every element exactly once, the restore included.
        assert sorted(np.concatenate(head_and_tail).tolist()) == list(range(0, 600, 3))


@pytest.mark.parametrize("deterministic", [True, False])
def test_process_map_resumes_exactly(deterministic: bool) -> None:
    def make() -> data.Dataset[Any]:
        return (
            D.range(120)
            .shuffle(30, seed=4)
            .map(
                lambda x: {"x": x, "text": b"v%d" % x},
                num_parallel_calls=2,
                deterministic=deterministic,
                use_processes=True,
            )
            .batch(8)
            .prefetch(2)
        )

    head_and_tail, expected = resumed_sequence(make, 6)
    if deterministic:
        assert [batch["x"].tolist() for batch in head_and_tail] == [batch["x"].tolist() for batch in expected]
    else:
        assert sorted(np.concatenate([batch["x"] for batch in head_and_tail]).tolist()) == list(range(120))


def test_every_positional_op_resumes_exactly(same_elements: Any) -> None:
    def make() -> data.Dataset[Any]:
        left = D.range(40).skip(3).take(30).shard(2, 1).enumerate()
        right = D.range(100, 200).window(3, shift=2).flat_map(lambda window: window.batch(3))
        return D.zip((left, right)).concatenate(D.zip((D.range(5).enumerate(), D.range(5).batch(1).repeat())))

    for k in range(0, 21, 4):
        same_elements(*resumed_sequence(make, k))


def test_unbatch_rebatch_padded_batch_resume_exactly(same_elements: Any) -> None:
    def make() -> data.Dataset[Any]:
        return D.range(1, 30).map(lambda x: np.arange(x % 5)).padded_batch(3).unbatch().rebatch([4, 3]).prefetch(2)

    for k in (0, 3, 8, 15):
        same_elements(*resumed_sequence(make, k))


def test_a_restored_exhausted_iterator_is_exhausted() -> None:
    iterator = iter(D.range(5).shuffle(3, seed=1).prefetch(2))
    list(iterator)
    restored = iter(D.range(5).shuffle(3, seed=1).prefetch(2))
    restored.set_state(json_round_trip(iterator.get_state()))
    assert list(restored) == []


@settings(max_examples=12, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(k=st.integers(min_value=0, max_value=46))
def test_shuffle_interleave_map_batch_repeat_resumes_for_any_k(k: int, same_elements: Any) -> None:
    def make() -> data.Dataset[Any]:
        return (
            D.range(6)
            .interleave(lambda x: D.range(x * 100, x * 100 + 9 + x), cycle_length=3, block_length=2)
            .shuffle(13, seed=11)
            .map(lambda x: (x, x % 7), num_parallel_calls=2)
            .batch(3)
            .repeat(2)
            .prefetch(2)
        )

    same_elements(*resumed_sequence(make, k))
