"""Learning-rate schedules the PS apply by global step: a `torch.optim.lr_scheduler` class name and its arguments,
evaluated in closed form, so every PS sets the same learning rate before the update of each global step and a
restored job goes on at its step without replaying the ones before it.

A schedule may also be a function of the step: a plain function (the learning rate itself) or `LambdaLR` with its
`lr_lambda` (a factor of the optimizer's lr). The PS cannot run the user's code (nothing is unpickled), so each
worker, which runs the same script, evaluates it at the global step its gradient was computed on and sends the
learning rate with its push; in sync mode that is the step the update makes, exactly as in one process."""

from __future__ import annotations

import bisect
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import torch

_Form = Callable[[int, float, dict[str, Any]], float]
"""(global step, the optimizer's lr, the scheduler's arguments) -> the learning rate of that step's update."""


def _step(t: int, lr: float, a: dict[str, Any]) -> float:
    return lr * float(a.get("gamma", 0.1)) ** (t // int(a["step_size"]))


def _multi_step(t: int, lr: float, a: dict[str, Any]) -> float:
    return lr * float(a.get("gamma", 0.1)) ** bisect.bisect_right(sorted(a["milestones"]), t)


def _exponential(t: int, lr: float, a: dict[str, Any]) -> float:
    return lr * float(a["gamma"]) ** t


def _cosine(t: int, lr: float, a: dict[str, Any]) -> float:
    eta_min = float(a.get("eta_min", 0.0))
    return eta_min + (lr - eta_min) * (1 + math.cos(math.pi * t / a["T_max"])) / 2


def _linear(t: int, lr: float, a: dict[str, Any]) -> float:
    start, end = float(a.get("start_factor", 1 / 3)), float(a.get("end_factor", 1.0))
    total = int(a.get("total_iters", 5))
    return lr * (start + (end - start) * min(t, total) / total)


def _constant(t: int, lr: float, a: dict[str, Any]) -> float:
    return lr * (float(a.get("factor", 1 / 3)) if t < int(a.get("total_iters", 5)) else 1.0)


def _polynomial(t: int, lr: float, a: dict[str, Any]) -> float:
    total = int(a.get("total_iters", 5))
    return lr * float((1 - min(t, total) / total) ** float(a.get("power", 1.0)))


def _one_cycle(t: int, lr: float, a: dict[str, Any]) -> float:
    # Ignores the optimizer's lr, as torch's OneCycleLR does: it starts at max_lr / div_factor.
    max_lr = float(a["max_lr"])
    initial = max_lr / a.get("div_factor", 25.0)
    final = initial / a.get("final_div_factor", 1e4)
    total = _one_cycle_total(a)
    up_end = a.get("pct_start", 0.3) * total - 1
    if a.get("three_phase", False):
        phases = [(up_end, initial, max_lr), (2 * a.get("pct_start", 0.3) * total - 2, max_lr, initial)]
        phases.append((total - 1, initial, final))
    else:
        phases = [(up_end, initial, max_lr), (total - 1, max_lr, final)]
    anneal = _anneal_cos if a.get("anneal_strategy", "cos") == "cos" else _anneal_linear
    start_step = 0.0
    for i, (end_step, begin, end) in enumerate(phases):
        if t <= end_step or i == len(phases) - 1:
            return anneal(begin, end, (t - start_step) / (end_step - start_step))
        start_step = end_step
    raise AssertionError("unreachable")


def _one_cycle_total(a: dict[str, Any]) -> int:
    total = a.get("total_steps")
    return int(total) if total is not None else int(a["epochs"]) * int(a["steps_per_epoch"])


def _anneal_cos(start: float, end: float, pct: float) -> float:
    return end + (start - end) / 2 * (math.cos(math.pi * pct) + 1)


def _anneal_linear(start: float, end: float, pct: float) -> float:
    return (end - start) * pct + start


# Each scheduler's closed form and the arguments it needs; torch's own defaults fill the rest.
_SCHEDULES: dict[str, tuple[_Form, tuple[str, ...]]] = {
    "StepLR": (_step, ("step_size",)),
    "MultiStepLR": (_multi_step, ("milestones",)),
    "ExponentialLR": (_exponential, ("gamma",)),
    "CosineAnnealingLR": (_cosine, ("T_max",)),
    "LinearLR": (_linear, ()),
    "ConstantLR": (_constant, ()),
    "PolynomialLR": (_polynomial, ()),
    "OneCycleLR": (_one_cycle, ("max_lr",)),
}
_SUPPORTED = ", ".join(_SCHEDULES)
_FUNCTIONS = ("function", "LambdaLR")
"""A function of the step giving the learning rate, or (LambdaLR) a factor of the optimizer's."""


@dataclass(frozen=True)
class ScheduleSpec:
    """A `torch.optim.lr_scheduler` class name and its keyword arguments; serializable, never pickled."""

    name: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    fn: Callable[[int], float] | None = field(default=None, compare=False, repr=False)
    """A function schedule's function, in the processes that run the user's script (never sent)."""

    @property
    def from_workers(self) -> bool:
        """Whether the learning rate of each update comes with its push (a function of the step)."""
        return self.name in _FUNCTIONS

    def __post_init__(self) -> None:
        if self.name in _FUNCTIONS:
            if self.kwargs:
                raise ValueError(f"a {self.name} schedule takes no arguments besides its function")
            return
        if self.name not in _SCHEDULES:
            raise ValueError(f"unsupported learning-rate schedule {self.name!r}; choose one of {_SUPPORTED}")
        for key, value in self.kwargs.items():
            values = value if isinstance(value, (list, tuple)) else [value]
            if key == "last_epoch" or not all(isinstance(v, (int, float, bool, str)) for v in values):
                raise ValueError(f"learning-rate schedule argument {key}={value!r} must be a number, bool or list")
        missing = [k for k in _SCHEDULES[self.name][1] if k not in self.kwargs]
        if missing:
            raise ValueError(f"{self.name} needs {', '.join(missing)}")
        if self.name == "OneCycleLR":
            if self.kwargs.get("cycle_momentum", True):
                raise ValueError(
                    "OneCycleLR on the PS schedules the learning rate only: pass cycle_momentum=False (the PS keep "
                    "the optimizer's momentum or betas as given)"
                )
            if isinstance(self.kwargs["max_lr"], (list, tuple)) or (
                self.kwargs.get("total_steps") is None and "epochs" not in self.kwargs
            ):
                raise ValueError("OneCycleLR needs one max_lr and total_steps (or epochs and steps_per_epoch)")

    def lr(self, global_step: int, base_lr: float) -> float:
        """The learning rate of the update that makes global step `global_step + 1`, as torch's scheduler gives
        after `global_step` calls of `scheduler.step()` in one process."""
        if self.name in _FUNCTIONS:
            if self.fn is None:
                raise RuntimeError(f"a {self.name} schedule is evaluated by the workers; its lr comes with each push")
            value = float(self.fn(global_step))
            return value if self.name == "function" else base_lr * value
        return _SCHEDULES[self.name][0](global_step, base_lr, self.kwargs)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "kwargs": self.kwargs}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ScheduleSpec:
        if set(d) != {"name", "kwargs"} or not isinstance(d["kwargs"], dict):
            raise ValueError(f"a schedule is {{'name': str, 'kwargs': dict}}, got {d!r}")
        return cls(d["name"], dict(d["kwargs"]))


