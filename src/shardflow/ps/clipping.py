"""Gradient clipping of an update, exact against `torch.nn.utils.clip_grad_norm_` / `clip_grad_value_` in one
process on the same gradient.

Where it happens is chosen by what is exact:

- By value is element-wise, so each PS clamps its shard of the update's gradient (the mean of the pushes, in
  sync mode): the same numbers as clamping the whole gradient.
- By global norm needs the norm of the whole update. In async and ssp mode an update is one worker's gradient,
  so the worker clips it before pushing (`clip_local_gradients`). In sync mode the update is the mean of several
  workers' gradients, which no worker sees: each PS computes the squared norm of its shard of that mean, and the
  PS agree on the total through a `NormExchange` before applying; each then scales its shard by the same factor.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

import torch

from shardflow.cluster import control_keys

NormExchange = Callable[[int, float], float]
"""(global step, this PS's squared norm of the step's gradient) -> the squared norm over every PS."""


def _values(grad: torch.Tensor) -> torch.Tensor:
    return grad.coalesce().values() if grad.is_sparse else grad


def squared_norm(grads: Iterable[torch.Tensor]) -> float:
    """The squared L2 norm of all of `grads` (dense or coalesced sparse) together, summed in float64."""
    return float(sum((_values(g).double().square().sum() for g in grads), torch.zeros((), dtype=torch.float64)))


def clip_coefficient(total_norm: float, max_norm: float) -> float:
    """The factor `torch.nn.utils.clip_grad_norm_` scales gradients by: at most 1."""
    return min(max_norm / (total_norm + 1e-6), 1.0)


def scale_(grads: Sequence[torch.Tensor], factor: float) -> None:
    for grad in grads:
        grad.mul_(factor)


def clamp_(grads: Sequence[torch.Tensor], clip_value: float) -> None:
    for grad in grads:
        (grad._values() if grad.is_sparse else grad).clamp_(-clip_value, clip_value)


def clip_local_gradients(model: torch.nn.Module, max_norm: float, extra: Sequence[torch.Tensor] = ()) -> None:
    """Scale this process's gradients of `model`, and `extra` ones (the rows of `sf.nn` tables looked up), to at
    most `max_norm` in global L2 norm (async and ssp mode)."""
    params = [p for p in model.parameters() if p.grad is not None]
    for param in params:
        if param.grad is not None and param.grad.is_sparse:
            param.grad = param.grad.coalesce()
    grads = [p.grad for p in params if p.grad is not None] + list(extra)
    scale_(grads, clip_coefficient(squared_norm(grads) ** 0.5, max_norm))


class _Store(Protocol):
    """What a NormExchange needs of the job's control plane (cluster/control_plane.py ControlPlane)."""

    def set(self, key: str, value: str) -> None: ...
    def get(self, key: str, *, waiting_for: str, timeout_s: float | None = None) -> str: ...
    def wait(self, keys: list[str], *, waiting_for: str, timeout_s: float | None = None) -> None: ...
    def delete(self, key: str) -> bool: ...


class StoreNormExchange:
    """Agrees the squared norm of a sync step's gradient across `num_ps` PS through the job's key-value store, which
    serves independently of the PS' own request loops, so no PS waits on another's. Each PS writes its shard's
    value under the step and reads every PS's; all sum them in PS order, so all get the same float.

    Sync mode only: a PS writes step s once every PS has answered step s - 1 (the workers wait for all of them),
    so by then every PS has read the values of s - 1 and a PS may delete its own."""

    def __init__(self, store: _Store, index: int, num_ps: int, timeout_s: float) -> None:
        self.store, self.index, self.num_ps, self.timeout_s = store, index, num_ps, timeout_s
        self._written: str | None = None
        self.generation = 0
        """The PS's recovery generation (protocol `Init`): a restored PS counts the same steps again."""

    def _key(self, step: int, ps: int) -> str:
        return control_keys.clip_norm(self.generation, step, ps)

    def __call__(self, step: int, squared: float) -> float:
        own = self._key(step, self.index)
        self.store.set(own, repr(squared))
        if self._written is not None:
            self.store.delete(self._written)
        self._written = own
        keys = [self._key(step, k) for k in range(self.num_ps)]
        what = f"the other PS' gradient norms of global step {step} (clip_grad_norm in sync mode)"
        self.store.wait(keys, waiting_for=what, timeout_s=self.timeout_s)
        return sum(float(self.store.get(key, waiting_for=what, timeout_s=self.timeout_s)) for key in keys)
