"""shardflow.data: a tf.data-style input pipeline of numpy elements with checkpointable iterators."""

from typing import Any

from shardflow.data.dataset import Dataset, DatasetIterator, State
from shardflow.data.options import (
    AUTOTUNE,
    AutoShardPolicy,
    AutotuneOptions,
    DistributeOptions,
    Options,
    ThreadingOptions,
)
from shardflow.data.sharding import auto_shard, auto_shard_for
from shardflow.data.sources_basic import TensorSpec

__all__ = [
    "AUTOTUNE",
    "AutoShardPolicy",
    "AutotuneOptions",
    "DataLossError",
    "Dataset",
    "DatasetIterator",
    "DistributeOptions",
    "Options",
    "State",
    "TensorSpec",
    "ThreadingOptions",
    "auto_shard",
    "auto_shard_for",
]


def __getattr__(name: str) -> Any:
    # The file sources' errors are imported on first use, like the sources themselves.
    if name == "DataLossError":
        from shardflow.data.sources.errors import DataLossError

        return DataLossError
    raise AttributeError(f"module 'shardflow.data' has no attribute {name!r}")
