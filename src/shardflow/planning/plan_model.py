"""An analytic model of one training step: compute, the links of workers and PS, PS apply, CPU cores, all-reduce."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal

Mode = Literal["async", "sync"]
# In this order ties go to the first: a PS is named the bottleneck only when it is strictly the slowest part.
TERMS = ("compute", "worker link", "CPU cores", "PS link", "PS apply")
# CPU seconds per byte of a step's working set (the parameters and gradients a role touches each step) that a role
# spends reloading its caches per extra runnable role per core: fitted on the 2-core machine of BENCHMARKS.md's
# plan_validation (the MLP's worker and PS CPU per step grow 27% from 3 to 5 roles); it is reading each byte once
# from memory at 5 GB/s.
REFILL_S_PER_BYTE = 0.2e-9


@dataclass(frozen=True, kw_only=True)
class RingCost:
    """What gloo's ring all-reduce cost a profiled all-reduce run on its machine (planning/calibrate_allreduce.py):
    all-reduce and hybrid are predicted from it rather than from a PS run's links and apply."""

    bandwidth: float
    """Ring bytes (2(n-1)/n of the gradients) a worker moved per second of its all-reduce: the wall time of its
    `allreduce` spans less the copies into the buckets, the waits for the other workers included."""
    cpu_per_byte: float | None = None
    """CPU seconds a worker spent per ring byte, every thread (gloo's included); None if the run sampled no CPU."""
    apply_s: float
    """A worker's optimizer step on the whole model."""
    copy_s: float = 0.0
    """The copies of the whole model's gradients into the buckets, each step."""
    own_cpu_s: float | None = None
    """CPU seconds of a worker per step outside the ring (compute, apply, the copies, Python)."""
    calibrated_workers: int
    """Workers of the run it was measured on."""

    def __post_init__(self) -> None:
        if not self.bandwidth > 0:
            raise ValueError(f"RingCost.bandwidth must be positive, got {self.bandwidth}")
        if self.calibrated_workers < 2:
            raise ValueError(
                f"RingCost needs a run of at least 2 workers (1 all-reduces nothing), got {self.calibrated_workers}"
            )


@dataclass(frozen=True, kw_only=True)
class HybridCost:
    """What a profiled sf.HybridStrategy run measured per global step (planning/calibrate_hybrid.py): each worker
    pushes its rows to the PS and waits for them to be taken, then all-reduces the dense gradients."""

    own_s: float
    """A worker step outside the all-reduce and the wait for the PS: compute, its lookups, the apply, Python."""
    push_wait_s: float
    """A worker's push of its rows and the wait for every PS to take them."""
    allreduce_s: float
    """The dense all-reduce of a step, the copies into the buckets included."""
    copy_s: float = 0.0
    """Of allreduce_s, the copies into the buckets, which do not grow with the ring."""
    worker_cpu_s: float | None = None
    """CPU seconds of a worker per step, every thread; None if the run sampled no CPU."""
    ring_cpu_per_byte: float = 0.0
    """CPU seconds a worker spends per ring byte beyond the rest of its step (0 where the run could not tell)."""
    calibrated_workers: int
    calibrated_ps: int = 1
    """Workers and PS of the run it was measured on."""

    def __post_init__(self) -> None:
        for name in ("own_s", "push_wait_s", "allreduce_s", "copy_s", "ring_cpu_per_byte"):
            if getattr(self, name) < 0:
                raise ValueError(f"HybridCost.{name} must be >= 0, got {getattr(self, name)}")
        for name in ("calibrated_workers", "calibrated_ps"):
            if getattr(self, name) < 1:
                raise ValueError(f"HybridCost.{name} must be at least 1, got {getattr(self, name)}")


