"""Exact resume of the sampling, grouping, scan, unique, take_while, counter, random, resampling, sparse_batch, load and
snapshot iterators: k elements, then a fresh iterator restored from the JSON state gives the rest of the
uninterrupted run, and the state stays under 1 KB."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shardflow import data

D = data.Dataset
MakePipeline = Callable[[], data.Dataset[Any]]

MAX_STATE_BYTES = 1024


def drain(iterator: data.DatasetIterator[Any]) -> list[Any]:
    elements = list(iterator)
    iterator.close()
    return elements


def take(iterator: data.DatasetIterator[Any], count: int, bulk: bool) -> list[Any]:
    """`count` elements (fewer at the end), with next() or with next_many() in uneven slices."""
    head: list[Any] = []
    try:
        while len(head) < count:
            head += iterator.next_many(min(3, count - len(head))) if bulk else [next(iterator)]
    except StopIteration:
        pass
    return head


def resumed_sequence(make: MakePipeline, k: int, bulk: bool = False) -> tuple[list[Any], list[Any]]:
    """(k elements, then the rest from a new iterator restored from the JSON state) and the uninterrupted run."""
    expected = drain(iter(make()))
    iterator = iter(make())
    head = take(iterator, k, bulk)
    encoded = json.dumps(iterator.get_state())
    assert len(encoded) <= MAX_STATE_BYTES, f"state of {len(encoded)} bytes: {encoded[:200]}"
    iterator.close()
    restored = iter(make())
    restored.set_state(json.loads(encoded))
    return head + drain(restored), expected


def ragged(lengths: list[int]) -> data.Dataset[Any]:
    return D.from_tensor_slices(np.array(lengths, dtype=np.int64)).map(lambda n: np.full(int(n), n))


PIPELINES: dict[str, MakePipeline] = {
    "sample_from_datasets": lambda: D.sample_from_datasets(
        [D.range(0, 40), D.range(100, 130), D.range(200, 210)], [0.5, 0.3, 0.2], seed=3
    ),
    "sample_from_datasets_stop_on_empty": lambda: D.sample_from_datasets(
        [D.range(0, 10), D.range(100, 140)], seed=5, stop_on_empty_dataset=True
    ),
    "sample_from_datasets_weights_dataset": lambda: D.sample_from_datasets(
        [D.range(0, 20), D.range(100, 120)], D.from_tensor_slices(np.array([[0.9, 0.1], [0.1, 0.9]])).repeat(), seed=2
    ),
    "sample_from_datasets_rerandomized_repeat": lambda: D.sample_from_datasets(
        [D.range(0, 8), D.range(100, 108)], seed=1, rerandomize_each_iteration=True
    ).repeat(3),
    "sample_from_datasets_of_shuffles": lambda: D.sample_from_datasets(
        [D.range(0, 30).shuffle(7, seed=1), D.range(100, 130).batch(4).unbatch()], seed=9
    ),
    "choose_from_datasets": lambda: D.choose_from_datasets(
        [D.range(0, 5), D.range(100, 110)], D.range(30).map(lambda x: x % 3 // 2), stop_on_empty_dataset=False
    ),
    "group_by_window": lambda: D.range(40).group_by_window(
        lambda x: x % 3, lambda key, window: window.map(lambda x: x + key * 1000), window_size=4
    ),
    "group_by_window_flush": lambda: D.range(23).group_by_window(
        lambda x: x % 5, lambda key, window: window.batch(2), window_size_func=lambda key: key + 2
    ),
    "bucket_by_sequence_length": lambda: ragged([1, 5, 3, 2, 7, 4, 6, 1, 9, 2, 8, 3, 3, 5]).bucket_by_sequence_length(
        lambda row: len(row), [3, 6], [2, 2, 3]
    ),
    "scan": lambda: D.range(30).scan(np.int64(0), lambda state, x: (state + x, (state, x))),
    "scan_large_state_rebuilt": lambda: D.range(25).scan(
        np.zeros(200), lambda state, x: (state + x, np.float64(state.sum()))
    ),
    "scan_bytes_state": lambda: D.range(12).scan(b"", lambda state, x: (state + b"x", state)),
    "unique": lambda: D.range(60).map(lambda x: x * 7 % 13).unique(),
    "unique_bulk_input": lambda: D.from_tensor_slices(np.arange(80) % 11).unique(),
    "take_while": lambda: D.range(50).take_while(lambda x: x < 33),
    "counter": lambda: D.counter(5, 3).take(40),
    "random": lambda: D.random(seed=4).take(3000),
    "rejection_resample": lambda: D.range(200).rejection_resample(lambda x: x % 3, [0.2, 0.3, 0.5], seed=6),
    "rejection_resample_given": lambda: D.range(200).rejection_resample(
        lambda x: np.int64(x % 4 == 0), [0.5, 0.5], initial_dist=[0.75, 0.25], seed=6
    ),
    "sparse_batch": lambda: (
        ragged([1, 3, 0, 2, 4, 1, 2])
        .sparse_batch(3, [4])
        .map(lambda sparse: (sparse.indices, sparse.values, sparse.dense_shape))
    ),
}


@pytest.mark.parametrize("bulk", [False, True], ids=["next", "next_many"])
@pytest.mark.parametrize("k", [0, 1, 7, 18])
@pytest.mark.parametrize("name", sorted(PIPELINES))
def test_new_op_resumes_exactly(name: str, k: int, bulk: bool, same_elements: Any) -> None:
    same_elements(*resumed_sequence(PIPELINES[name], k, bulk))


def test_a_restored_exhausted_sampler_is_exhausted() -> None:
    make = PIPELINES["sample_from_datasets"]
    iterator = iter(make())
    drain_without_close = list(iterator)
    assert drain_without_close
    restored = iter(make())
    restored.set_state(json.loads(json.dumps(iterator.get_state())))
    assert list(restored) == []


def test_random_resumes_across_its_generation_blocks() -> None:
    make = PIPELINES["random"]
    for k in (1023, 1024, 2049):
        head_and_tail, expected = resumed_sequence(make, k, bulk=True)
        assert head_and_tail == expected


def test_load_resumes_exactly(tmp_path: Path, same_elements: Any) -> None:
    D.range(50).map(lambda x: {"x": x, "text": b"r%d" % x}).save(
        str(tmp_path / "saved"), shard_func=lambda e: e["x"] % 3
    )
    for k in (0, 4, 31, 50):
        same_elements(*resumed_sequence(lambda: D.load(str(tmp_path / "saved")), k))


def test_snapshot_resumes_exactly_while_writing_and_while_reading(tmp_path: Path, same_elements: Any) -> None:
    def make() -> data.Dataset[Any]:
        return D.range(30).map(lambda x: x * 2).snapshot(str(tmp_path / "snap"))

    writing = iter(make())
    head = take(writing, 5, bulk=False)
    state = json.loads(json.dumps(writing.get_state()))
    writing.close()
    restored = iter(make())  # no complete snapshot yet: it reads the input and writes
    restored.set_state(state)
    same_elements(head + drain(restored), [np.int64(2 * x) for x in range(30)])
    for k in (0, 12, 29):  # the first run inside writes the snapshot, the others read it
        same_elements(*resumed_sequence(make, k))


def test_scan_bulk_read_stops_before_a_failing_step_and_a_restore_fails_there_too() -> None:
    def running_sum(state: np.int64, x: np.int64) -> tuple[np.int64, np.int64]:
        if x == 4:
            raise ValueError("bad element 4")
        return state + x, state

    def make() -> data.Dataset[Any]:
        return D.range(10).scan(np.int64(0), running_sum)

    iterator = iter(make())
    assert iterator.next_many(8) == [0, 0, 1, 3]
    state = json.loads(json.dumps(iterator.get_state()))
    restored = iter(make())
    restored.set_state(state)
    for resumed in (iterator, restored):
        with pytest.raises(ValueError, match="bad element 4"):
            resumed.next_many(8)
        assert drain(resumed) == [6, 11, 17, 24, 32]
