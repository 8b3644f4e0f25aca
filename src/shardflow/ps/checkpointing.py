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
    seqs = {}
    for k, peer in enumerate(client.peers):
        header: dict[str, Any] = {
            "op": "init",
            "dtypes": client.dtypes[k],
            "optimizer": optimizer.to_json(),
            "apply": apply.to_json(),
            "step": restore.step if restore else 0,
        }
        frames, counts = client._frames(k, use_grads=False)
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
    slots: list[dict[str, int]] = []
    frames: list[torch.Tensor] = []
    for dtype in client.dtypes[ps]:
        pieces = client.pieces[ps][dtype]
        buffer_slots = {}
        for key, by_name in sorted(restore.slots.items()):
            if not all(p.name in by_name for p in pieces):
                continue
            parts = [by_name[p.name][p.row_start : p.row_end] if p.partitioned else by_name[p.name] for p in pieces]
            buffer_slots[key] = len(frames)
            frames.append(torch.cat([part.reshape(-1) for part in parts]))
        slots.append(buffer_slots)
    return slots, [dict(restore.scalars) for _ in client.dtypes[ps]], frames


def fetch_state(client: ParameterClient, snapshot: int | None = None) -> ModelState:
    """Every variable and slot reassembled from its pieces, now or at a snapshot step; loads the parameters
    into the client's model too."""
    header = {"op": "state"} if snapshot is None else {"op": "state", "snapshot": snapshot}
    seqs = {peer: client.client.send(peer, dict(header)) for peer in client.peers}
    state = ModelState(step=-1, params={})
    params: dict[int, Sequence[torch.Tensor]] = {}
    for k, peer in enumerate(client.peers):
        reply, tensors = client.client.recv(peer, seqs[peer], client.timeout_s)
        num_buffers = len(client.dtypes[k])
        params[k] = tensors[:num_buffers]
        slot_tensors = tensors[num_buffers:]
        for dtype, buffer_slots, buffer_scalars in zip(client.dtypes[k], reply["slots"], reply["scalars"], strict=True):
            state.scalars.update(buffer_scalars)
            for key, index in buffer_slots.items():
                by_name = state.slots.setdefault(key, {})
                for piece in client.pieces[k][dtype]:
                    values = slot_tensors[index][piece.offset : piece.offset + piece.numel].view(piece.piece_shape)
                    if piece.name not in by_name:
                        by_name[piece.name] = torch.empty(piece.shape, dtype=values.dtype)
                    target = by_name[piece.name]
                    (target[piece.row_start : piece.row_end] if piece.partitioned else target).copy_(values)
        if k == 0:
            state.step = int(reply["state_step"])
            state.iterators = dict(reply["iterators"])
        state.stats[peer] = {"step": reply["step"], **reply["stats"]}
    client._load(params)
    state.params = {name: p.detach().clone() for name, p in client.named.items()}
    return state
