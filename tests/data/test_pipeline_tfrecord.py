"""The design's pipeline end to end on TFRecord files: list_files -> interleave(TFRecordDataset) -> shuffle ->
batch -> parse_example -> prefetch, resumed exactly from its state and sharded by file across workers."""

from __future__ import annotations

import collections
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shardflow import data

FEATURES = {"x": data.FixedLenFeature((2,), np.float32), "label": data.FixedLenFeature((), np.int64)}


@pytest.fixture
def record_files(tmp_path: Path) -> str:
    for file_index in range(4):
        with data.TFRecordWriter(str(tmp_path / f"train-{file_index}.tfrecord")) as writer:
            for record in range(25 + file_index):
                label = file_index * 1000 + record
                writer.write(data.make_example({"x": np.array([label, -label], np.float32), "label": label}))
    return str(tmp_path / "train-*.tfrecord")


def design_pipeline(pattern: str) -> data.Dataset[Any]:
    return (
        data.Dataset.list_files(pattern, shuffle=True, seed=1)
        .interleave(data.TFRecordDataset, cycle_length=3, num_parallel_calls=data.AUTOTUNE)
        .shuffle(40, seed=2)
        .batch(8)
        .map(lambda batch: data.parse_example(batch, FEATURES), num_parallel_calls=data.AUTOTUNE)
        .prefetch(data.AUTOTUNE)
    )


def labels(batches: list[Any]) -> list[int]:
    return np.concatenate([batch["label"] for batch in batches]).tolist()


@pytest.mark.parametrize("k", [1, 6])
def test_design_pipeline_resumes_exactly(record_files: str, k: int) -> None:
    expected = list(design_pipeline(record_files))
    iterator = iter(design_pipeline(record_files))
    head = [next(iterator) for _ in range(k)]
    state = json.loads(json.dumps(iterator.get_state()))
    iterator.close()
    restored = iter(design_pipeline(record_files))
    restored.set_state(state)
    assert labels(head + list(restored)) == labels(expected)
    assert sorted(labels(expected)) == sorted(f * 1000 + r for f in range(4) for r in range(25 + f))
    assert len(json.dumps(state)) <= 1024


def test_file_sharding_of_the_design_pipeline_covers_every_record_once_per_epoch(record_files: str) -> None:
    seen: collections.Counter[int] = collections.Counter()
    for worker_index in range(2):
        sharded = data.auto_shard(design_pipeline(record_files).repeat(2), 2, worker_index)
        seen.update(labels(list(sharded)))
    assert set(seen.values()) == {2} and len(seen) == 25 + 26 + 27 + 28
