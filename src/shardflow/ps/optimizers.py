"""Optimizer specs: plain configs sent to the PS, which build the `torch.optim` optimizer on their shards."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

# Element-wise optimizers only: the PS applies them to one flat buffer per dtype, which is exactly
# equivalent to applying them per tensor and much cheaper (one kernel instead of one per variable).
_OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {
    "SGD": torch.optim.SGD,
    "Adam": torch.optim.Adam,
    "AdamW": torch.optim.AdamW,
    "Adagrad": torch.optim.Adagrad,
    "RMSprop": torch.optim.RMSprop,
}


@dataclass(frozen=True)
class OptimizerSpec:
    """A `torch.optim` class name and its keyword arguments; serializable, never pickled."""

    name: str
    kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.name not in _OPTIMIZERS:
            raise ValueError(f"unknown optimizer {self.name!r}; choose one of {sorted(_OPTIMIZERS)}")
        for key, value in self.kwargs.items():
            if not isinstance(value, (int, float, bool, tuple, list)):
                raise ValueError(f"optimizer argument {key}={value!r} must be a number, bool or tuple")

    def build(self, params: list[torch.Tensor]) -> torch.optim.Optimizer:
        kwargs: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in self.kwargs.items()}
        return _OPTIMIZERS[self.name](params, **kwargs)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "kwargs": self.kwargs}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> OptimizerSpec:
        return cls(d["name"], dict(d["kwargs"]))


def SGD(lr: float = 0.01, momentum: float = 0.0, weight_decay: float = 0.0, nesterov: bool = False) -> OptimizerSpec:
    """Stochastic gradient descent, optionally with (Nesterov) momentum, applied on the PS."""
    return OptimizerSpec("SGD", {"lr": lr, "momentum": momentum, "weight_decay": weight_decay, "nesterov": nesterov})


def Adam(
    lr: float = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
) -> OptimizerSpec:
    """Adam, with its moment slots kept on the PS."""
    return OptimizerSpec("Adam", {"lr": lr, "betas": list(betas), "eps": eps, "weight_decay": weight_decay})


def AdamW(
    lr: float = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 1e-2,
) -> OptimizerSpec:
    """AdamW (decoupled weight decay), with its slots kept on the PS."""
    return OptimizerSpec("AdamW", {"lr": lr, "betas": list(betas), "eps": eps, "weight_decay": weight_decay})


def Adagrad(
    lr: float = 1e-2,
    initial_accumulator_value: float = 0.0,
    eps: float = 1e-10,
    weight_decay: float = 0.0,
) -> OptimizerSpec:
    """Adagrad, the classic choice for sparse embedding tables on parameter servers."""
    return OptimizerSpec(
        "Adagrad",
        {
            "lr": lr,
            "initial_accumulator_value": initial_accumulator_value,
            "eps": eps,
            "weight_decay": weight_decay,
        },
    )


def RMSprop(lr: float = 1e-2, alpha: float = 0.99, eps: float = 1e-8, momentum: float = 0.0) -> OptimizerSpec:
    """RMSprop, applied on the PS."""
    return OptimizerSpec("RMSprop", {"lr": lr, "alpha": alpha, "eps": eps, "momentum": momentum})
