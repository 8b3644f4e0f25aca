"""A worker's model and optimizer in the checkpoints' terms (model_state.py `ModelState`: whole variables, slots by
slot key, shared scalars), so that `sf.AllReduceStrategy` writes and restores the checkpoints the PS strategy does;
and a state's tensors' passage over the control plane, as safetensors bytes in chunks (never pickled); its step and
scalars travel in the typed key that announces it."""

from __future__ import annotations

import torch
from safetensors.torch import load, save

from shardflow.cluster import control_keys
from shardflow.cluster.control_plane import ControlPlane
from shardflow.train.checkpoints.model_state import ModelState
from shardflow.train.checkpoints.store import SLOT_SEPARATOR

CHUNK_BYTES = 32 * 2**20
"""Below the control service's largest value (cluster/control.py MAX_VALUE)."""


def capture(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> ModelState:
    """A copy of the model's values and its optimizer's state at global step `step`: a tensor slot of more than
    zero dimensions by variable name, anything else (Adam's step count) a scalar shared by all, as a PS keeps them
    (ps/state.py `capture`)."""
    params = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    state = ModelState(step=step, params=params)
    for name, param in model.named_parameters():
        for key, value in optimizer.state.get(param, {}).items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                state.slots.setdefault(key, {})[name] = value.detach().clone()
            elif value is not None:
                state.scalars[key] = float(value)
    return state


def restore(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: ModelState) -> None:
    """Load `state` into `model` and `optimizer`: a variable with any slot gets the shared scalars too, in the types
    torch.optim keeps them in (ps/state.py `load_slots`)."""
    model.load_state_dict(state.params)
    for name, param in model.named_parameters():
        slots: dict[str, torch.Tensor] = {
            key: by_name[name].clone() for key, by_name in state.slots.items() if name in by_name
        }
        if slots:
            scalars = {key: torch.tensor(value, dtype=torch.float32) for key, value in state.scalars.items()}
            optimizer.state[param] = {**slots, **scalars}


def send(control: ControlPlane, name: str, state: ModelState) -> int:
    """Put the tensors of `state` (params and slots) on the control plane under `name`; the number of chunks."""
    tensors = {key: value.contiguous() for key, value in state.params.items()}
    for key, by_name in state.slots.items():
        for variable, tensor in by_name.items():
            tensors[SLOT_SEPARATOR.join(("slot", key, variable))] = tensor.contiguous()
    data = save(tensors)
    chunks = [data[start : start + CHUNK_BYTES] for start in range(0, len(data), CHUNK_BYTES)]
    for index, chunk in enumerate(chunks):
        control.set(control_keys.state_chunk(name, index), chunk)
    return len(chunks)


def receive(
    control: ControlPlane,
    name: str,
    num_chunks: int,
    *,
    step: int,
    scalars: dict[str, float],
    waiting_for: str,
    delete: bool,
) -> ModelState:
    """The state of global step `step` with `scalars`, whose tensors `send` put under `name`; with `delete`, its
    chunks are removed once read."""
    keys = [control_keys.state_chunk(name, index) for index in range(num_chunks)]
    data = b"".join(control.get_bytes(key, waiting_for=waiting_for) for key in keys)
    if delete:
        for key in keys:
            control.delete(key)
    state = ModelState(step=step, params={}, scalars=dict(scalars))
    for key, tensor in load(data).items():
        if key.startswith("slot" + SLOT_SEPARATOR):
            _, slot, variable = key.split(SLOT_SEPARATOR, 2)
            state.slots.setdefault(slot, {})[variable] = tensor
        else:
            state.params[key] = tensor
    return state
