"""How training is distributed: the parameter-server strategy's configuration, and the all-reduce strategy's."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from shardflow.cluster.liveness import HUNG_TIMEOUT_S
from shardflow.ps.placement import Partitioner
from shardflow.ps.update_rules import UpdateRule
from shardflow.train.precision import check_mixed_precision

LOST_WORKER_POLICIES = ("wait", "continue")


@dataclass(frozen=True, kw_only=True)
class ParameterServerStrategy(UpdateRule):
    """Workers compute gradients; `num_ps` parameter servers hold the sharded variables and apply updates.

    `mode`, `replicas_to_aggregate` and `max_staleness` are the update rule's (ps/update_rules.py UpdateRule)."""

    num_ps: int = 1
    """Parameter servers; variables are placed across them greedy-by-size."""
    num_workers: int = 2
    """Workers started by the embedded local cluster; a cluster spec in the environment overrides it."""
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
    heartbeat_timeout_s: float = 10.0
    """A worker or PS whose heartbeat (one a second, or four per heartbeat_timeout_s where that is shorter, from a
    thread of its own) stops for this long is lost; the chief logs it and training goes on while it is restarted."""
    worker_rejoin_timeout_s: float = 120.0
    """How long a lost worker may take to be restarted and rejoin before the job fails, naming it."""
    lost_worker_policy: str = "wait"
    """sync and ssp, while a worker is lost: "wait" holds the steps it takes part in until it is restarted and
    rejoins (none of its records is skipped); "continue" completes them with the remaining replicas and lets the
    others run ahead of it. Async never waits."""
    hung_timeout_s: float = HUNG_TIMEOUT_S
    """A worker or PS that leaves its liveness file (cluster/liveness.py) untouched for this long, counted from its
    start, is hung: the local launcher kills it to restart it (while it has restarts left), as the liveness probe of
    deploy/'s manifests does on Kubernetes. Keep it above
    heartbeat_timeout_s (a role silent for less comes back by itself) and below request_timeout_s and
    worker_rejoin_timeout_s."""
    max_restarts: int = 3
    """How many times the local launcher (the embedded cluster, `shardflow launch`) restarts each worker or
    evaluator process that dies; on a cluster manager its restart policy does this."""
    restart_backoff_s: float = 1.0
    """Wait before a role's first restart, doubled for each further one (at most 30s)."""
    max_nonfinite_updates: int = 1
    """The job fails once this many steps, over all workers, held NaN or inf in their loss or gradients; such
    steps are never applied and are not global steps."""
    termination_grace_s: float = 30.0
    """SIGTERM: checkpoint at the current step and exit within this many seconds; keep it below the cluster
    manager's termination grace period, 30 s by default on Kubernetes."""
    fail_on_save_error: bool = False
    """A periodic checkpoint that cannot be written (a full or read-only disk): False logs it, keeps training and
    saves again at the next interval; True fails the job. A final checkpoint that cannot be written always fails it."""
    gradient_accumulation_steps: int = 1
    """Each worker step sums the gradients of this many batches (each loss divided by it: their mean) before its
    one push; in sync mode the same as batches this many times larger."""
    mixed_precision: str | None = None
    """"bf16": the workers' forward runs under torch.autocast in bfloat16; parameters on the PS, gradients and
    pushes stay float32. None: float32 throughout."""
    wire_dtype: str | None = None
    """"bf16": the workers push their float dense gradients and pull the float parameters in bfloat16 over the
    socket, half the bytes; the PS keep float32 master weights and optimizer state, and cast the gradients up before
    they apply or sum them. Shared-memory lanes and row-sparse or `sf.nn` rows stay float32. None: float32."""
    device: str | torch.device | None = None
    """Where each worker's model computes: "cpu", "cuda", "cuda:N" or a torch.device; None: "cuda" where the
    worker's process sees one, else "cpu". The PS keep the variables in host memory, and the chief evaluates on
    the CPU."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_ps < 1:
            raise ValueError(f"ParameterServerStrategy.num_ps must be >= 1, got {self.num_ps}")
        if self.num_workers < 1:
            raise ValueError(f"ParameterServerStrategy.num_workers must be >= 1, got {self.num_workers}")
        _check_int(self, "max_nonfinite_updates", 1)
        if self.lost_worker_policy not in LOST_WORKER_POLICIES:
            raise ValueError(
                f"ParameterServerStrategy.lost_worker_policy must be one of {LOST_WORKER_POLICIES}, "
                f"got {self.lost_worker_policy!r}"
            )
        _check_roles(
            self,
            timeouts=(
                "request_timeout_s",
                "startup_timeout_s",
                "heartbeat_timeout_s",
                "worker_rejoin_timeout_s",
                "hung_timeout_s",
            ),
        )
        _check_int(self, "gradient_accumulation_steps", 1)
        check_mixed_precision(self.mixed_precision)
        if self.wire_dtype not in (None, "bf16"):
            raise ValueError(f"ParameterServerStrategy.wire_dtype must be 'bf16' or None, got {self.wire_dtype!r}")
        _parse_device(self.device, type(self).__name__)
        if self.termination_grace_s <= 0:
            raise ValueError(
                f"ParameterServerStrategy.termination_grace_s must be positive, got {self.termination_grace_s}; "
                "keep it below the cluster manager's grace period (Kubernetes: terminationGracePeriodSeconds)"
            )

    def worker_device(self) -> torch.device:
        """The device a worker computes on, resolved in the worker's own process: the chief's and the PS's
        machines may have no GPU. Raises ValueError, naming `device`, for a GPU this process cannot use."""
        return resolve_device(self.device, type(self).__name__)


@dataclass(frozen=True, kw_only=True)
class AllReduceStrategy:
    """Synchronous data parallelism without PS: every worker holds the whole model and its optimizer, and each step
    all-reduces the mean gradient among the workers (torch.distributed, gloo on the CPU) before every worker applies
    it alike. One global step is one all-reduced update. The group forms through the chief's authenticated control
    plane (cluster/dist_store.py); the chief keeps the job's control plane, progress and checkpoints.

    A worker that dies is restarted, and the workers form the group again with it at the global step they are at
    (train/allreduce_group.py); one not back within worker_rejoin_timeout_s fails the job, naming it."""

    mode: ClassVar[str] = "allreduce"

    num_workers: int = 2
    """Workers started by the embedded local cluster; a cluster spec in the environment overrides it."""
    bucket_bytes: int = 25 * 2**20
    """Gradients are all-reduced in buckets of at most this many bytes each (one collective per bucket, all in
    flight at once), as DDP's bucket_cap_mb; a larger gradient is a bucket of its own."""
    request_timeout_s: float = 60.0
    """Deadline of every collective and every wait among the roles: a worker that dies or hangs fails the job
    after at most this long, named by the workers that waited for it."""
    startup_timeout_s: float = 120.0
    """Deadline for every role to come up and the workers' group to form through the chief."""
    heartbeat_timeout_s: float = 30.0
    """The chief fails the job, naming the worker, whose heartbeat (one a second, or four per
    heartbeat_timeout_s where that is shorter) stops for this long."""
    hung_timeout_s: float = HUNG_TIMEOUT_S
    """A role that leaves its liveness file (cluster/liveness.py) untouched for this long is hung: the local
    launcher kills it, which fails the job."""
    termination_grace_s: float = 30.0
    """SIGTERM: checkpoint at the next global step and exit within this many seconds."""
    fail_on_save_error: bool = False
    """A periodic checkpoint that cannot be written: False logs it and trains on; True fails the job."""
    max_restarts: int = 3
    """How many times the local launcher restarts a worker that died; the others wait for it (see
    worker_rejoin_timeout_s) and go on with it at the same global step."""
    restart_backoff_s: float = 1.0
    """The local launcher restarts a dead worker after this long, doubling each time."""
    worker_rejoin_timeout_s: float = 120.0
    """How long the workers wait for a lost one to join the group again (restarted) before they fail the job,
    naming it."""
    mixed_precision: str | None = None
    """"bf16": the workers' forward runs under torch.autocast in bfloat16; parameters, gradients, the all-reduce and
    the optimizer stay float32. None: float32 throughout."""
    gradient_accumulation_steps: int = 1
    """Each worker step sums the gradients of this many batches (each loss divided by it: their mean) before the
    all-reduce: the same as batches this many times larger. HybridStrategy pushes the k batches' table rows to the
    PS at once, one update per global step."""
    evaluator: bool = False
    """The embedded local cluster also starts an evaluator process that follows checkpoints (then the chief does not
    evaluate while training: the evaluator's last evaluation is the job's metrics)."""
    device: str | torch.device | None = None
    """Where each worker's model computes: "cpu", "cuda", "cuda:N" or a torch.device; None: "cuda" where the
    worker's process sees one, else "cpu". "cuda" (or None) puts the workers of a machine on its GPUs in turn, by
    their order among the machine's workers. The gradients are all-reduced by gloo through pinned host buffers
    (allreduce_gradients.py), so several workers may share one GPU; the chief evaluates on the CPU.
    HybridStrategy computes on the CPU."""

    @property
    def num_ps(self) -> int:
        """No parameter servers."""
        return 0

    def worker_device(self, local_index: int = 0) -> torch.device:
        """The device of a worker that is the `local_index`-th of its machine's workers, resolved in its own process:
        "cuda" without an index is the GPU local_index modulo the GPUs it sees. Raises ValueError, naming `device`,
        for a GPU this process cannot use."""
        device = resolve_device(self.device, type(self).__name__)
        if device.type == "cuda" and device.index is None:
            return torch.device("cuda", local_index % torch.cuda.device_count())
        return device

    def __post_init__(self) -> None:
        _check_int(self, "num_workers", 1)
        _check_int(self, "bucket_bytes", 1)
        _check_int(self, "gradient_accumulation_steps", 1)
        check_mixed_precision(self.mixed_precision, type(self).__name__)
        _parse_device(self.device, type(self).__name__)
        _check_roles(
            self,
            timeouts=(
                "request_timeout_s",
                "startup_timeout_s",
                "heartbeat_timeout_s",
                "hung_timeout_s",
                "termination_grace_s",
                "worker_rejoin_timeout_s",
            ),
        )


