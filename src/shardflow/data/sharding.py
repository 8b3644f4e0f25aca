"""auto_shard: rewrites a pipeline so that each worker reads its own share, with tf.data's policies."""

from __future__ import annotations

from typing import Any, Protocol, TypeVar

from shardflow.data.dataset import Dataset
from shardflow.data.options import AutoShardPolicy
from shardflow.data.resample import RejectionResampleDataset
from shardflow.data.sampling import DirectedDataset
from shardflow.data.shuffle import ShuffleDataset
from shardflow.data.slicing import ShardDataset
from shardflow.data.sources.list_files import ListFilesDataset

T = TypeVar("T")


class InputContextLike(Protocol):
    num_workers: int
    worker_index: int


def auto_shard(
    dataset: Dataset[T], num_workers: int, worker_index: int, policy: AutoShardPolicy | None = None
) -> Dataset[T]:
    """The pipeline as worker `worker_index` of `num_workers` runs it. `policy` defaults to the pipeline's
    `options().experimental_distribute.auto_shard_policy`, and that to AUTO.

    FILE shards the list of files at the source (each worker reads whole files; every source that reads files by name
    offers `_shard_files`), DATA keeps every element whose index modulo `num_workers` is `worker_index` (everyone reads
    everything), OFF leaves the pipeline alone, and AUTO is FILE when the pipeline reads files by name, else DATA.
    With FILE sharding a later `repeat(k)` makes k passes over each worker's files: k passes over the data in total.
    """
    if not isinstance(num_workers, int) or num_workers < 1:
        raise ValueError(f"auto_shard num_workers must be a positive int, got {num_workers!r}")
    if not isinstance(worker_index, int) or not 0 <= worker_index < num_workers:
        raise ValueError(f"auto_shard worker_index must be in [0, num_workers={num_workers}), got {worker_index!r}")
    if policy is None:
        policy = dataset.options().experimental_distribute.auto_shard_policy or AutoShardPolicy.AUTO
    policy = AutoShardPolicy(policy)
    if policy == AutoShardPolicy.OFF or num_workers == 1:
        return dataset
    if policy in (AutoShardPolicy.FILE, AutoShardPolicy.AUTO):
        sharded = _shard_files(dataset, num_workers, worker_index)
        if sharded is not None:
            return sharded
        if policy == AutoShardPolicy.FILE:
            raise ValueError(
                "AutoShardPolicy.FILE found no source that reads files by name (such as list_files) in this "
                "pipeline; use AutoShardPolicy.DATA to shard by element"
            )
    return dataset.shard(num_workers, worker_index)


def auto_shard_for(dataset: Dataset[T], context: InputContextLike, policy: AutoShardPolicy | None = None) -> Dataset[T]:
    """`auto_shard` driven by a worker's InputContext (its num_workers and worker_index)."""
    return auto_shard(dataset, context.num_workers, context.worker_index, policy)


def shard_elements(dataset: Dataset[T], num_workers: int, worker_index: int) -> Dataset[T]:
    """DATA sharding that keeps every element on exactly one worker even where the workers' pipelines order their
    elements differently: the output is sharded, as tf.data does, unless an op of the pipeline orders its elements
    at random in each process (a shuffle, a sampling, a shuffled list_files, a map with deterministic=False); then
    each input of that op is, below it (a shuffled list_files before its shuffle), so that each worker shuffles
    only its own share."""
    if not _orders_at_random(dataset):
        return dataset.shard(num_workers, worker_index)
    if isinstance(dataset, ListFilesDataset) and len(dataset._files) >= num_workers:
        files: Dataset[Any] = dataset._shard_files(num_workers, worker_index)
        return files
    inputs = dataset._inputs()
    if not inputs:  # a source that shuffles by itself: no place below it
        return dataset.shard(num_workers, worker_index)
    return dataset._with_inputs(tuple(shard_elements(each, num_workers, worker_index) for each in inputs))


def shard_files(dataset: Dataset[T], num_workers: int, worker_index: int) -> Dataset[T] | None:
    """FILE sharding: the pipeline with every source that reads files by name reading its share of them; None where
    it has no such source. Raises ValueError where a source has fewer files than workers."""
    return _shard_files(dataset, num_workers, worker_index)


def is_sharded(dataset: Dataset[Any]) -> bool:
    """Whether the pipeline calls `.shard(...)` anywhere: then it shards itself."""
    return isinstance(dataset, ShardDataset) or any(is_sharded(each) for each in dataset._inputs())


def _orders_at_random(dataset: Dataset[Any]) -> bool:
    """Whether `dataset` or an op below it orders elements by a seed drawn in each process (or by thread timing)."""
    if isinstance(dataset, ShuffleDataset | DirectedDataset | RejectionResampleDataset):
        return True
    if isinstance(dataset, ListFilesDataset) and dataset._shuffle:
        return True
    if getattr(dataset, "_deterministic", None) is False:
        return True
    return any(_orders_at_random(each) for each in dataset._inputs())


def _shard_files(dataset: Dataset[Any], num_workers: int, worker_index: int) -> Dataset[Any] | None:
    """The pipeline with every file-reading source replaced by its share, or None if it has none."""
    own = dataset._shard_files(num_workers, worker_index)
    if own is not None:
        return own
    inputs = dataset._inputs()
    rewritten = [_shard_files(input_dataset, num_workers, worker_index) for input_dataset in inputs]
    if all(item is None for item in rewritten):
        return None
    return dataset._with_inputs(
        tuple(original if item is None else item for original, item in zip(inputs, rewritten, strict=True))
    )
