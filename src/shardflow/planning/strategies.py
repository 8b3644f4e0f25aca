"""The same calibrated step under the three strategies (PS, ring all-reduce, hybrid) and which one is fastest.

A round is one batch on every worker. The PS strategy is planning/plan_model.py's step; all-reduce sums the dense
gradients in a ring among the workers and every worker applies them itself; hybrid sends the sf.nn table rows through
the PS as the PS strategy does and all-reduces the rest.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from shardflow.planning.plan_model import HybridCost, PlanConfig, RingCost, predict
from shardflow.planning.units import format_bytes

Strategy = Literal["ps", "allreduce", "hybrid"]
STRATEGIES: tuple[Strategy, ...] = ("ps", "allreduce", "hybrid")
NAMES: dict[Strategy, str] = {"ps": "PS", "allreduce": "all-reduce", "hybrid": "hybrid"}


@dataclass(frozen=True)
class StrategyPrediction:
    """One strategy's round: how long it takes, what bounds it and the bytes each link moves."""

    strategy: Strategy
    num_workers: int
    round_s: float
    """Seconds per round with communication overlapped where the strategy can: the slowest resource."""
    bound: str
    """The resource that sets round_s: compute, worker link, PS link, PS apply or CPU cores."""
    link_bytes: dict[str, float]
    """Bytes each way per round on each link that carries any: "worker" (every worker's) and "ps:0" (the busiest PS)."""
    global_steps_per_round: int
    """The async PS makes every worker's update a global step; all-reduce and hybrid make one per round."""
    calibration: str = "given"
    """What the prediction's inputs were measured on: "PS run", "all-reduce run", or "given" (flags)."""

    @property
    def batches_per_s(self) -> float:
        return self.num_workers / self.round_s

    @property
    def global_steps_per_s(self) -> float:
        return self.global_steps_per_round / self.round_s

    @property
    def busiest_link(self) -> str:
        return max(self.link_bytes, key=lambda link: self.link_bytes[link]) if self.link_bytes else "worker"


def ring_bytes(num_workers: int, dense_bytes: float) -> float:
    """Bytes each worker sends (and receives) per ring all-reduce: 2(n-1)/n of the gradients."""
    return 2 * (num_workers - 1) / num_workers * dense_bytes


def ps_link_bytes(config: PlanConfig, table_bytes: float) -> dict[str, float]:
    """Bytes each way per round through the PS: a worker's push (or pull), and the busiest PS's n/k share of them."""
    if table_bytes <= 0:
        return {}
    return {"worker": table_bytes, "ps:0": config.num_workers * table_bytes / config.num_ps}


def predict_strategy(config: PlanConfig, strategy: Strategy) -> StrategyPrediction:
    """The round of `strategy` from the calibration in `config`: a PS run's compute, bandwidth, apply and CPU per
    step, and for all-reduce and hybrid the ring's cost where an all-reduce run measured it (`config.ring`)."""
    if strategy == "ps":
        ps = predict(config)
        steps = config.num_workers if config.mode == "async" else 1
        bytes_each_way = ps_link_bytes(config, config.model_bytes)
        calibration = _CALIBRATIONS[config.calibrated_on]
        return StrategyPrediction(
            "ps", config.num_workers, ps.overlap_step_s, ps.bottleneck, bytes_each_way, steps, calibration
        )
    if strategy == "hybrid":
        table_bytes = config.sparse_params * config.bytes_per_param
        if config.hybrid is not None:
            return _measured_hybrid(config, config.hybrid, config.model_bytes - table_bytes, table_bytes)
        return _synchronous(config, strategy, config.model_bytes - table_bytes, table_bytes)
    return _synchronous(config, strategy, config.allreduce_bytes, 0.0)


_CALIBRATIONS = {"ps": "PS run", "allreduce": "all-reduce run", "hybrid": "hybrid run", None: "given"}