SPARSE_MODES = ("async", "ssp", "sync")


@dataclass(frozen=True, kw_only=True)
class HybridStrategy(AllReduceStrategy):
    """The model's `sf.nn` tables on `num_ps` parameter servers, every other parameter all-reduced among the workers
    as in `AllReduceStrategy` (whose settings it has too). One global step is one all-reduced dense update; each
    worker pushes the gradients of the table rows its batch looked up with every step, and the PS count the tables'
    updates apart.

    `sparse_mode`: "async" (the default) applies each worker's rows as they come; "sync" applies the rows of one
    global step once, the mean over the workers that had a batch, before any worker looks up the next step's (so the
    job equals one process on the workers' batches together); "ssp" is async with `max_staleness` (the workers step
    in lockstep, so it bounds nothing more than async does)."""

    mode: ClassVar[str] = "hybrid"

    num_ps: int = 1
    """Parameter servers holding the `sf.nn` tables, each a partition of every table's rows."""
    sparse_mode: str = "async"
    max_staleness: int = 2
    """ssp: how many steps a worker's table pushes may run ahead of the slowest worker's."""

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_int(self, "num_ps", 1)
        _check_int(self, "max_staleness", 0)
        if self.sparse_mode not in SPARSE_MODES:
            raise ValueError(f"HybridStrategy.sparse_mode must be one of {SPARSE_MODES}, got {self.sparse_mode!r}")
        device = _parse_device(self.device, "HybridStrategy")
        if device is not None and device.type != "cpu":
            raise ValueError(
                f"HybridStrategy.device={self.device!r}: the hybrid workers compute on the CPU (their table rows come "
                "from the PS in host memory); use device=None or 'cpu', or AllReduceStrategy or "
                "ParameterServerStrategy for a GPU"
            )

    def worker_device(self, local_index: int = 0) -> torch.device:
        """The CPU, always (see `device`)."""
        return torch.device("cpu")


