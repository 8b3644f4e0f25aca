"""The chief's exchanges of whole-model state with the PS: initialise them (fresh or restored, on any number of PS)
and collect their parameters, optimizer slots and input positions for a checkpoint."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import torch

from shardflow.nn.modules import table_specs
from shardflow.ps import protocol
from shardflow.ps.connection import PSConnection
from shardflow.ps.embeddings.spec import TableSpec
from shardflow.ps.layout import ShardLayout, put
from shardflow.ps.optimizers import OptimizerSpec
from shardflow.ps.update_rules import ApplyConfig
from shardflow.train.checkpoints import store
from shardflow.train.checkpoints.model_state import ModelState


@dataclass(frozen=True)
class TableSetup:
    """The model's `sf.nn` tables as the chief sends them to every PS."""

    specs: tuple[TableSpec, ...] = ()
    staging: Path | None = None
    """Where each PS writes its table files for checkpoints; None: the job keeps no checkpoints of them."""
    full_checkpoint_every: int = 10

    @classmethod
    def of(cls, model: torch.nn.Module, model_dir: Path | None, full_checkpoint_every: int = 10) -> TableSetup:
        """The tables of `model`; their files staged under `model_dir`/tables."""
        staging = store.table_staging(model_dir) if model_dir is not None else None
        return cls(tuple(table_specs(model)), staging, full_checkpoint_every)

    def resolved(self, optimizer: OptimizerSpec) -> tuple[TableSpec, ...]:
        """Each table with its row optimizer: its own, or the job's in its sparse form."""
        return tuple(
            spec if spec.optimizer is not None else msgspec.structs.replace(spec, optimizer=optimizer.rows(spec))
            for spec in self.specs
        )


def per_ps_progress(restore: ModelState | None, num_ps: int) -> list[dict[str, Any]]:
    """What each of `num_ps` PS gets of the workers' steps when restoring: its own, if the checkpoint was written
    by as many PS; else ps:0's input positions alone (the workers then start from those, see restore.py)."""
    if restore is None:
        return [{}] * num_ps
    if len(restore.ps_progress) == num_ps:
        return restore.ps_progress
    return [{"iterators": restore.iterators}] + [{}] * (num_ps - 1)


def init_servers(
    client: PSConnection,
    optimizer: OptimizerSpec,
    apply: ApplyConfig,
    restore: ModelState | None = None,
    timeout_s: float | None = None,
    generation: int = 0,
    tables: TableSetup | None = None,
) -> None:
    """Send each PS its shard values (the model's current parameters), optimizer, update rule and, when
    restoring, its slots cut from whole-variable slots by this placement: so any number of PS can load
    a checkpoint written by any other number. `generation` counts the restores after a PS was lost. `tables`:
    the model's `sf.nn` tables; each PS makes (or reads from the checkpoint's files) the rows it owns."""
    tables = tables or TableSetup()
    progress = per_ps_progress(restore, client.layout.num_ps)
    layout = client.layout
    # Before any PS is initialised: an optimizer that cannot apply sparse gradients stops the job at its start.
    for name in layout.row_pieces:
        optimizer.check_sparse(name)
    messages, frames = [], []
    for k in range(layout.num_ps):
        dense, counts = layout.dense_frames(k, client.named, use_grads=False)
        ps_frames = dense + layout.table_frames(k, client.named)
        slots: list[dict[str, int]] = []
        scalars: list[dict[str, float]] = []
        if restore is not None:
            slots, scalars, slot_frames = _cut_slots(layout, k, restore)
            ps_frames += slot_frames
        messages.append(
            protocol.Init(
                dtypes=tuple(layout.dtypes[k]),
                num_tables=len(layout.tables[k]),
                optimizer=optimizer,
                apply=apply,
                step=restore.step if restore else 0,
                frame_counts=tuple(counts),
                slots=tuple(slots),
                scalars=tuple(scalars),
                iterators=progress[k].get("iterators", {}),
                worker_steps=progress[k].get("worker_steps", {}),
                generation=generation,
                num_ps=layout.num_ps,
                embeddings=tables.resolved(optimizer),
                embedding_restore=restore.tables if restore is not None else None,
                embedding_staging=str(tables.staging) if tables.staging is not None else None,
                full_checkpoint_every=tables.full_checkpoint_every,
            )
        )
        frames.append(ps_frames)
    # A PS that just started may still be starting up: this wait may be the start-up deadline.
    client.exchange(messages, frames, timeout_s)


def _cut_slots(
    layout: ShardLayout, ps: int, restore: ModelState
) -> tuple[list[dict[str, int]], list[dict[str, float]], list[torch.Tensor]]:
    """Each part of `ps` (a dtype buffer, then a table) gets the slots all of its pieces have, cut to its rows:
    flat for a buffer, shaped as the piece for a table; and the scalar slots, if it has any slot."""
    slots: list[dict[str, int]] = []
    frames: list[torch.Tensor] = []
    for part, pieces in enumerate(layout.parts(ps)):
        part_slots = {}
        for key, by_name in sorted(restore.slots.items()):
            if not all(p.name in by_name for p in pieces):
                continue
            values = [by_name[p.name][p.row_start : p.row_end] if p.partitioned else by_name[p.name] for p in pieces]
            part_slots[key] = len(frames)
            frames.append(values[0] if part >= len(layout.dtypes[ps]) else torch.cat([v.reshape(-1) for v in values]))
        slots.append(part_slots)
    return slots, [dict(restore.scalars) if part_slots else {} for part_slots in slots], frames


def fetch_state(client: PSConnection, snapshot_step: int | None = None) -> ModelState:
    """Every variable and slot reassembled from its pieces, now or at a snapshot step. The client's model is
    left as it is: load `params` into it to use them there."""
    layout = client.layout
    replies = client.exchange([protocol.GetState(snapshot_step=snapshot_step)] * layout.num_ps)
    state = ModelState(step=-1, params={})
    params: list[list[torch.Tensor]] = []
    for k, (header, tensors) in enumerate(replies):
        reply = protocol.StateReply.decode(header, client.peers[k])
        num_parts = len(layout.dtypes[k]) + len(layout.tables[k])
        if len(tensors) < num_parts or len(reply.slots) != num_parts or len(reply.scalars) != num_parts:
            raise protocol.PSProtocolError(
                protocol.GetState.op, "frames", client.peers[k], f"do not fit the {num_parts} parts of the layout"
            )
        params.append(tensors[:num_parts])
        slot_tensors = tensors[num_parts:]
        # Each part's pieces, where they sit in its tensor: a dtype buffer packs several, a table is one.
        for pieces, part_slots, part_scalars in zip(layout.parts(k), reply.slots, reply.scalars, strict=True):
            state.scalars.update(part_scalars)
            for key, index in part_slots.items():
                by_name = state.slots.setdefault(key, {})
                for piece in pieces:
                    where = slice(None) if piece.sparse else slice(piece.offset, piece.offset + piece.numel)
                    put(by_name, piece, slot_tensors[index][where])
        if k == 0:
            state.step = reply.state_step
            state.iterators = dict(reply.iterators)
        state.ps_progress.append({"worker_steps": dict(reply.worker_steps), "iterators": dict(reply.iterators)})
        state.stats[client.peers[k]] = {"step": reply.step, **reply.stats}
        state.table_files += reply.table_files
        if reply.table_error is not None:
            state.table_errors.append(reply.table_error)
    whole = layout.whole(params)
    state.params = {name: whole[name] for name in client.named}
    return state
