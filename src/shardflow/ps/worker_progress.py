"""What a PS has of each worker's steps: the last one it took (to apply, to sum, or to refuse as non-finite) and the
worker's input position after it. A restarted worker resumes from these (protocol `Rejoin`), repeating only the steps
some PS missed; ps:0's positions go into checkpoints, and a restore puts them back (protocol `Init`)."""

from __future__ import annotations

from typing import Any


def _name(worker_index: int) -> str:
    return f"worker:{worker_index}"


class WorkerProgress:
    """One PS's record of every worker's steps (see the module)."""

    def __init__(self, steps: dict[str, int] | None = None, iterators: dict[str, Any] | None = None) -> None:
        self.steps: dict[str, int] = dict(steps or {})
        """By "worker:<index>": the last of its steps this PS took."""
        self.iterators: dict[str, Any] = dict(iterators or {})
        """By "worker:<index>": its input position after that step."""

    def last(self, worker_index: int) -> int:
        """The last step of the worker this PS took; 0 for none."""
        return self.steps.get(_name(worker_index), 0)

    def took(self, worker_index: int, local_step: int, input_state: dict[str, Any] | None) -> None:
        """This PS took step `local_step` of the worker: it is not taken again, and the worker resumes after it."""
        self.steps[_name(worker_index)] = local_step
        if input_state is not None:
            self.iterators[_name(worker_index)] = input_state

    def position(self, worker_index: int) -> dict[str, Any] | None:
        """The worker's input position after its last step this PS took; None for none."""
        name = _name(worker_index)
        return self.iterators.get(name) if name in self.steps else None
