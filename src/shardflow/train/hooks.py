"""Custom per-step logic on the workers, like TF's SessionRunHook: begin, after each step, end."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass
class StepInfo:
    """What a hook sees after a worker's step."""

    role: str
    worker_index: int
    local_step: int
    global_step: int
    loss: float
    stop_requested: bool = False

    def request_stop(self) -> None:
        """Stop this worker after the current step (the others go on, as in TF)."""
        self.stop_requested = True


class Hook:
    """Override what you need; every method is optional. Hooks run in the worker processes."""

    def begin(self, role: str) -> None:
        """Before the worker's first step."""

    def after_step(self, info: StepInfo) -> None:
        """After each step, with its loss and the global step the PS answered."""

    def end(self, info: StepInfo) -> None:
        """After the worker's last step."""


class StepHooks:
    """Runs a worker's hooks; cheap when there are none."""

    def __init__(self, hooks: Sequence[Hook], role: str, worker_index: int) -> None:
        self.hooks = list(hooks)
        self.role = role
        self.worker_index = worker_index
        for hook in self.hooks:
            hook.begin(role)

    def after_step(self, local_step: int, global_step: int, loss: float) -> bool:
        """Whether a hook asked this worker to stop."""
        if not self.hooks:
            return False
        info = StepInfo(self.role, self.worker_index, local_step, global_step, loss)
        for hook in self.hooks:
            hook.after_step(info)
        return info.stop_requested

    def end(self, local_step: int, global_step: int) -> None:
        info = StepInfo(self.role, self.worker_index, local_step, global_step, float("nan"))
        for hook in self.hooks:
            hook.end(info)
