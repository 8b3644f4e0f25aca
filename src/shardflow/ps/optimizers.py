"""Optimizer specs: plain configs sent to the PS, which build the `torch.optim` optimizer on their shards, and
the optimizer that stands in for one on row-sparse tables."""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from shardflow.ps.embeddings.spec import RowOptimizer, TableSpec
from shardflow.ps.schedules import ScheduleSpec

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
    """A `torch.optim` class name and its keyword arguments, with the learning-rate schedule and the gradient
    clipping the PS apply with it; serializable, never pickled."""

    name: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    schedule: ScheduleSpec | None = None
    """Sets the learning rate of every update from the global step (ps/schedules.py)."""
    clip_grad_norm: float | None = None
    """The update's gradient is scaled to at most this global L2 norm, over all variables on all PS."""
    clip_grad_value: float | None = None
    """The update's gradient is clamped to [-clip_grad_value, clip_grad_value]."""

    def __post_init__(self) -> None:
        if self.name not in _OPTIMIZERS:
            raise ValueError(f"unknown optimizer {self.name!r}; choose one of {sorted(_OPTIMIZERS)}")
        for key, value in self.kwargs.items():
            if not isinstance(value, (int, float, bool, tuple, list)):
                raise ValueError(f"optimizer argument {key}={value!r} must be a number, bool or tuple")
        for name in ("clip_grad_norm", "clip_grad_value"):
            value = getattr(self, name)
            if value is not None and not (
                isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < math.inf
            ):
                raise ValueError(f"{name} must be a positive number or None, got {value!r}")

    def build(self, params: list[torch.Tensor]) -> torch.optim.Optimizer:
        return _OPTIMIZERS[self.name](params, **self._kwargs())

    def build_sparse(self, tables: list[torch.Tensor]) -> torch.optim.Optimizer:
        """The optimizer for row-sparse tables: it updates only the rows a gradient touches (and, for Adam,
        only their moments: SparseAdam, TF's LazyAdam)."""
        optimizer, kwargs = self._sparse("the row-sparse tables")
        return optimizer(tables, **kwargs)

    def rows(self, table: TableSpec) -> RowOptimizer:
        """This optimizer as the row optimizer of an `sf.nn` table that names none: SGD, Adagrad and Adam (lazy,
        with per-row steps on a dynamic table, whose rows appear late) as torch's sparse path computes them."""
        kwargs = self._kwargs()
        blocking = {k: v for k, v in kwargs.items() if k in _SPARSE_NEUTRAL and v != _SPARSE_NEUTRAL[k]}
        if self.name not in _SPARSE or blocking:
            why = self.name + (f" with {', '.join(f'{k}={v}' for k, v in blocking.items())}" if blocking else "")
            raise ValueError(
                f"sf.nn table {table.name!r} takes the job's optimizer, {why}, which has no row-wise form: give the "
                "table its own, e.g. optimizer=sf.nn.adagrad(lr=0.05) (sgd, adagrad, rowwise_adagrad, lazy_adam)"
            )
        lr = float(kwargs.get("lr", inspect.signature(_OPTIMIZERS[self.name]).parameters["lr"].default))
        if self.name == "SGD":
            return RowOptimizer(name="sgd", lr=lr)
        if self.name == "Adagrad":
            return RowOptimizer(
                name="adagrad",
                lr=lr,
                eps=float(kwargs.get("eps", 1e-10)),
                initial_accumulator_value=float(kwargs.get("initial_accumulator_value", 0.0)),
                lr_decay=float(kwargs.get("lr_decay", 0.0)),
            )
        beta1, beta2 = kwargs.get("betas", (0.9, 0.999))
        return RowOptimizer(
            name="lazy_adam",
            lr=lr,
            beta1=float(beta1),
            beta2=float(beta2),
            eps=float(kwargs.get("eps", 1e-8)),
            per_row_steps=table.dynamic,
        )

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

    def learning_rate(self, global_step: int) -> float:
        """The learning rate of the update applied at `global_step`, for summaries."""
        base_lr = self.kwargs.get("lr", inspect.signature(_OPTIMIZERS[self.name]).parameters["lr"].default)
        return self.lr(global_step, float(base_lr))

    def lr(self, global_step: int, base_lr: float) -> float:
        """The learning rate of the update applied at `global_step` (the optimizer's own without a schedule)."""
        return base_lr if self.schedule is None else self.schedule.lr(global_step, base_lr)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "kwargs": self.kwargs,
            "schedule": self.schedule.to_json() if self.schedule is not None else None,
            "clip_grad_norm": self.clip_grad_norm,
            "clip_grad_value": self.clip_grad_value,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> OptimizerSpec:
        known = {"name", "kwargs", "schedule", "clip_grad_norm", "clip_grad_value"}
        if not set(d) <= known or not isinstance(d.get("kwargs"), dict):
            raise ValueError(f"an optimizer is {{'name', 'kwargs' (a dict), ...}} with keys among {sorted(known)}")
        schedule = d.get("schedule")
        return cls(
            d["name"],
            dict(d["kwargs"]),
            schedule=ScheduleSpec.from_json(schedule) if schedule is not None else None,
            clip_grad_norm=d.get("clip_grad_norm"),
            clip_grad_value=d.get("clip_grad_value"),
        )


_SUPPORTED = ", ".join(_OPTIMIZERS)

OptimizerLike = OptimizerSpec | Callable[..., torch.optim.Optimizer]
"""What Estimator takes as its optimizer: a spec, a torch.optim class, or functools.partial of one."""


def as_optimizer_spec(optimizer: OptimizerLike) -> OptimizerSpec:
    """`optimizer` as the spec the PS build from: an OptimizerSpec (`sf.optim.Adam(...)`), a torch.optim class
    the PS can apply, or functools.partial of one with keyword arguments (`partial(torch.optim.Adam, lr=1e-3)`).
    Anything else raises ValueError saying what is supported."""
    if isinstance(optimizer, OptimizerSpec):
        return optimizer
    cls, kwargs = optimizer, {}
    if isinstance(optimizer, functools.partial):
        if optimizer.args:
            raise ValueError(
                "pass the optimizer's arguments by keyword, e.g. functools.partial(torch.optim.Adam, lr=1e-3); the "
                "parameters are the PS's own"
            )
        cls, kwargs = optimizer.func, dict(optimizer.keywords)
    if isinstance(cls, type) and cls in _OPTIMIZERS.values():
        return OptimizerSpec(cls.__name__, {k: list(v) if isinstance(v, tuple) else v for k, v in kwargs.items()})
    if isinstance(optimizer, torch.optim.Optimizer):
        why = (
            f"a {type(optimizer).__name__} instance is bound to this process's parameters, and the PS apply the "
            f"optimizer to their own shards; pass the class with its arguments: "
            f"functools.partial(torch.optim.{type(optimizer).__name__}, lr=...)"
        )
    elif isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer):
        why = (
            f"{cls.__name__} is not applied element by element (or not yet supported): the PS apply the optimizer to "
            "each shard on its own, which is exact only for element-wise optimizers"
        )
    else:
        why = "it is not a torch.optim optimizer"
    name = getattr(optimizer, "__name__", type(optimizer).__name__)
    raise ValueError(
        f"unsupported optimizer {name}: {why}. Supported: sf.optim.{{{_SUPPORTED}}}(...), or torch.optim."
        f"{{{_SUPPORTED}}} as the class or functools.partial(cls, **kwargs)"
    )


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
