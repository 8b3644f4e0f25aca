"""A worker's model and optimizer in the checkpoints' terms (model_state.py `ModelState`: whole variables, slots by
slot key, shared scalars), so that `sf.AllReduceStrategy` writes and restores the checkpoints the PS strategy does;
and a state's tensors' passage over the control plane, as safetensors bytes in chunks (never pickled); its step and
scalars travel in the typed key that announces it. A state worker:0 hands the chief is streamed: at most WINDOW chunks
of it are on the control plane at once, whatever its size (the control store holds 1 GiB in all)."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from safetensors.torch import load, save

from shardflow.cluster import control_keys
from shardflow.cluster.control_plane import ControlPlane
from shardflow.train.checkpoints.model_state import ModelState
from shardflow.train.checkpoints.store import SLOT_SEPARATOR

CHUNK_BYTES = 32 * 2**20
"""Below the control service's largest value (cluster/control.py MAX_VALUE)."""
WINDOW = 8
"""Chunks of a streamed state on the control plane at once (`stream`): 256 MiB."""


def capture(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> ModelState:
    """A copy of the model's values and its optimizer's state at global step `step`: a tensor slot of more than
    zero dimensions by variable name, anything else (Adam's step count) a scalar shared by all, as a PS keeps them
    (ps/state.py `capture`). The copy is in host memory, wherever the model computes."""
    params = {name: _host_copy(tensor) for name, tensor in model.state_dict().items()}
    state = ModelState(step=step, params=params)
    for name, param in model.named_parameters():
        for key, value in optimizer.state.get(param, {}).items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                state.slots.setdefault(key, {})[name] = _host_copy(value)
            elif value is not None:
                state.scalars[key] = float(value)
    return state


def restore(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: ModelState) -> None:
    """Load `state` into `model` and `optimizer`: a variable with any slot gets the shared scalars too, in the types
    torch.optim keeps them in (ps/state.py `load_slots`); the slots on the variable's device."""
    model.load_state_dict(state.params)
    for name, param in model.named_parameters():
        slots: dict[str, torch.Tensor] = {
            key: by_name[name].to(param.device, copy=True) for key, by_name in state.slots.items() if name in by_name
        }
        if slots:
            scalars = {key: torch.tensor(value, dtype=torch.float32) for key, value in state.scalars.items()}
            optimizer.state[param] = {**slots, **scalars}


def _host_copy(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().to("cpu", copy=True)


def to_bytes(state: ModelState) -> bytes:
    """The tensors of `state` (params and slots) as safetensors bytes; its step and scalars travel beside them."""
    tensors = {key: value.contiguous() for key, value in state.params.items()}
    for key, by_name in state.slots.items():
        for variable, tensor in by_name.items():
            tensors[SLOT_SEPARATOR.join(("slot", key, variable))] = tensor.contiguous()
    return save(tensors)


def from_bytes(data: bytes, *, step: int, scalars: dict[str, float]) -> ModelState:
    """The state of global step `step` with `scalars`, whose tensors `to_bytes` made `data`."""
    state = ModelState(step=step, params={}, scalars=dict(scalars))
    for key, tensor in load(data).items():
        if key.startswith("slot" + SLOT_SEPARATOR):
            _, slot, variable = key.split(SLOT_SEPARATOR, 2)
            state.slots.setdefault(slot, {})[variable] = tensor
        else:
            state.params[key] = tensor
    return state


def encode(state: ModelState) -> list[bytes]:
    """The tensors of `state` as safetensors bytes (`to_bytes`), in chunks of at most CHUNK_BYTES."""
    data = to_bytes(state)
    return [data[start : start + CHUNK_BYTES] for start in range(0, len(data), CHUNK_BYTES)]


def stream(control: ControlPlane, name: str, chunks: list[bytes], *, reader_gone: Callable[[], bool]) -> bool:
    """Put `chunks` under `name` for one reader that deletes each (`receive` with `delete`): chunk i only once it
    took chunk i - WINDOW. False, with the rest not put, where `reader_gone()`, asked while it waits, says the reader
    will never take it (a restarted chief); True once every chunk is put."""
    for index, chunk in enumerate(chunks):
        if index >= WINDOW:
            taken = control_keys.state_taken(name, index - WINDOW)
            while not control.set_within(taken, 1.0, waiting_for=f"the chief to read chunk {index - WINDOW}"):
                if reader_gone():
                    return False
            control.delete(taken)
        control.set(control_keys.state_chunk(name, index), chunk)
    return True


class StreamCut(RuntimeError):
    """The sender of a streamed state was lost before it put all of it."""


def forget(control: ControlPlane, name: str, num_chunks: int) -> None:
    """Remove what a `stream` of `num_chunks` under `name` left on the control plane."""
    for index in range(num_chunks):
        control.delete(control_keys.state_chunk(name, index))
        control.delete(control_keys.state_taken(name, index))


def receive(
    control: ControlPlane,
    name: str,
    num_chunks: int,
    *,
    step: int,
    scalars: dict[str, float],
    waiting_for: str,
    delete: bool,
    sender_gone: Callable[[], bool] | None = None,
) -> ModelState:
    """The state of global step `step` with `scalars`, whose tensors `send` or `stream` put under `name`; with
    `delete`, each chunk is removed once read, and its streaming sender told. `sender_gone()`, asked while a chunk
    is awaited, says the sender was lost (StreamCut): the chunk would never come."""
    pieces = []
    for index in range(num_chunks):
        key = control_keys.state_chunk(name, index)
        pieces.append(_chunk(control, key, waiting_for, sender_gone))
        if delete:
            control.delete(key)
            if index + WINDOW < num_chunks:  # a streaming sender waits for it
                control.set(control_keys.state_taken(name, index), "1")
    return from_bytes(b"".join(pieces), step=step, scalars=scalars)


def _chunk(control: ControlPlane, key: str, waiting_for: str, sender_gone: Callable[[], bool] | None) -> bytes:
    if sender_gone is None:
        return control.get_bytes(key, waiting_for=waiting_for)
    deadline = time.monotonic() + control.timeout_s
    while (data := control.get_if_set(key)) is None:
        if not control.set_within(key, 1.0, waiting_for=waiting_for) and sender_gone():
            raise StreamCut(f"{waiting_for}: its sender was lost before it put {key!r}")
        if time.monotonic() > deadline:
            raise StreamCut(f"waited {control.timeout_s:.0f}s for {waiting_for} ({key!r})")
    return data
