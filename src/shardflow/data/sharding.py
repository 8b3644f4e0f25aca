"""auto_shard: rewrites a pipeline so that each worker reads its own share, with tf.data's policies."""

from __future__ import annotations

from typing import Any, Protocol, TypeVar

from shardflow.data.dataset import Dataset
from shardflow.data.options import AutoShardPolicy

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