Strategy = ParameterServerStrategy | AllReduceStrategy
"""How a job is distributed (`HybridStrategy` is an `AllReduceStrategy` with tables on PS)."""


def _check_int(strategy: object, name: str, minimum: int) -> None:
    value = getattr(strategy, name)
    if not (isinstance(value, int) and not isinstance(value, bool) and value >= minimum):
        raise ValueError(f"{type(strategy).__name__}.{name} must be an int >= {minimum}, got {value!r}")


def _check_roles(strategy: ParameterServerStrategy | AllReduceStrategy, *, timeouts: tuple[str, ...]) -> None:
    """The settings every strategy has for its roles' restarts, deadlines and saves."""
    owner = type(strategy).__name__
    _check_int(strategy, "max_restarts", 0)
    backoff = strategy.restart_backoff_s
    if not (isinstance(backoff, int | float) and not isinstance(backoff, bool) and backoff >= 0):
        raise ValueError(f"{owner}.restart_backoff_s must be >= 0 seconds, got {backoff!r}")
    for name in timeouts:
        value = getattr(strategy, name)
        if not (isinstance(value, int | float) and not isinstance(value, bool) and value > 0):
            raise ValueError(f"{owner}.{name} must be a positive number of seconds, got {value!r}")
    if not isinstance(strategy.fail_on_save_error, bool):
        raise ValueError(f"{owner}.fail_on_save_error must be True or False, got {strategy.fail_on_save_error!r}")


def resolve_device(device: str | torch.device | None, owner: str) -> torch.device:
    """The device `owner`.device names, resolved in the worker's own process: None is "cuda" where it sees one, else
    "cpu". Raises ValueError, naming the setting, for a GPU this process cannot use."""
    parsed = _parse_device(device, owner)
    if parsed is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"{owner}.device={device!r}, but this process sees no CUDA device "
                "(torch.cuda.is_available() is False): use device='cpu', or None for the GPU where there is one"
            )
        if parsed.index is not None and parsed.index >= torch.cuda.device_count():
            raise ValueError(
                f"{owner}.device={device!r}, but this process sees "
                f"{torch.cuda.device_count()} CUDA device(s), numbered from 0"
            )
    return parsed


def _parse_device(device: str | torch.device | None, owner: str) -> torch.device | None:
    """The device `device` names, checked to be one a worker can compute on; None stays None."""
    if device is None:
        return None
    try:
        parsed = torch.device(device) if isinstance(device, str | torch.device) else None
    except RuntimeError:
        parsed = None
    if parsed is None or parsed.type not in ("cpu", "cuda"):
        raise ValueError(f"{owner}.device must be 'cpu', 'cuda', 'cuda:N' or a torch.device, got {device!r}")
    return parsed