@dataclass(frozen=True, kw_only=True)
class PlanConfig:
    """A cluster and a model, in the model's terms."""

    num_params: float
    """Parameters of the model; every step pushes all their gradients and pulls all their values."""
    bytes_per_param: float = 4.0
    """Bytes per parameter on the wire (4 for float32)."""
    num_workers: int
    """Workers, each computing one step at a time."""
    num_ps: int
    """Parameter servers; the model is split evenly across them."""
    bandwidth: float
    """Bytes per second of every machine's link, in each direction."""
    step_compute_s: float
    """Forward and backward of one worker step, in seconds."""
    mode: Mode = "async"
    """async: every worker update is a global step; sync: one aggregated update of all workers is."""
    ps_apply_s: float = 0.0
    """Seconds one PS needs to apply an update of the whole model (split over the PS); 0 leaves it out."""
    cores: float | None = None
    """A local run: every role shares this many CPU cores (fewer if other programs use some), and moving bytes is
    CPU work on both ends."""
    step_compute_cpu_s: float | None = None
    """With cores: the CPU time of a worker step's forward and backward (planning/calibrate.py), which step_compute_s
    measured in wall time under the contention of its own run; the compute is then timed for the predicted run's
    contention instead (compute_s). None: step_compute_s, whatever the run."""
    worker_cpu_s: float | None = None
    """With cores: measured CPU seconds of a worker per step, all its threads (planning/calibrate.py); None estimates
    it as compute plus the copies of its bytes."""
    ps_cpu_s: float | None = None
    """With cores: measured CPU seconds the PS spend together per worker step, all their threads; None estimates it
    as the apply plus the copies."""
    other_cores: float = 0.0
    """With cores: cores kept busy by roles whose work does not grow with the workers (the chief)."""
    contending_roles: float = 0.0
    """With cores: other programs' demand on the cores, in busy roles. The scheduler shares the cores by runnable
    threads, so the job's roles (workers and PS) get cores x roles / (roles + contending_roles): more workers take
    more of a shared machine. 0: the job has all `cores`."""
    sparse_params: float = 0.0
    """Of num_params, the sf.nn table rows a worker step touches: through the PS under hybrid (planning/strategies)."""
    table_params: float = 0.0
    """The sf.nn tables in full, which all-reduce has to sum in every step (a dense table in every worker); below
    sparse_params it counts as sparse_params."""

    ring: RingCost | None = None
    """Measured on an all-reduce run: all-reduce and hybrid take the ring's cost from it, not from `bandwidth`,
    `ps_apply_s` and `worker_cpu_s`."""
    hybrid: HybridCost | None = None
    """Measured on a hybrid run: hybrid is predicted from it (its step, wait for the PS and ring), not from the rest."""
    calibrated_on: str | None = None
    """The strategy of the profiled run the other inputs were measured on ('ps', 'allreduce' or 'hybrid'); None:
    given."""
    calibrated_roles: int | None = None
    """With cores: the busy roles (workers and PS) of the run the CPU per step was measured on. Roles taking turns
    on fewer cores pay CPU to reload their caches (switch_cpu_s), so the CPU per step measured with as many roles
    holds only for that many; None: it holds for any count."""
    refill_s_per_byte: float = REFILL_S_PER_BYTE
    """With cores: the CPU a role pays per byte of its step's working set for each role beyond a core's share
    (switch_cpu_s)."""

    def __post_init__(self) -> None:
        for name in ("num_params", "bytes_per_param", "bandwidth", "step_compute_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"PlanConfig.{name} must be positive, got {getattr(self, name)}")
        for name in ("num_workers", "num_ps", "calibrated_roles"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"PlanConfig.{name} must be at least 1, got {getattr(self, name)}")
        if self.mode not in ("async", "sync"):
            raise ValueError(f"PlanConfig.mode must be 'async' or 'sync', got {self.mode!r}")
        if self.cores is not None and not self.cores > 0:
            raise ValueError(f"PlanConfig.cores must be positive, got {self.cores}")
        optional = ("step_compute_cpu_s", "worker_cpu_s", "ps_cpu_s")
        for name in ("ps_apply_s", "table_params", "contending_roles", "refill_s_per_byte", *optional):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise ValueError(f"PlanConfig.{name} must be >= 0, got {getattr(self, name)}")
        if not 0 <= self.sparse_params <= self.num_params:
            raise ValueError(f"PlanConfig.sparse_params must be in [0, num_params], got {self.sparse_params}")
        if self.cores is not None and not 0 <= self.other_cores < self.cores:
            raise ValueError(f"PlanConfig.other_cores must be in [0, cores), got {self.other_cores}")

    @property
    def model_bytes(self) -> float:
        return self.num_params * self.bytes_per_param

    @property
    def allreduce_bytes(self) -> float:
        """The gradients all-reduce sums each step: the dense parameters and every sf.nn table in full."""
        tables = max(self.table_params, self.sparse_params)
        return (self.num_params - self.sparse_params + tables) * self.bytes_per_param

    def job_cores(self, num_roles: int) -> float:
        """The cores the job's `num_roles` busy roles get of `cores` beside the other programs, less the chief's."""
        assert self.cores is not None
        share = self.cores * num_roles / (num_roles + self.contending_roles)
        return max(share - self.other_cores, 1e-9)

    def switch_cpu_s(self, num_roles: int, working_bytes: float, calibrated_roles: int | None = None) -> float:
        """The CPU a role spends more per step with `num_roles` busy roles than the calibrating run's roles did
        (negative for fewer), reloading the `working_bytes` it touches each step: when more roles than cores take
        turns, the others have evicted them from the caches since its last step, the more so the more roles per
        core. `calibrated_roles`: those of the run the CPU was measured on, if not this config's run (a ring's or
        a hybrid run's). 0 without cores or the calibrating run's roles."""
        base = self.calibrated_roles if calibrated_roles is None else calibrated_roles
        if self.cores is None or base is None:
            return 0.0
        return (
            self.refill_s_per_byte
            * working_bytes
            * (self.roles_beyond_cores(num_roles) - self.roles_beyond_cores(base))
        )

    def switched_cpu_s(
        self, cpu_s: float, num_roles: int, working_bytes: float, calibrated_roles: int | None = None
    ) -> float:
        """`cpu_s` measured with the calibrating run's roles, with `num_roles` instead (switch_cpu_s); never below 0."""
        return max(0.0, cpu_s + self.switch_cpu_s(num_roles, working_bytes, calibrated_roles))

    def roles_beyond_cores(self, num_roles: int) -> float:
        """Busy roles per core beyond one (0 while each has a core of its own)."""
        assert self.cores is not None
        return max(0.0, num_roles / self.cores - 1.0)

    def waiting_factor(self, num_roles: int) -> float:
        """Wall time over CPU time of a role's own work with `num_roles` busy roles, relative to the calibrating
        run's: its compute took step_compute_s for step_compute_cpu_s of CPU (the rest waiting for a core), and
        that wait grows with the roles beyond the cores. 1 without cores, the compute's CPU or the run's roles."""
        if not self.cores or not self.step_compute_cpu_s or self.calibrated_roles is None:
            return 1.0
        waiting = max(0.0, self.step_compute_s / self.step_compute_cpu_s - 1.0)
        excess = self.roles_beyond_cores(self.calibrated_roles)
        if excess <= 0:
            return 1.0
        return (1.0 + waiting * self.roles_beyond_cores(num_roles) / excess) / (1.0 + waiting)

    def compute_s(self, worker_cpu_s: float, cores_s: float) -> float:
        """Forward and backward of a worker step that uses `worker_cpu_s` of CPU, in a run whose roles' CPU takes the
        shared cores `cores_s` per worker step (the "CPU cores" part). With cores and the compute's CPU time: that
        time while the cores keep up (cores_s <= worker_cpu_s); once they do not, the worker gets worker_cpu_s over
        cores_s of a core, and its compute takes as much longer. Else step_compute_s as measured."""
        if self.cores is None or self.step_compute_cpu_s is None:
            return self.step_compute_s
        return self.step_compute_cpu_s * max(1.0, cores_s / worker_cpu_s if worker_cpu_s > 0 else 1.0)


@dataclass(frozen=True)
class Prediction:
    """Seconds per worker step: each part, the step time with and without overlap, and the bottleneck."""

    config: PlanConfig
    parts: dict[str, float]
    """Time per worker step of each part (TERMS) on its own resource."""
    communication_s: float
    """Push plus pull: 2 · max(M/B, n·M/(k·B))."""
    step_s: float
    """Compute, then communication and apply, one after the other."""
    overlap_step_s: float
    """Compute overlapped with the previous step's communication: the slowest resource."""
    bottleneck: str
    """The part that bounds the overlapped step (one of TERMS)."""

    def global_steps_per_s(self, step_s: float) -> float:
        """async: every worker's update is a global step; sync: one aggregated update per round is."""
        return (self.config.num_workers if self.config.mode == "async" else 1) / step_s


def predict(config: PlanConfig) -> Prediction:
    n, k, model_bytes = config.num_workers, config.num_ps, config.model_bytes
    worker_link = model_bytes / config.bandwidth
    ps_link = n * model_bytes / (k * config.bandwidth)
    communication = 2 * max(worker_link, ps_link)
    updates_per_round = n if config.mode == "async" else 1
    parts = {
        "compute": config.step_compute_s,
        "worker link": 2 * worker_link,
        "CPU cores": 0.0,
        "PS link": 2 * ps_link,
        "PS apply": updates_per_round * config.ps_apply_s / k,
    }
    if config.cores is None:
        # Links, the PS's CPU and the worker's device are separate resources that work at the same time.
        bounds = [(parts[name], name) for name in TERMS]
    else:
        # Loopback: bytes move by memory copies done by the CPUs of sender and receiver, so a worker's copies add
        # to its compute, a PS's copies add to its apply, and all roles compete for the same cores.
        worker_cpu = config.step_compute_s + 4 * worker_link if config.worker_cpu_s is None else config.worker_cpu_s
        # Measured PS CPU is per push received (each worker step), which holds in both modes.
        ps_cpu = updates_per_round * config.ps_apply_s if config.ps_cpu_s is None else n * config.ps_cpu_s
        # Each worker step touches the whole model on its worker, and on the PS together.
        worker_cpu = config.switched_cpu_s(worker_cpu, n + k, model_bytes)
        ps_cpu = n * config.switched_cpu_s(ps_cpu / n, n + k, model_bytes)
        parts["CPU cores"] = (n * worker_cpu + ps_cpu) / config.job_cores(n + k)
        parts["compute"] = config.compute_s(worker_cpu, parts["CPU cores"])
        bounds = [
            (parts["compute"] + parts["worker link"], _larger(parts, "compute", "worker link")),
            (parts["CPU cores"], "CPU cores"),
            (parts["PS link"] + parts["PS apply"], _larger(parts, "PS link", "PS apply")),
        ]
    overlap_step, bottleneck = max(bounds, key=lambda bound: bound[0])  # the first of equals, as TERMS orders them
    ps_busy = max(value for value, name in bounds if name.startswith("PS"))
    step = max(parts["compute"] + communication + config.ps_apply_s / k, ps_busy, parts["CPU cores"])
    return Prediction(config, parts, communication, step, overlap_step, bottleneck)


def num_ps_needed(config: PlanConfig) -> int:
    """The fewest PS with which neither the PS link nor PS apply is the bottleneck."""
    single = predict(replace(config, num_ps=1))
    if not single.bottleneck.startswith("PS"):
        return 1
    # The PS's time falls as 1/k and nothing else depends on k, so the answer is a ceiling (checked around it);
    # with a trillion PS their time vanishes and what is left is the bound of everything else.
    rest = predict(replace(config, num_ps=10**12)).overlap_step_s
    estimate = math.ceil(single.overlap_step_s / rest * (1 - 1e-9))
    for num_ps in range(max(1, estimate - 1), estimate + 2):
        if not predict(replace(config, num_ps=num_ps)).bottleneck.startswith("PS"):
            return num_ps
    raise AssertionError(f"no PS count near {estimate} removes the PS bottleneck for {config}")


def _larger(parts: dict[str, float], first: str, second: str) -> str:
    return first if parts[first] >= parts[second] else second


@dataclass(frozen=True)
class AllReducePrediction:
    communication_s: float
    """Ring all-reduce of the gradients: 2(n-1)/n · M/B."""
    step_s: float
    overlap_step_s: float


def predict_allreduce(config: PlanConfig) -> AllReducePrediction:
    n = config.num_workers
    communication = 2 * (n - 1) / n * config.allreduce_bytes / config.bandwidth
    compute = config.step_compute_s
    if config.cores is not None:
        # Every worker both sends and receives 2(n-1)/n · M with its own CPU.
        compute += communication
        busy = n * compute / config.cores
        return AllReducePrediction(communication, max(compute, busy), max(compute, busy))
    return AllReducePrediction(communication, compute + communication, max(compute, communication))
