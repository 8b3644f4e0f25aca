"""The chief's side of PS state: initialise the PS (fresh or restored, on any number of PS) and collect
their parameters, optimizer slots and input positions for a checkpoint."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from shardflow.ps.apply import ApplyConfig
from shardflow.ps.client import ParameterClient
from shardflow.ps.optimizers import OptimizerSpec
from shardflow.ps.placement import Piece


@dataclass
class ModelState:
    """Whole variables, independent of how they were placed: what a checkpoint holds."""

    step: int
    params: dict[str, torch.Tensor]
    slots: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    """slot key (e.g. "exp_avg") -> variable name -> tensor shaped like the variable."""
    scalars: dict[str, float] = field(default_factory=dict)
    """Scalar optimizer state shared by all variables (e.g. Adam's "step")."""
    iterators: dict[str, Any] = field(default_factory=dict)
    """Each worker's input position after the last batch whose update is in `params`."""
    stats: dict[str, Any] = field(default_factory=dict)


def init_servers(
    client: ParameterClient,
    optimizer: OptimizerSpec,
    apply: ApplyConfig,
    restore: ModelState | None = None,
    timeout_s: float | None = None,
) -> None:
    """Send each PS its shard values (the model's current parameters), optimizer, update rule and, when
    restoring, its slots cut from whole-variable slots by this placement: so any number of PS can load
    a checkpoint written by any other number."""
    # Before any PS is initialised: an optimizer that cannot apply sparse gradients stops the job at its start.
    for name in client.row_pieces:
        optimizer.check_sparse(name)
    seqs = {}
    for k, peer in enumerate(client.peers):
        header: dict[str, Any] = {
            "op": "init",
            "dtypes": client.dtypes[k],
            "tables": len(client.tables[k]),
            "optimizer": optimizer.to_json(),
            "apply": apply.to_json(),
            "step": restore.step if restore else 0,
        }
        frames, counts = client._frames(k, use_grads=False)
        table_frames = client._table_frames(k)
        frames += table_frames
        counts += [1] * len(table_frames)
        if restore is not None:
            slots, scalars, slot_frames = _cut_slots(client, k, restore)
            header.update(slots=slots, scalars=scalars, iterators=restore.iterators if k == 0 else {})
            frames += slot_frames
            counts += [1] * len(slot_frames)
        header["n"] = counts
        seqs[peer] = client.client.send(peer, header, frames)
    # A PS that just started may still be starting up: this wait may be the start-up deadline.
    for peer, seq in seqs.items():
        client.client.recv(peer, seq, timeout_s or client.timeout_s)


def _cut_slots(
    client: ParameterClient, ps: int, restore: ModelState
) -> tuple[list[dict[str, int]], list[dict[str, float]], list[torch.Tensor]]:
    """Each part of `ps` (a dtype buffer, then a table) gets the slots all of its pieces have, cut to its rows:
    flat for a buffer, shaped as the piece for a table; and the scalar slots, if it has any slot."""
    parts = [client.pieces[ps][dtype] for dtype in client.dtypes[ps]] + [[table] for table in client.tables[ps]]
    slots: list[dict[str, int]] = []
    frames: list[torch.Tensor] = []
    for part, pieces in enumerate(parts):
        part_slots = {}
        for key, by_name in sorted(restore.slots.items()):
            if not all(p.name in by_name for p in pieces):
                continue
            values = [by_name[p.name][p.row_start : p.row_end] if p.partitioned else by_name[p.name] for p in pieces]
            part_slots[key] = len(frames)
            frames.append(values[0] if part >= len(client.dtypes[ps]) else torch.cat([v.reshape(-1) for v in values]))
        slots.append(part_slots)
    return slots, [dict(restore.scalars) if part_slots else {} for part_slots in slots], frames


def fetch_state(client: ParameterClient, snapshot: int | None = None) -> ModelState:
    """Every variable and slot reassembled from its pieces, now or at a snapshot step; loads the parameters
    into the client's model too."""
    header = {"op": "state"} if snapshot is None else {"op": "state", "snapshot": snapshot}
    seqs = {peer: client.client.send(peer, dict(header)) for peer in client.peers}
    state = ModelState(step=-1, params={})
    params: dict[int, Sequence[torch.Tensor]] = {}
    whole_tables: dict[str, torch.Tensor] = {}
    for k, peer in enumerate(client.peers):
        reply, tensors = client.client.recv(peer, seqs[peer], client.timeout_s)
        num_buffers, num_tables = len(client.dtypes[k]), len(client.tables[k])
        params[k] = tensors[:num_buffers]
        slot_tensors = tensors[num_buffers + num_tables :]
        # Each part's pieces, where they sit in its tensor: a dtype buffer packs several, a table is one.
        parts = [[(p, slice(p.offset, p.offset + p.numel)) for p in client.pieces[k][d]] for d in client.dtypes[k]]
        parts += [[(piece, slice(None))] for piece in client.tables[k]]
        for piece, values in zip(client.tables[k], tensors[num_buffers : num_buffers + num_tables], strict=True):
            _put(whole_tables, piece, values)
        for pieces, part_slots, part_scalars in zip(parts, reply["slots"], reply["scalars"], strict=True):
            state.scalars.update(part_scalars)
            for key, index in part_slots.items():
                by_name = state.slots.setdefault(key, {})
                for slot_piece, where in pieces:
                    _put(by_name, slot_piece, slot_tensors[index][where])
        if k == 0:
            state.step = int(reply["state_step"])
            state.iterators = dict(reply["iterators"])
        state.stats[peer] = {"step": reply["step"], **reply["stats"]}
    client._load(params)
    for name, table in whole_tables.items():
        client.named[name].data = table
    state.params = {name: p.detach().clone() for name, p in client.named.items()}
    return state


def _put(by_name: dict[str, torch.Tensor], piece: Piece, values: torch.Tensor) -> None:
    """Copy one piece's values into its whole variable in `by_name`, made on its first piece."""
    values = values.reshape(piece.piece_shape)
    if piece.name not in by_name:
        by_name[piece.name] = torch.empty(piece.shape, dtype=values.dtype)
    target = by_name[piece.name]
    (target[piece.row_start : piece.row_end] if piece.partitioned else target).copy_(values)
