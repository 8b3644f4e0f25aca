"""How pushed gradients become updates: the async, sync and ssp modes and the global step they count."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MODES = ("async", "sync", "ssp")


@dataclass(frozen=True, kw_only=True)
class ApplyConfig:
    """The update rule every PS follows; sent by the chief when it initialises the PS."""

    mode: str = "async"
    """async: apply each worker's update on arrival; sync: average `replicas_to_aggregate` updates of
    one version and apply them once; ssp: async, with a worker held back while it is more than
    `max_staleness` steps ahead of the slowest."""
    num_workers: int = 1
    """Workers in the job; a finished worker no longer counts toward aggregation or staleness."""
    replicas_to_aggregate: int | None = None
    """sync only: gradients averaged into one step; None means all workers. Fewer than
    num_workers makes the rest backup workers, whose late gradients are dropped and counted."""
    max_staleness: int = 2
    """ssp only: how many steps a worker may run ahead of the slowest active worker."""
    max_steps: int | None = None
    """Global step at which every PS stops applying updates; later pushes are dropped and counted."""
    snapshot_every_n_steps: int | None = None
    """Every PS snapshots its state when the global step is a multiple of this, for exact checkpoints."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {self.num_workers}")
        if self.replicas_to_aggregate is not None and not 1 <= self.replicas_to_aggregate <= self.num_workers:
            raise ValueError(
                f"replicas_to_aggregate must be between 1 and num_workers={self.num_workers}, "
                f"got {self.replicas_to_aggregate}"
            )
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {self.max_staleness}")
        if self.max_steps is not None and self.max_steps < 0:
            raise ValueError(f"max_steps must be >= 0, got {self.max_steps}")

    @property
    def replicas(self) -> int:
        return self.replicas_to_aggregate or self.num_workers

    def to_json(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "num_workers": self.num_workers,
            "replicas_to_aggregate": self.replicas_to_aggregate,
            "max_staleness": self.max_staleness,
            "max_steps": self.max_steps,
            "snapshot_every_n_steps": self.snapshot_every_n_steps,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ApplyConfig:
        return cls(**d)
