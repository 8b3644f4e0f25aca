"""A PS's checkpointable state: its parameter buffers and tables and the optimizer slots that mirror them, and the
snapshots it holds until the chief has saved them (the chief's side is train/checkpoints/)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from shardflow.ps.embeddings.files import FileRecord
from shardflow.ps.replies import StateReply

Part = tuple[torch.nn.Parameter, torch.optim.Optimizer | None]
"""A tensor the PS holds (a flat dtype buffer or a row-sparse table) and the optimizer that updates it."""


@dataclass
class ShardState:
    """Parameters (one flat buffer per dtype, then one tensor per row-sparse table), slot tensors and scalar
    slots, and what this PS has of each worker's steps (see ps/worker_progress.py).

    `slots[i]` describes part i's optimizer state: key -> index into `slot_tensors`, and `scalars[i]`
    key -> value (e.g. Adam's step count)."""

    step: int
    params: list[torch.Tensor]
    slots: list[dict[str, int]] = field(default_factory=list)
    slot_tensors: list[torch.Tensor] = field(default_factory=list)
    scalars: list[dict[str, float]] = field(default_factory=list)
    iterators: dict[str, Any] = field(default_factory=dict)
    worker_steps: dict[str, int] = field(default_factory=dict)
    """By "worker:<index>", the last of that worker's steps in this state; `iterators` holds its position after."""
    table_files: tuple[FileRecord, ...] = ()
    """The files holding this PS's rows of the `sf.nn` tables as of `step`, in replay order."""
    table_error: str | None = None
    """Why those files could not be written; then this state is no checkpoint."""

    def tensors(self) -> list[torch.Tensor]:
        return [*self.params, *self.slot_tensors]

    def reply(self, step: int, stop: bool, dtypes: Sequence[str], stats: dict[str, float]) -> StateReply:
        """The header of a PS's answer to `GetState` with this state; `tensors()` are its frames."""
        return StateReply(
            step=step,
            stop=stop,
            state_step=self.step,
            dtypes=tuple(dtypes),
            slots=tuple(self.slots),
            scalars=tuple(self.scalars),
            iterators=self.iterators,
            worker_steps=self.worker_steps,
            stats=stats,
            table_files=self.table_files,
            table_error=self.table_error,
        )


def capture(
    step: int,
    parts: Sequence[Part],
    iterators: dict[str, Any],
    worker_steps: dict[str, int],
    table_files: tuple[FileRecord, ...] = (),
    table_error: str | None = None,
) -> ShardState:
    """A copy of the current state that later updates do not change (the tables' rows: in `table_files`)."""
    state = ShardState(
        step,
        [param.detach().clone() for param, _ in parts],
        iterators=dict(iterators),
        worker_steps=dict(worker_steps),
        table_files=table_files,
        table_error=table_error,
    )
    for param, optimizer in parts:
        slots: dict[str, int] = {}
        scalars: dict[str, float] = {}
        for key, value in (optimizer.state.get(param, {}) if optimizer is not None else {}).items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                slots[key] = len(state.slot_tensors)
                state.slot_tensors.append(value.detach().clone())
            else:
                scalars[key] = float(value)
        state.slots.append(slots)
        state.scalars.append(scalars)
    return state


def load_slots(
    parts: Sequence[Part],
    slots: list[dict[str, int]],
    scalars: list[dict[str, float]],
    tensors: list[torch.Tensor],
) -> None:
    """Put restored slots into the optimizers' state, in the types torch.optim keeps them in."""
    for (param, optimizer), part_slots, part_scalars in zip(parts, slots, scalars, strict=True):
        if optimizer is None:
            continue
        state: dict[str, Any] = {key: tensors[index].clone() for key, index in part_slots.items()}
        # torch.optim keeps step counts as 0-d float32 tensors on the CPU; SparseAdam as Python ints.
        if isinstance(optimizer, torch.optim.SparseAdam):
            state.update({key: int(value) for key, value in part_scalars.items()})
        else:
            state.update({key: torch.tensor(value, dtype=torch.float32) for key, value in part_scalars.items()})
        if state:
            optimizer.state[param] = state


# Snapshots the chief has not saved yet; at this many the PS stops applying pushes until it catches up, so
# every checkpoint and evaluation happens at its exact step, as TF's synchronous checkpoint hooks do.
MAX_SNAPSHOTS = 4


class Snapshots:
    """A PS's checkpoint snapshots, taken at exact steps and held until the chief has saved them."""

    def __init__(self, every_n_steps: int | None = None) -> None:
        self.every_n_steps = every_n_steps
        self.at: int | None = None
        """One more step to snapshot, asked for by the chief (a time-based checkpoint)."""
        self.held: dict[int, ShardState] = {}

    def due(self, step: int) -> bool:
        every = self.every_n_steps
        return bool(every and step % every == 0) or step == self.at

    @property
    def full(self) -> bool:
        return len(self.held) >= MAX_SNAPSHOTS

    def get(self, step: int) -> ShardState:
        if step not in self.held:
            raise ValueError(f"no snapshot at step {step}; the PS holds {sorted(self.held)}")
        return self.held[step]

    def release(self, through_step: int) -> None:
        for step in [s for s in self.held if s <= through_step]:
            del self.held[step]
