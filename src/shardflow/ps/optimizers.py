"""Optimizer specs: plain configs sent to the PS, which build the `torch.optim` optimizer on their shards, and
the optimizer that stands in for one on row-sparse tables."""

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

# The optimizer applied to row-sparse tables in place of each one that has an exact (SGD, Adagrad) or lazy (Adam)
# sparse form, with the arguments it takes over; any other argument must be neutral, or the job is refused.
_SPARSE: dict[str, tuple[type[torch.optim.Optimizer], set[str]]] = {
    "SGD": (torch.optim.SGD, {"lr"}),
    "Adagrad": (torch.optim.Adagrad, {"lr", "lr_decay", "initial_accumulator_value", "eps"}),
    "Adam": (torch.optim.SparseAdam, {"lr", "betas", "eps", "maximize"}),
}
_SPARSE_NEUTRAL: dict[str, Any] = {
    "momentum": 0.0,
    "dampening": 0.0,
    "nesterov": False,
    "weight_decay": 0.0,
    "amsgrad": False,
    "maximize": False,
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
        return _OPTIMIZERS[self.name](params, **self._kwargs())

    def build_sparse(self, tables: list[torch.Tensor]) -> torch.optim.Optimizer:
        """The optimizer for row-sparse tables: it updates only the rows a gradient touches (and, for Adam,
        only their moments: SparseAdam, TF's LazyAdam)."""
        optimizer, kwargs = self._sparse("the row-sparse tables")
        return optimizer(tables, **kwargs)

    def check_sparse(self, variable: str) -> None:
        """Raise ValueError, naming `variable`, if this optimizer cannot apply row-sparse gradients."""
        self._sparse(repr(variable))

    def _sparse(self, variable: str) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
        kwargs = self._kwargs()
        allowed = _SPARSE.get(self.name)
        blocking = (
            {k: v for k, v in kwargs.items() if k not in allowed[1] and v != _SPARSE_NEUTRAL.get(k)}
            if allowed is not None
            else {}
        )
        if allowed is None or blocking:
            why = f"{self.name}" + (f" with {', '.join(f'{k}={v}' for k, v in blocking.items())}" if blocking else "")
            raise ValueError(
                f"variable {variable} is row-sparse (nn.Embedding or nn.EmbeddingBag with sparse=True), but {why} "
                "cannot apply sparse gradients: use SGD without momentum, Adagrad or Adam (applied lazily, as "
                "SparseAdam), all without weight_decay; or make the embedding dense (sparse=False)"
            )
        return allowed[0], {k: v for k, v in kwargs.items() if k in allowed[1]}

    def _kwargs(self) -> dict[str, Any]:
        return {k: tuple(v) if isinstance(v, list) else v for k, v in self.kwargs.items()}

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