def _synchronous(config: PlanConfig, strategy: Strategy, dense_bytes: float, table_bytes: float) -> StrategyPrediction:
    """All-reduce (no table bytes) or hybrid: the dense part all-reduced and applied by every worker, rows by the PS."""
    n, k, bandwidth, cost = config.num_workers, config.num_ps, config.bandwidth, config.ring
    ring = ring_bytes(n, dense_bytes)
    links = ps_link_bytes(config, table_bytes)
    # The ring sends and receives at once; a PS push and its pull follow each other (as in plan_model).
    worker_link = ring / (cost.bandwidth if cost else bandwidth) + 2 * links.get("worker", 0.0) / bandwidth
    # An all-reduce run measured the optimizer and the copies into the buckets. The rest of its step period is left
    # out: on a shared machine it is mostly what other programs took, which the CPU cores' bound accounts for.
    dense_apply = ((cost.apply_s + cost.copy_s) if cost else config.ps_apply_s) * dense_bytes / config.model_bytes
    times = {
        "compute": config.step_compute_s + dense_apply,
        "worker link": worker_link + dense_apply,
        "PS link": 2 * links.get("ps:0", 0.0) / bandwidth,
        "PS apply": n * config.ps_apply_s * table_bytes / config.model_bytes / k,
    }
    if config.cores is not None:
        roles = n + (k if table_bytes > 0 else 0)
        worker_cpu = _worker_cpu_s(config, ring, links.get("worker", 0.0), dense_apply)
        # A measured ring's worker CPU is of its all-reduce run, with one role a worker.
        measured_on = cost.calibrated_workers if cost is not None and cost.own_cpu_s is not None else None
        worker_cpu = config.switched_cpu_s(worker_cpu, roles, dense_bytes + table_bytes, measured_on)
        ps_cpu = config.switched_cpu_s(_ps_cpu_s(config, table_bytes), roles, table_bytes) if table_bytes > 0 else 0.0
        times["CPU cores"] = n * (worker_cpu + ps_cpu) / config.job_cores(roles)
        times["compute"] = config.compute_s(worker_cpu, times["CPU cores"]) + dense_apply
    if config.cores is not None or cost is not None:
        # On loopback the bytes move by the CPU: a worker's own copies come after its compute. A measured ring is
        # sf.AllReduceStrategy's, which all-reduces once backward is done: its time adds to the step's too.
        times["compute"] += worker_link
    bound = max(times, key=lambda name: times[name])
    all_links = {"worker": ring + links.get("worker", 0.0)} | ({"ps:0": links["ps:0"]} if "ps:0" in links else {})
    if all_links["worker"] <= 0:
        all_links = {}
    calibration = "all-reduce run" if cost else _CALIBRATIONS[config.calibrated_on]
    return StrategyPrediction(strategy, n, times[bound], bound, all_links, 1, calibration)


def _measured_hybrid(
    config: PlanConfig, cost: HybridCost, dense_bytes: float, table_bytes: float
) -> StrategyPrediction:
    """Hybrid from a hybrid run: a worker's step is its own part, then the push of its rows and the wait for the PS
    to take every worker's rows of the round, then the ring; with shared cores, at least every role's CPU."""
    n, k = config.num_workers, config.num_ps
    n0, k0 = cost.calibrated_workers, cost.calibrated_ps
    ring, ring0 = ring_bytes(n, dense_bytes), ring_bytes(n0, dense_bytes)
    if ring0 > 0:
        ring_s = cost.copy_s + (cost.allreduce_s - cost.copy_s) * ring / ring0
    else:  # a run of 1 worker moved nothing in its ring: the links stand in
        ring_s = cost.allreduce_s + ring / (config.ring.bandwidth if config.ring else config.bandwidth)
    # The busiest PS takes n/k pushes a round one after another; the run waited for n0/k0 of them.
    # The hybrid run's own part held its waits for a core, which more or fewer roles lengthen or shorten (its
    # compute's wall and CPU time tell how long, where this config was calibrated on that run).
    waiting = config.waiting_factor(n + k) if config.calibrated_on == "hybrid" else 1.0
    times = {"compute": cost.own_s * waiting, "worker link": ring_s, "PS apply": cost.push_wait_s * (n / k) / (n0 / k0)}
    round_s, bound = sum(times.values()), max(times, key=lambda name: times[name])
    if config.cores is not None and cost.worker_cpu_s is not None:
        worker_cpu = cost.worker_cpu_s + _ring_cpu_growth(config, cost, ring, ring0)
        worker_cpu = config.switched_cpu_s(worker_cpu, n + k, dense_bytes + table_bytes, n0 + k0)
        # On loopback the PS's wait is its CPU work on the n0 pushes of the round it measured.
        ps_cpu = config.switched_cpu_s(cost.push_wait_s / n0, n + k, table_bytes, n0 + k0)
        cpu_s = n * (worker_cpu + ps_cpu) / config.job_cores(n + k)
        if cpu_s > round_s:
            round_s, bound = cpu_s, "CPU cores"
    links = ps_link_bytes(config, table_bytes) | {"worker": ring + table_bytes}
    links = {name: value for name, value in links.items() if value > 0}
    return StrategyPrediction("hybrid", n, round_s, bound, links, 1, "hybrid run")


