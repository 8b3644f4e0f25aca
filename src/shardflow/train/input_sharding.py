"""Auto-sharding of what input_fn returns, as tf.distribute does: each worker reads its own share of a
shardflow.data pipeline, unless input_fn shards it itself. Sharding is part of the pipeline whose iterator state is
checkpointed, and the same input_fn and InputContext make the same decision, so a resumed worker continues its share.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

from shardflow.data import AutoShardPolicy, Dataset, auto_shard
from shardflow.data.sharding import is_sharded, shard_elements, shard_files
from shardflow.train.specs import InputContext

log = logging.getLogger(__name__)

_INDEX_NAMES = frozenset({"worker_index", "input_pipeline_id"})


class WatchedContext(InputContext):
    """The InputContext input_fn receives: it notes whether input_fn asked which worker it is, the sign that it
    shards its input itself."""

    @property
    def read_index(self) -> bool:
        return bool(self.__dict__.get("_read_index", False))

    def __getattribute__(self, name: str) -> Any:
        if name in _INDEX_NAMES:
            object.__setattr__(self, "_read_index", True)
        return super().__getattribute__(name)


class WorkerInput:
    """input_fn(ctx) as this worker reads it: `iterable`, auto-sharded where input_fn did not shard it, and the line
    that says how (`announce`, once the first batch was read: a generator reads ctx only when iterated)."""

    def __init__(self, input_fn: Callable[[InputContext], Iterable[Any]], ctx: InputContext) -> None:
        # The worker's own numbers: reading them from the watched context would count as input_fn's reading.
        self.num_workers, self.name = ctx.num_workers, f"worker:{ctx.worker_index}"
        self.ctx = WatchedContext(ctx.num_workers, ctx.worker_index, ctx.epoch)
        made = input_fn(self.ctx)
        self.iterable: Iterable[Any] = made
        self.policy: AutoShardPolicy | None = None
        """The auto-shard policy applied; None where input_fn's own input is read as it is."""
        self._line: str | None = None
        if ctx.num_workers > 1 and isinstance(made, Dataset) and not self.ctx.read_index and not is_sharded(made):
            self.iterable, self.policy, self._line = _auto_shard(made, ctx)

    def describe(self) -> str:
        """What an error says after input_fn(ctx): that this worker auto-sharded it, and how; else nothing."""
        if self.policy is None or self.policy == AutoShardPolicy.OFF:
            return ""
        return f", auto-sharded with AutoShardPolicy.{self.policy.name},"

    def announce(self) -> None:
        """Say, in one line, how this worker's input is sharded; nothing with a single worker."""
        n, name = self.num_workers, self.name
        if n == 1:
            return
        if self._line is not None:
            print(f"{name} {self._line}", flush=True)
        elif self.ctx.read_index:
            print(f"{name} reads the share of the input that input_fn gives it (it reads ctx.worker_index)", flush=True)
        elif isinstance(self.iterable, Dataset):
            print(f"{name} reads the share of the input that the pipeline's .shard(...) gives it", flush=True)
        else:
            log.warning(
                "%s: input_fn returned a %s and did not read ctx.worker_index, so each of the %d workers reads all "
                "of it (every record %d times per epoch). Shard it by ctx.worker_index, or return a "
                "shardflow.data.Dataset, which is sharded for you",
                name,
                type(self.iterable).__name__,
                n,
                n,
            )


def _auto_shard(dataset: Dataset[Any], ctx: InputContext) -> tuple[Dataset[Any], AutoShardPolicy, str]:
    """The pipeline's share for this worker under its `options().experimental_distribute.auto_shard_policy` (AUTO
    by default: FILE where it reads files by name, else DATA), and the line that says so."""
    n, i = ctx.num_workers, ctx.worker_index
    policy = AutoShardPolicy(dataset.options().experimental_distribute.auto_shard_policy or AutoShardPolicy.AUTO)
    if policy == AutoShardPolicy.OFF:
        line = f"reads the whole input, as each of the {n} workers does (AutoShardPolicy.OFF in the pipeline's options)"
        return dataset, policy, line
    if policy == AutoShardPolicy.FILE:
        return auto_shard(dataset, n, i, policy), policy, _file_line(i, n)  # raises where FILE does not apply
    why = ""
    if policy == AutoShardPolicy.AUTO:
        try:
            files = shard_files(dataset, n, i)
        except ValueError:
            files, why = None, f" and the pipeline has fewer files than the {n} workers"
        if files is not None:
            return files, AutoShardPolicy.FILE, _file_line(i, n)
        why = why or " and the pipeline reads no files by name"
    line = f"keeps elements {_every(i, n)} of the input (AutoShardPolicy.DATA, as input_fn does not shard it{why})"
    return shard_elements(dataset, n, i), AutoShardPolicy.DATA, line


def _file_line(index: int, count: int) -> str:
    return (
        f"reads files {_every(index, count)} of the pipeline's sorted file list (AutoShardPolicy.FILE, as input_fn "
        "does not shard its input)"
    )


def _every(index: int, count: int) -> str:
    return f"{index}, {index + count}, {index + 2 * count}, ..."