ScheduleLike = ScheduleSpec | Callable[..., torch.optim.lr_scheduler.LRScheduler] | Callable[[int], float]
"""What Estimator takes as its lr_schedule: a spec, a torch.optim.lr_scheduler class or functools.partial of one
(LambdaLR with lr_lambda too), or a function of the global step giving the learning rate."""


def as_schedule(schedule: ScheduleLike) -> ScheduleSpec:
    """`schedule` (a ScheduleSpec, a torch.optim.lr_scheduler class, or functools.partial of one with keyword
    arguments) as the spec the PS evaluate; anything else raises ValueError saying what is supported."""
    if isinstance(schedule, ScheduleSpec):
        return schedule
    cls, kwargs = schedule, {}
    if isinstance(schedule, functools.partial):
        if schedule.args:
            raise ValueError(
                f"pass the learning-rate schedule's arguments by keyword, e.g. functools.partial({_name(schedule.func)}"
                ", step_size=10); positional ones are taken by the optimizer the PS build"
            )
        cls, kwargs = schedule.func, dict(schedule.keywords)
    if isinstance(cls, type) and issubclass(cls, torch.optim.lr_scheduler.LRScheduler) and cls.__name__ in _SCHEDULES:
        return ScheduleSpec(cls.__name__, {k: list(v) if isinstance(v, tuple) else v for k, v in kwargs.items()})
    if cls is torch.optim.lr_scheduler.LambdaLR and set(kwargs) == {"lr_lambda"} and callable(kwargs["lr_lambda"]):
        return ScheduleSpec("LambdaLR", fn=kwargs["lr_lambda"])
    if callable(schedule) and not isinstance(schedule, (type, functools.partial, torch.optim.lr_scheduler.LRScheduler)):
        return ScheduleSpec("function", fn=cast(Callable[[int], float], schedule))
    if isinstance(schedule, torch.optim.lr_scheduler.LRScheduler):
        why = "a scheduler bound to an optimizer cannot be sent to the PS; pass its class with its arguments"
    elif cls is torch.optim.lr_scheduler.LambdaLR:
        why = "LambdaLR takes one lr_lambda function, by keyword: functools.partial(LambdaLR, lr_lambda=f)"
    elif cls is torch.optim.lr_scheduler.MultiplicativeLR:
        why = (
            "MultiplicativeLR multiplies every factor since the start, which a restored job cannot replay; pass "
            "the learning rate as a function of the step instead"
        )
    else:
        why = "it is not a learning-rate scheduler"
    raise ValueError(
        f"unsupported lr_schedule {_name(schedule)}: {why}. Supported: torch.optim.lr_scheduler.{{{_SUPPORTED}}}, "
        "as the class or functools.partial(cls, **kwargs); LambdaLR with lr_lambda; or a function of the step"
    )


def _name(thing: object) -> str:
    return getattr(thing, "__name__", type(thing).__name__)
