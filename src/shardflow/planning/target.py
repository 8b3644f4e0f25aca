"""A training target such as 'accuracy>=0.95', and the first evaluation that meets it."""

from __future__ import annotations

import operator
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

_COMPARE: dict[str, Callable[[float, float], bool]] = {
    ">=": operator.ge,
    "<=": operator.le,
    ">": operator.gt,
    "<": operator.lt,
}
_GRAMMAR = re.compile(r"^\s*([A-Za-z_][\w./-]*)\s*(>=|<=|>|<)\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*$")


class TargetError(ValueError):
    """A --target that cannot be read, or that names a metric the run does not evaluate."""


@dataclass(frozen=True)
class Target:
    metric: str
    comparison: str
    """One of >=, <=, >, <."""
    value: float

    def __str__(self) -> str:
        return f"{self.metric}{self.comparison}{self.value:g}"

    def met(self, metrics: Mapping[str, float]) -> bool:
        return self.metric in metrics and _COMPARE[self.comparison](metrics[self.metric], self.value)


def parse_target(text: str) -> Target:
    match = _GRAMMAR.match(text)
    if match is None:
        raise TargetError(
            f"--target: cannot read {text!r}; write METRIC>=VALUE, METRIC<=VALUE, METRIC>VALUE or METRIC<VALUE, "
            "e.g. --target 'accuracy>=0.95' (in quotes, or the shell reads > as a redirection)"
        )
    return Target(match.group(1), match.group(2), float(match.group(3)))


@dataclass(frozen=True)
class Reached:
    global_step: int
    elapsed_s: float
    """Seconds since training started, as the chief's evaluation recorded it."""
    metrics: dict[str, float]


def first_reached(target: Target, eval_history: Sequence[Mapping[str, Any]]) -> Reached | None:
    """The first evaluation that meets the target, or None; a metric that was never evaluated is an error."""
    evaluated = {name for entry in eval_history for name in entry["metrics"]}
    if eval_history and target.metric not in evaluated:
        raise TargetError(
            f"--target names {target.metric!r}, but the script evaluates only {', '.join(sorted(evaluated))}; "
            f"e.g. --target '{sorted(evaluated)[0]}{target.comparison}{target.value:g}', "
            "or add the metric to EvalSpec(metrics=...)"
        )
    for entry in eval_history:
        if target.met(entry["metrics"]):
            return Reached(int(entry["global_step"]), float(entry["elapsed_s"]), dict(entry["metrics"]))
    return None
