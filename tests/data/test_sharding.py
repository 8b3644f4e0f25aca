"""auto_shard: FILE, DATA, OFF and AUTO policies, and epochs that count passes over the data across all workers."""

from __future__ import annotations

import collections
import dataclasses
from pathlib import Path
from typing import Any

import pytest

from shardflow import data

D = data.Dataset


def write_record_files(directory: Path, num_files: int = 8, records_per_file: int = 5) -> str:
    for file_index in range(num_files):
        lines = [f"{file_index}-{record}" for record in range(records_per_file)]
        (directory / f"records-{file_index}.txt").write_text("\n".join(lines) + "\n")
    return str(directory / "records-*.txt")


def read_lines(filename: bytes) -> Any:
    with open(filename, "rb") as lines:
        yield from (line.rstrip(b"\n") for line in lines)


def training_pipeline(pattern: str, epochs: int) -> data.Dataset[Any]:
    return (
        D.list_files(pattern, seed=1)
        .interleave(lambda name: D.from_generator(read_lines, args=(name,)), cycle_length=2)
        .repeat(epochs)
    )


@pytest.mark.parametrize("num_workers", [1, 2, 4])
def test_file_sharding_with_repeat_sees_each_record_epochs_times_across_workers(
    tmp_path: Path, num_workers: int
) -> None:
    pattern = write_record_files(tmp_path)
    seen: collections.Counter[bytes] = collections.Counter()
    per_worker = []
    for worker_index in range(num_workers):
        records = list(data.auto_shard(training_pipeline(pattern, epochs=3), num_workers, worker_index))
        per_worker.append({record.split(b"-")[0] for record in records})
        seen.update(records)
    assert len(seen) == 40 and set(seen.values()) == {3}
    # FILE sharding: each worker reads whole files, and no two workers share one.
    assert sum(len(files) for files in per_worker) == 8


def test_auto_is_data_sharding_without_a_file_source() -> None:
    shards = [list(data.auto_shard(D.range(10).batch(2), 3, index)) for index in range(3)]
    assert [[batch.tolist() for batch in shard] for shard in shards] == [
        [[0, 1], [6, 7]],
        [[2, 3], [8, 9]],
        [[4, 5]],
    ]


def test_data_policy_shards_elements_even_with_files(tmp_path: Path) -> None:
    pipeline = training_pipeline(write_record_files(tmp_path, num_files=2), epochs=1)
    assert list(data.auto_shard(pipeline, 2, 1, data.AutoShardPolicy.DATA)) == list(pipeline)[1::2]


def test_policy_comes_from_the_pipeline_options(tmp_path: Path) -> None:
    options = data.Options()
    options.experimental_distribute.auto_shard_policy = data.AutoShardPolicy.OFF
    pipeline = D.range(6).with_options(options)
    assert list(data.auto_shard(pipeline, 2, 1)) == list(range(6))


def test_file_policy_without_files_names_the_fix() -> None:
    with pytest.raises(ValueError, match=r"found no source that reads files by name.*AutoShardPolicy\.DATA"):
        data.auto_shard(D.range(4), 2, 0, data.AutoShardPolicy.FILE)


def test_file_policy_needs_a_file_per_worker(tmp_path: Path) -> None:
    pipeline = training_pipeline(write_record_files(tmp_path, num_files=2), epochs=1)
    with pytest.raises(ValueError, match="2 files for 4 workers"):
        data.auto_shard(pipeline, 4, 0, data.AutoShardPolicy.FILE)


def test_worker_index_must_be_below_num_workers() -> None:
    with pytest.raises(ValueError, match=r"worker_index must be in \[0, num_workers=2\), got 2"):
        data.auto_shard(D.range(4), 2, 2)


@dataclasses.dataclass
class Context:
    num_workers: int
    worker_index: int


def test_auto_shard_for_reads_an_input_context() -> None:
    context = Context(2, 1)
    assert list(data.auto_shard_for(D.range(5), context)) == [1, 3]