def _ring_cpu_growth(config: PlanConfig, cost: HybridCost, ring: float, ring0: float) -> float:
    """A hybrid worker's ring CPU per step at `ring` bytes beyond the run's at `ring0`. The run's ring CPU (its CPU
    per ring byte times ring0) is its bytes, copied at the run's bandwidth, and a cost per message for the rest:
    gloo's ring sends 2(n-1) of them per all-reduce, so a small dense part's ring costs by its messages."""
    n, n0 = config.num_workers, cost.calibrated_workers
    spent = cost.ring_cpu_per_byte * ring0
    bytes_s = min(spent, 2 * ring0 / config.bandwidth)  # sent and received, each a copy
    per_message = (spent - bytes_s) / (2 * (n0 - 1)) if n0 > 1 else 0.0
    return per_message * 2 * (n - n0) + (bytes_s / ring0 if ring0 > 0 else 0.0) * (ring - ring0)


def _worker_cpu_s(config: PlanConfig, ring: float, table_bytes: float, dense_apply: float) -> float:
    """A worker's CPU per step: what it used under the PS less the copies of the model (compute and its own overhead:
    Python, input, hooks), two copies of every byte it now sends or receives, and the apply. Where an all-reduce run
    measured the ring: its CPU outside the all-reduce, and the ring's CPU per byte."""
    cost = config.ring
    if cost is not None and cost.own_cpu_s is not None and cost.cpu_per_byte is not None:
        return _ring_cpu_s(cost, ring, dense_apply) + 2 * 2 * table_bytes / config.bandwidth
    copies = 4 * config.model_bytes / config.bandwidth
    measured = config.worker_cpu_s if config.worker_cpu_s is not None else config.step_compute_s + copies
    # Not compute plus the rest: on shared cores the compute spans' median also holds preemption, CPU time does not.
    own = max(0.0, measured - copies)
    return own + 2 * (2 * ring + 2 * table_bytes) / config.bandwidth + dense_apply


def _ring_cpu_s(cost: RingCost, ring: float, dense_apply: float) -> float:
    assert cost.own_cpu_s is not None and cost.cpu_per_byte is not None
    return max(0.0, cost.own_cpu_s - cost.apply_s - cost.copy_s) + dense_apply + cost.cpu_per_byte * ring


def _ps_cpu_s(config: PlanConfig, table_bytes: float) -> float:
    """The PS's CPU per worker step for `table_bytes` of rows: its per-request overhead (the serve loop), the apply
    of those rows and the copies; nothing without rows."""
    if table_bytes <= 0:
        return 0.0
    copies = 4 * config.model_bytes / config.bandwidth
    measured = config.ps_cpu_s if config.ps_cpu_s is not None else config.ps_apply_s + copies
    overhead = max(0.0, measured - config.ps_apply_s - copies)
    share = table_bytes / config.model_bytes
    return overhead + share * (config.ps_apply_s + copies)


def predict_all(config: PlanConfig, strategies: tuple[Strategy, ...] = STRATEGIES) -> list[StrategyPrediction]:
    return [predict_strategy(config, strategy) for strategy in strategies]


def winner(predictions: list[StrategyPrediction]) -> tuple[StrategyPrediction, str]:
    """The strategy with the most batches per second (the first of equals), and why, in words."""
    best = max(predictions, key=lambda p: p.batches_per_s)
    others = [p for p in predictions if p is not best]
    if not others:
        return best, f"{NAMES[best.strategy]} {describe(best)}"
    runner_up = max(others, key=lambda p: p.batches_per_s)
    ratio = best.batches_per_s / runner_up.batches_per_s
    reason = (
        f"{NAMES[best.strategy]}, {best.batches_per_s:.4g} batches/s against {runner_up.batches_per_s:.4g} for "
        f"{NAMES[runner_up.strategy]} ({ratio:.2f}x): {NAMES[best.strategy]} {describe(best)}; "
        f"{NAMES[runner_up.strategy]} {describe(runner_up)}"
    )
    return best, reason


def describe(p: StrategyPrediction) -> str:
    """The busiest link's bytes and the bound, e.g. 'moves 2.4 MB each way per worker per round (bound: compute)'."""
    if not p.link_bytes:
        return f"moves nothing (bound: {p.bound})"
    link = p.busiest_link
    where = "per worker" if link == "worker" else f"through {link}, the busiest link,"
    return f"moves {format_bytes(p.link_bytes[link])} each way {where} per round (bound: {p.bound})"
