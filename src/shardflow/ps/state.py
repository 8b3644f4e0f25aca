"""A PS's checkpointable state: its flat parameter buffers and the optimizer slots that mirror them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class ShardState:
    """Parameters (one flat buffer per dtype), slot buffers and scalar slots, and ps:0's input positions.

    `slots[i]` describes buffer i's optimizer state: key -> index into `slot_tensors`, and `scalars[i]`
    key -> value (e.g. Adam's step count)."""

    step: int
    params: list[torch.Tensor]
    slots: list[dict[str, int]] = field(default_factory=list)
    slot_tensors: list[torch.Tensor] = field(default_factory=list)
    scalars: list[dict[str, float]] = field(default_factory=list)
    iterators: dict[str, Any] = field(default_factory=dict)

    def header(self) -> dict[str, Any]:
        return {"state_step": self.step, "slots": self.slots, "scalars": self.scalars, "iterators": self.iterators}

    def tensors(self) -> list[torch.Tensor]:
        return [*self.params, *self.slot_tensors]


def capture(
    step: int, params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer | None, iterators: dict[str, Any]
) -> ShardState:
    """A copy of the current state that later updates do not change."""
    state = ShardState(step, [p.detach().clone() for p in params], iterators=dict(iterators))
    for param in params:
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
    params: list[torch.nn.Parameter],
    optimizer: torch.optim.Optimizer | None,
    slots: list[dict[str, int]],
    scalars: list[dict[str, float]],
    tensors: list[torch.Tensor],
) -> None:
    """Put restored slots into the optimizer's state, in the types torch.optim keeps them in."""
    if optimizer is None:
        return
    for param, param_slots, param_scalars in zip(params, slots, scalars, strict=True):
        state: dict[str, Any] = {key: tensors[index].clone() for key, index in param_slots.items()}
        # torch.optim keeps step counts as 0-d float32 tensors on the CPU.
        state.update({key: torch.tensor(value, dtype=torch.float32) for key, value in param_scalars.items()})
        if state:
            optimizer.state[param] = state
