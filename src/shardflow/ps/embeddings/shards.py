"""One PS's part of every `sf.nn` table of the job: answers lookups, reads a push's table gradients out of its
frames, applies an update's, and writes its own rows into checkpoints (every row, or those changed since)."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from shardflow.ps.embeddings.chains import replay
from shardflow.ps.embeddings.files import FileRecord, write_shard
from shardflow.ps.embeddings.spec import RowOptimizer, TableSpec
from shardflow.ps.embeddings.table import ShardTable
from shardflow.ps.sparse import EmbeddingGrad

log = logging.getLogger(__name__)

TABLE_STATS = "table/"
"""The prefix of the tables' counters among a PS's stats: `table/<table>/<counter>`."""


class EmbeddingShards:
    """The rows this PS owns of each table (in the order of the chief's `Init`), and the checkpoint files it wrote
    since its last full one."""

    def __init__(
        self,
        specs: Sequence[TableSpec],
        ps_index: int,
        num_ps: int,
        *,
        staging: Path | None = None,
        full_checkpoint_every: int = 10,
    ) -> None:
        """`staging`: the directory this PS writes its checkpoint files into (the chief links them into each
        checkpoint); None: it writes none (a PS without a model directory)."""
        self.specs = list(specs)
        self.ps_index, self.num_ps = ps_index, num_ps
        self.tables = [ShardTable(spec, _row_optimizer(spec), ps_index, num_ps) for spec in specs]
        self.staging = staging
        self.full_checkpoint_every = full_checkpoint_every
        self.chain: list[FileRecord] = []
        """The files of this PS's latest full checkpoint and the increments after it, in replay order."""
        self._saves_since_full = 0
        self.lookups = {"lookups": 0, "looked_up_ids": 0, "lookups_on_pushes": 0}
        """Lookups this PS answered, and the ids they asked for."""
        self._staged: set[str] = set()
        """The staged files this PS wrote and has not deleted."""

    def __len__(self) -> int:
        return len(self.tables)

    def lookup(
        self, indices: Sequence[int], ids: Sequence[torch.Tensor], what: str, checked: bool = False
    ) -> list[torch.Tensor]:
        """Per table index, the values of the rows its frame of `ids` lists; `what` names the request in errors.
        `checked`: `check_lookup` passed them already."""
        if not checked:
            self.check_lookup(indices, ids, what)
        values = []
        self.lookups["lookups"] += 1
        for index, table_ids in zip(indices, ids, strict=True):
            self.lookups["looked_up_ids"] += table_ids.numel()
            values.append(self.tables[index].lookup(table_ids, checked=True))
        return values

    def check_lookup(self, indices: Sequence[int], ids: Sequence[torch.Tensor], what: str) -> None:
        """Raise ValueError, naming `what`, the table and the first bad id, unless every frame of `ids` lists ids
        its table holds on this PS."""
        for index, table_ids in zip(indices, ids, strict=True):
            self.tables[index].check_ids(table_ids, f"{what} for table {self.specs[index].name!r}")

    def gradients(self, frames: Sequence[torch.Tensor], what: str) -> list[list[EmbeddingGrad]]:
        """A push's table gradients, three frames per table (ids, counts, gradient rows), checked before anything is
        applied: one list per table, of one gradient."""
        grads: list[list[EmbeddingGrad]] = []
        if len(frames) != 3 * len(self.tables):
            raise ValueError(f"{what}: {len(frames)} table frames came for {len(self.tables)} tables (3 each)")
        for index, (table, spec) in enumerate(zip(self.tables, self.specs, strict=True)):
            ids, counts, values = frames[3 * index : 3 * index + 3]
            where = f"{what} for table {spec.name!r}"
            table.check_ids(ids, where)
            if counts.dtype != torch.int64 or tuple(counts.shape) != tuple(ids.shape):
                raise ValueError(
                    f"{where}: counts must be int64 shaped as the {ids.numel()} ids, got {counts.dtype} "
                    f"shaped {tuple(counts.shape)}"
                )
            if values.dtype != spec.torch_dtype or tuple(values.shape) != (ids.numel(), spec.embedding_dim):
                raise ValueError(
                    f"{where}: {ids.numel()} ids of a table of dimension {spec.embedding_dim} came with gradients of "
                    f"{values.dtype} shaped {tuple(values.shape)}"
                )
            grads.append([(ids, counts, values)])
        return grads

    def coalesced(self, grads: list[list[EmbeddingGrad]], count: int) -> list[EmbeddingGrad]:
        """Per table, the update's gradient: the pushes' rows summed by id, divided by `count` as the dense
        gradients are, and the occurrences summed."""
        merged: list[EmbeddingGrad] = []
        for table_grads in grads:
            if len(table_grads) == 1 and count == 1:
                merged.append(table_grads[0])
                continue
            ids = torch.cat([g[0] for g in table_grads])
            unique, inverse = torch.unique(ids, return_inverse=True)
            counts = torch.zeros(unique.numel(), dtype=torch.int64).index_add_(
                0, inverse, torch.cat([g[1] for g in table_grads])
            )
            values = torch.cat([g[2] for g in table_grads])
            summed = values.new_zeros((unique.numel(), values.shape[1])).index_add_(0, inverse, values)
            merged.append((unique, counts, summed.div_(count) if count != 1 else summed))
        return merged

    def apply(self, grads: Sequence[EmbeddingGrad], step: int, lr_factor: float = 1.0) -> None:
        """One update at global step `step` (the step it makes is `step + 1`) of every table, each at its own
        learning rate times `lr_factor` (what the job's schedule makes of its base rate now)."""
        for spec, table, (ids, counts, values) in zip(self.specs, self.tables, grads, strict=True):
            lr = None if lr_factor == 1.0 or spec.optimizer is None else spec.optimizer.lr * lr_factor
            table.apply(ids, counts, values, step=step + 1, lr=lr, checked=True)  # checked by `gradients`
            table.maintain(step + 1)

    def stats(self) -> dict[str, int]:
        """Per table (`table/<name>/<counter>`): rows, admitted, rejected, evicted, expired, memory_bytes,
        values_bytes; and the lookups this PS answered (those that rode on a push, `lookups_on_pushes`, among them) and
        the ids they asked for."""
        found = {
            f"{TABLE_STATS}{spec.name}/{key}": int(value)
            for spec, table in zip(self.specs, self.tables, strict=True)
            for key, value in table.stats().items()
        }
        return {**found, **self.lookups} if self.tables else found

    def save(self, step: int) -> tuple[FileRecord, ...]:
        """Write this PS's rows of every table as of `step` into the staging directory: every row when a full
        checkpoint is due, else only those changed since the last save. Returns the files to replay, in order."""
        if self.staging is None or not self.tables:
            return ()
        if self.chain and self.chain[-1].step == step:
            return tuple(self.chain)  # saved at this step already (a snapshot, then the final state): unchanged
        full = not self.chain or self._saves_since_full + 1 >= self.full_checkpoint_every
        written: list[FileRecord] = []
        for spec, table in zip(self.specs, self.tables, strict=True):
            written.append(
                write_shard(
                    self.staging,
                    spec,
                    step=step,
                    ps_index=self.ps_index,
                    num_ps=self.num_ps,
                    kind="full" if full else "increment",
                    state=table.rows_state(changed_only=not full, copy=False),
                    scalars=table.scalars(),
                )
            )
        for table in self.tables:
            table.mark_saved()
        self.chain = written if full else [*self.chain, *written]
        self._saves_since_full = 0 if full else self._saves_since_full + 1
        self._staged.update(record.path for record in written)
        return tuple(self.chain)

    def snapshot(self, step: int) -> tuple[tuple[FileRecord, ...], str | None]:
        """`save`, for a snapshot: the files, or none and why they could not be written (a full disk): the
        checkpoint of that step then fails, training goes on, and the next save writes every row again."""
        try:
            return self.save(step), None
        except (OSError, ValueError) as error:
            self.chain = []
            problem = f"ps:{self.ps_index} could not write its rows of the sf.nn tables at step {step}: {error}"
            log.warning("%s; the next checkpoint writes every row", problem)
            return (), problem

    def prune(self, keep: Sequence[FileRecord]) -> None:
        """Delete the staged files this PS wrote that neither `keep` (the snapshots not yet saved) nor its current
        chain needs: each checkpoint holds links of its own."""
        if self.staging is None:
            return
        needed = {record.path for record in (*keep, *self.chain)}
        for relative in sorted(self._staged - needed):
            (self.staging / relative).unlink(missing_ok=True)
            self._staged.discard(relative)

    def restore(self, checkpoint: Path, chains: Mapping[str, Sequence[str]]) -> None:
        """Load every table's rows from its files in `checkpoint`, in replay order, keeping those this PS owns: the
        checkpoint may have been written by another number of PS. The next save is a full one."""
        for spec, table in zip(self.specs, self.tables, strict=True):
            if spec.name not in chains:
                raise ValueError(f"the checkpoint {checkpoint} has no files of table {spec.name!r}")
            metas = replay([(checkpoint / relative, None) for relative in chains[spec.name]], spec, table.load_rows)
            table.load_scalars(metas[-1].scalars)  # a table's scalars (its optimizer's step) are alike on every PS
            table.mark_saved()
        self.chain = []


def _row_optimizer(spec: TableSpec) -> RowOptimizer:
    if spec.optimizer is None:
        raise ValueError(f"table {spec.name!r} came without its row optimizer; the chief sets one for each")
    return spec.optimizer
