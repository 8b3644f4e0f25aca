"""A PS's variables: its shards in one flat buffer per dtype and its row-sparse tables, with the optimizers that
update them. Built from the chief's `Init`; reads a push's gradients out of its frames and applies an update."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from shardflow.ps import clipping
from shardflow.ps.embeddings.shards import EmbeddingShards
from shardflow.ps.optimizers import OptimizerSpec
from shardflow.ps.protocol import Init, Limits, Push, on_the_wire
from shardflow.ps.sparse import RowGrad, check_row_grad, check_rows, row_gradient
from shardflow.ps.state import Part, load_slots
from shardflow.ps.update_rules import Gradients, Refused, all_finite


def finite(gradients: Gradients) -> bool:
    """Whether every dense buffer and row-sparse value of a push is finite."""
    grads, row_grads, table_grads = gradients
    rows = (values for table in row_grads for _, values in table)
    return all_finite([*grads, *rows, *(values for table in table_grads for _, _, values in table)])


def nbytes(gradients: Gradients) -> int:
    grads, row_grads, table_grads = gradients
    tables = sum(i.nbytes + c.nbytes + v.nbytes for t in table_grads for i, c, v in t)
    return sum(g.nbytes for g in grads) + sum(r.nbytes + v.nbytes for t in row_grads for r, v in t) + tables


class Shards:
    """One PS's variables and optimizers; empty until the chief initialises the PS (`from_init`)."""

    def __init__(self) -> None:
        self.dtypes: list[str] = []
        self.params: list[torch.nn.Parameter] = []
        self.optimizer: torch.optim.Optimizer | None = None
        # Row-sparse pieces (embedding tables), each a tensor of its own, read and updated a few rows at a time.
        self.tables: list[torch.nn.Parameter] = []
        self.table_optimizer: torch.optim.Optimizer | None = None
        self.embeddings = EmbeddingShards((), 0, 1)
        """This PS's part of every `sf.nn` table."""
        self.spec: OptimizerSpec | None = None
        """The optimizer's spec with its learning-rate schedule and clipping; None until initialised."""
        self.sync = False
        """Whether updates are sync steps, whose gradient norm all PS agree on (clip_grad_norm)."""
        self._snapshots: dict[str | None, list[torch.Tensor]] = {}
        """The parameters of the current version for replies, by wire dtype (see `params_snapshot`)."""

    @classmethod
    def from_init(
        cls, init: Init, frames: Sequence[torch.Tensor], ps_index: int = 0, staging: Path | None = None
    ) -> Shards:
        """The variables `init` and its frames give (checked by protocol.Init), with their restored slots; this PS's
        rows of the `sf.nn` tables, restored from the checkpoint files `init` names. `staging`: where this PS
        writes its table files for checkpoints."""
        shards, buffers, start = cls(), [], 0
        for count in init.frame_counts:
            buffers.append(torch.cat(list(frames[start : start + count])) if count else torch.empty(0))
            start += count
        shards.dtypes = list(init.dtypes)
        shards.params = [torch.nn.Parameter(t, requires_grad=False) for t in buffers]
        tables = frames[start : start + init.num_tables]
        shards.tables = [torch.nn.Parameter(t.clone(), requires_grad=False) for t in tables]
        shards.optimizer = init.optimizer.build(list(shards.params)) if shards.params else None
        shards.table_optimizer = init.optimizer.build_sparse(list(shards.tables)) if shards.tables else None
        shards.spec, shards.sync = init.optimizer, init.apply.mode == "sync"
        if init.slots:
            slot_frames = list(frames[start + init.num_tables :])
            load_slots(shards.parts(), list(init.slots), list(init.scalars), slot_frames)
        shards.embeddings = EmbeddingShards(
            init.embeddings, ps_index, init.num_ps, staging=staging, full_checkpoint_every=init.full_checkpoint_every
        )
        if init.embedding_restore is not None:
            restore = init.embedding_restore
            shards.embeddings.restore(Path(restore.checkpoint), restore.chains)
        return shards

    def limits(self, num_workers: int) -> Limits:
        buffers = tuple((p.dtype, p.numel()) for p in self.params)
        return Limits(
            num_workers=num_workers,
            buffers=buffers,
            num_tables=len(self.tables),
            embedding_tables=len(self.embeddings),
        )

    def parts(self) -> list[Part]:
        """Every tensor this PS holds with the optimizer that updates it: the dtype buffers, then the tables."""
        return [(p, self.optimizer) for p in self.params] + [(t, self.table_optimizer) for t in self.tables]

    def params_snapshot(self, wire_dtype: str | None = None) -> list[torch.Tensor]:
        """The parameters for a reply's frames, each buffer in the dtype `wire_dtype` makes of it (protocol's
        `on_the_wire`)."""
        # Replies go out zero-copy while the next update changes the buffers in place, so they carry a copy,
        # made once per version and wire dtype and shared by every reply of that version.
        snapshot = self._snapshots.get(wire_dtype)
        if snapshot is None:
            snapshot = [p.detach().to(on_the_wire(p.dtype, wire_dtype), copy=True) for p in self.params]
            self._snapshots[wire_dtype] = snapshot
        return snapshot

    def copy_params_into(self, views: Sequence[torch.Tensor]) -> None:
        for view, param in zip(views, self.params, strict=True):
            view.copy_(param)

    def rows(self, table_indices: Sequence[int], row_numbers: Sequence[torch.Tensor], what: str) -> list[torch.Tensor]:
        """For each table index, the rows its frame of `row_numbers` lists; `what` names the request in errors."""
        values = []
        for index, rows in zip(table_indices, row_numbers, strict=True):
            table = self.tables[index]
            check_rows(rows, table, f"{what} for table {index}")
            # A copy, so the reply can go out zero-copy while later updates change the table.
            values.append(table.detach().index_select(0, rows))
        return values

    def riding_rows(self, message: object, frames: Sequence[torch.Tensor], what: str) -> list[torch.Tensor]:
        """The rows of the lookup that rode on a push (`Push.lookup`; its ids are the push's last `frames`, checked
        by `check_push`), as they are now; none for any other request."""
        if not isinstance(message, Push) or not message.lookup:
            return []
        self.embeddings.lookups["lookups_on_pushes"] += 1
        return self.embeddings.lookup(message.lookup, frames[len(frames) - len(message.lookup) :], what, checked=True)

    def check_push(self, push: Push, frames: Sequence[torch.Tensor], what: str) -> None:
        """Raise Refused, or ValueError for ids, unless this PS can take `push`, before anything of it is applied: its
        learning rate, where the schedule is a function of the step (the PS cannot run it), and the ids of a lookup
        riding on it (its last `frames`) in tables this PS holds, so that its reply cannot fail after."""
        schedule = self.spec.schedule if self.spec is not None else None
        if schedule is not None and schedule.from_workers and push.lr is None:
            raise Refused("its learning-rate schedule is a function of the step, so every push must carry its lr")
        if push.lookup:
            self.embeddings.check_lookup(push.lookup, frames[len(frames) - len(push.lookup) :], what)

    def gradients(
        self, push: Push, frames: Sequence[torch.Tensor], lane_slot: Sequence[torch.Tensor] | None, what: str
    ) -> Gradients:
        """A push's dense gradients, one tensor per dtype buffer (the views of its `lane_slot`, or fresh ones of
        its frames, cast up from the push's wire dtype to the buffer's), and its row-sparse ones, checked against
        the tables before anything is applied."""
        buffers, start = list(lane_slot) if lane_slot is not None else [], 0
        for count, param in zip(push.frame_counts, self.params, strict=True):
            if lane_slot is None:
                pieces = list(frames[start : start + count])
                buffers.append(torch.cat(pieces, out=torch.empty_like(param)) if pieces else torch.empty(0))
            start += count
        row_grads: list[list[RowGrad]] = []
        for index, table in enumerate(self.tables):
            rows, values = frames[start + 2 * index], frames[start + 2 * index + 1]
            check_row_grad(rows, values, table, f"{what} for table {index}")
            row_grads.append([(rows, values)])
        table_grads = self.embeddings.gradients(frames[start + 2 * len(self.tables) :], what)
        return Gradients(buffers, row_grads, table_grads)

    def apply(
        self, gradients: Gradients, count: int, step: int, lr: float | None, norm_exchange: clipping.NormExchange | None
    ) -> None:
        """One update at global step `step`: the mean of the dense and of the row-sparse gradients of `count`
        pushes, clipped, at the learning rate `lr` that came with them (or the schedule's)."""
        grads, row_grads, table_grads = gradients
        dense = [grad.div_(count) if count != 1 else grad for grad in grads] if self.optimizer is not None else []
        # Every table gets a gradient, empty if no row of it was looked up: as a whole table does in one process,
        # so step counts (Adam's bias correction) stay those of single-process training.
        sparse = [row_gradient(t, g, count) for t, g in zip(self.tables, row_grads, strict=True)]
        embedding = self.embeddings.coalesced(table_grads, count)
        rows = [values for _, _, values in embedding]
        self._clip(dense + sparse + rows, lambda squared: norm_exchange(step, squared) if norm_exchange else squared)
        self._schedule(step, lr)
        if embedding:
            self.embeddings.apply(embedding, step, self._lr_factor(step, lr))
        # A PS that holds no variables still counts steps, so every PS agrees on the global step.
        for optimizer, variables, variable_grads in (
            (self.optimizer, self.params, dense),
            (self.table_optimizer, self.tables, sparse),
        ):
            if optimizer is not None:
                for variable, grad in zip(variables, variable_grads, strict=True):
                    variable.grad = grad
                optimizer.step()
                for variable in variables:
                    variable.grad = None
        self._snapshots = {}

    def _lr_factor(self, step: int, lr: float | None) -> float:
        """What the schedule makes of the base learning rate at `step`, which the `sf.nn` tables' own learning
        rates follow too: the scheduled rate (or the one the push carried) over the optimizer's base rate."""
        spec = self.spec
        if spec is None or spec.schedule is None:
            return 1.0
        base = float(spec.kwargs.get("lr", 0.0))
        if base <= 0:
            return 1.0
        return (lr if spec.schedule.from_workers and lr is not None else spec.lr(step, base)) / base

    def _clip(self, grads: list[torch.Tensor], total_squared_norm: Callable[[float], float]) -> None:
        """Clip by value, then in sync mode by the global norm agreed with the other PS (ps/clipping.py)."""
        spec = self.spec
        if spec is not None and spec.clip_grad_value is not None:
            clipping.clamp_(grads, spec.clip_grad_value)
        if spec is not None and spec.clip_grad_norm is not None and self.sync:
            total = total_squared_norm(clipping.squared_norm(grads))
            clipping.scale_(grads, clipping.clip_coefficient(total**0.5, spec.clip_grad_norm))

    def _schedule(self, step: int, lr: float | None) -> None:
        """Set the learning rate of this global step's update."""
        spec = self.spec
        if spec is None or spec.schedule is None:
            return
        for optimizer in (self.optimizer, self.table_optimizer):
            if optimizer is None:
                continue
            if spec.schedule.from_workers:  # a function of the step: its value came with the push(es)
                assert lr is not None, "the PS refuses a push without its lr under such a schedule"
                value = lr
            else:
                value = spec.lr(step, optimizer.defaults["lr"])
            for group in optimizer.param_groups:
                group["lr"] = value
