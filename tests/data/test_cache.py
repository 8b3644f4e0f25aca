"""cache: memory and file caches that fill on the first complete pass, in a pickle-free file format."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shardflow import data

D = data.Dataset


class CountingSource:
    """A generator factory that counts how often the input is read."""

    def __init__(self, size: int = 6) -> None:
        self.size = size
        self.reads = 0

    def __call__(self) -> Any:
        for value in range(self.size):
            self.reads += 1
            yield {"x": np.full(2, value, dtype=np.int16), "name": b"r%d" % value, "tags": np.array([b"t"] * value)}


def test_memory_cache_reads_the_input_once(same_elements: Any) -> None:
    source = CountingSource()
    cached = D.from_generator(source).cache()
    first, second = list(cached), list(cached)
    same_elements(second, first)
    assert source.reads == 6


def test_an_incomplete_first_pass_does_not_fill_the_cache() -> None:
    source = CountingSource()
    cached = D.from_generator(source).cache()
    list(cached.take(2))
    assert len(list(cached)) == 6 and source.reads == 8


def test_file_cache_is_read_by_a_new_pipeline_without_touching_the_input(tmp_path: Path, same_elements: Any) -> None:
    source = CountingSource()
    filename = str(tmp_path / "train")
    first = list(D.from_generator(source).cache(filename))
    unused = CountingSource()
    same_elements(list(D.from_generator(unused).cache(filename)), first)
    assert unused.reads == 0
    with open(filename + ".shardflow-cache", "rb") as cache_file:
        assert cache_file.read(8) == b"SFCACHE1"  # shardflow's own framing, not a pickle


def test_file_cache_state_is_a_position(tmp_path: Path, same_elements: Any) -> None:
    filename = str(tmp_path / "train")
    cached = D.from_generator(CountingSource()).cache(filename)
    expected = list(cached)
    iterator = iter(cached)
    head = [next(iterator) for _ in range(4)]
    state = json.loads(json.dumps(iterator.get_state()))
    assert state == {"mode": "read", "index": 4}
    restored = iter(cached)
    restored.set_state(state)
    same_elements(head + list(restored), expected)


def test_memory_cache_state_restores_in_a_process_that_has_no_cache(same_elements: Any) -> None:
    dataset = D.from_generator(CountingSource()).cache().repeat(2)
    expected = list(dataset)
    iterator = iter(D.from_generator(CountingSource()).cache().repeat(2))
    head = [next(iterator) for _ in range(8)]  # in the second pass, read from memory
    fresh = iter(D.from_generator(CountingSource()).cache().repeat(2))  # a new dataset: empty cache
    fresh.set_state(json.loads(json.dumps(iterator.get_state())))
    same_elements(head + list(fresh), expected)


def test_a_pass_restored_mid_fill_passes_elements_through(tmp_path: Path, same_elements: Any) -> None:
    filename = str(tmp_path / "train")
    iterator = iter(D.from_generator(CountingSource()).cache(filename))
    [next(iterator) for _ in range(3)]
    restored = iter(D.from_generator(CountingSource()).cache(filename))
    restored.set_state(iterator.get_state())
    assert len(list(restored)) == 3
    assert not os.path.exists(filename + ".shardflow-cache")


def test_a_corrupt_cache_file_names_the_file_and_the_fix(tmp_path: Path) -> None:
    filename = str(tmp_path / "train")
    (tmp_path / "train.shardflow-cache").write_bytes(b"SFCACHE1" + b"\0" * 40)
    with pytest.raises(data.DataLossError, match=r"train\.shardflow-cache.*delete it to rebuild"):
        list(D.range(3).cache(filename))
