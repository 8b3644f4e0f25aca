"""How training is distributed: the parameter-server strategy's configuration."""

from __future__ import annotations

from dataclasses import dataclass, field

from shardflow.ps.apply import MODES
from shardflow.ps.placement import Partitioner


@dataclass(frozen=True, kw_only=True)
class ParameterServerStrategy:
    """Workers compute gradients; `num_ps` parameter servers hold the sharded variables and apply updates."""

    num_ps: int = 1
    """Parameter servers; variables are placed across them greedy-by-size."""
    num_workers: int = 2
    """Workers started by the embedded local cluster; a cluster spec in the environment overrides it."""
    mode: str = "async"
    """async: one global step per worker update; sync: one per aggregated update; ssp: bounded staleness."""
    replicas_to_aggregate: int | None = None
    """sync: gradients averaged per step (None: all workers); fewer than num_workers adds backup workers."""
    max_staleness: int = 2
    """ssp: steps a worker may run ahead of the slowest."""
    partitioner: Partitioner = field(default_factory=Partitioner)
    """How large variables are cut along dim 0 across the PS; row-sparse ones (sparse embeddings) too."""
    evaluator: bool = False
    """The embedded local cluster also starts an evaluator process that follows checkpoints."""
    overlap: bool = True
    """async: compute the next step while the previous push is in flight (one step of extra staleness)."""
    request_timeout_s: float = 60.0
    """Deadline of every request to a PS; on expiry the error names the PS and its address."""
    startup_timeout_s: float = 120.0
    """Deadline for every role to come up and find the others through the chief."""
    heartbeat_timeout_s: float = 60.0
    """The chief fails the job when a worker has not reported for this long."""

    def __post_init__(self) -> None:
        if self.num_ps < 1:
            raise ValueError(f"ParameterServerStrategy.num_ps must be >= 1, got {self.num_ps}")
        if self.num_workers < 1:
            raise ValueError(f"ParameterServerStrategy.num_workers must be >= 1, got {self.num_workers}")
        if self.mode not in MODES:
            raise ValueError(f"ParameterServerStrategy.mode must be one of {MODES}, got {self.mode!r}")
        if self.replicas_to_aggregate is not None and self.replicas_to_aggregate < 1:
            raise ValueError(
                f"ParameterServerStrategy.replicas_to_aggregate must be >= 1, got {self.replicas_to_aggregate}"
            )
        if self.max_staleness < 0:
            raise ValueError(f"ParameterServerStrategy.max_staleness must be >= 0, got {self.max_staleness}")
        for name in ("request_timeout_s", "startup_timeout_s", "heartbeat_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ParameterServerStrategy.{name} must be positive")
