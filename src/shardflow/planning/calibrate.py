"""Fit the plan model's inputs (compute per step, bandwidth, PS apply time) to a profiled run's events: a PS run's,
or an all-reduce run's (planning/calibrate_allreduce.py)."""

from __future__ import annotations

import bisect
import statistics
from collections import defaultdict
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any

import pyarrow.compute as pc

from shardflow.planning.calibrate_allreduce import ring_cost, spans_per_s
from shardflow.planning.calibrate_hybrid import hybrid_cost, is_hybrid
from shardflow.planning.plan_model import HybridCost, RingCost
from shardflow.profile.analysis import table_counters
from shardflow.profile.capture import capture_dir, finalize
from shardflow.profile.events import load
from shardflow.profile.memory import CPU_CORES, USABLE_CPUS_BUSY
from shardflow.profile.spans import ALLREDUCE, APPLY, BACKWARD, FORWARD, PULL_WAIT, PUSH, RECEIVE, REPLY, STEP

_COLUMNS = ["role", "tid", "name", "step", "ts", "dur", "bytes", "cpu_ns"]


@dataclass(frozen=True)
class Calibration:
    """What a profiled run measured, in the plan model's terms, and what it achieved. Of an all-reduce run: its
    ring's cost (`ring`), whose bandwidth and optimizer step stand in for the links and the PS's apply."""

    capture: Path
    num_workers: int
    num_ps: int
    """0 for an all-reduce run."""
    model_bytes: float
    """Bytes a worker pushes (or all-reduces) per step: the model's size on the wire."""
    step_compute_s: float
    """Median of forward plus backward per worker step, without the pushes that backward's hooks start."""
    bandwidth: float
    """Bytes per second of the pushes, the PS's receives and the PS's replies, over their median durations."""
    ps_apply_s: float
    """Seconds to apply one update of the whole model: the median apply of each PS, summed over the PS."""
    worker_step_s: float
    """Measured mean worker step."""
    global_steps_per_s: float
    """Measured: updates ps:0 applied per second inside the capture."""
    step_compute_cpu_s: float | None = None
    """Median CPU time of the thread that ran forward plus backward per worker step, the pushes' share left out as
    for step_compute_s: the compute without the waits for a core. None for captures whose spans do not carry it."""
    worker_cpu_s: float | None = None
    """CPU seconds a worker uses per step, every thread included (the ZeroMQ I/O threads, the Python around the
    spans): from the `cpu.cores` counters. None if the capture has none."""
    ps_cpu_s: float | None = None
    """CPU seconds the PS use together per worker step (per push they receive), every thread included."""
    other_cores: float = 0.0
    """Cores the roles that do not scale with the workers (the chief, an evaluator) kept busy."""
    busy_cores: float | None = None
    """Cores all the roles together kept busy: on a machine shared with other programs, what the job got of it.
    None if the capture has no `cpu.cores` counters."""
    strategy: str = "ps"
    """The strategy of the profiled run: "ps" or "allreduce"."""
    ring: RingCost | None = None
    """An all-reduce run's: what its ring cost, in wall time and CPU per byte."""
    allreduce_s: float | None = None
    """An all-reduce run's: median all-reduce of a worker step."""
    sparse_bytes: float = 0.0
    """Of model_bytes, the sf.nn table rows' gradients a worker pushes per step: a PS run's pushes less the dense
    parameters its replies carry back; a hybrid run's pushes."""
    hybrid: HybridCost | None = None
    """A hybrid run's: its step outside the all-reduce, its wait for the PS and its ring."""
    machine_busy_cores: float | None = None
    """Cores busy on the whole machine meanwhile, other programs included (the `cpu.usable_busy` counters)."""
    table_bytes: float = 0.0
    """The sf.nn tables' values in full, over every PS (their `values_bytes` counters): what all-reduce would have
    to sum each step, holding every table in every worker. 0 without tables, or for captures without the counter."""

    @property
    def contending_roles(self) -> float:
        """Other programs' demand on the cores, in the job's busy roles: they kept (machine less job) cores busy
        while the job's roles kept busy_cores (PlanConfig.contending_roles). 0 where the capture cannot tell."""
        if self.busy_cores is None or self.machine_busy_cores is None or self.busy_cores <= 0:
            return 0.0
        others = max(0.0, self.machine_busy_cores - self.busy_cores)
        return others / self.busy_cores * (self.num_workers + self.num_ps)


def calibrate(model_dir: str | Path, capture: str | None = None) -> Calibration:
    """From MODEL_DIR's latest (or named) capture, or from a capture directory itself."""
    path = Path(model_dir)
    directory = path if capture is None and any(path.glob("*.trace.json.gz")) else capture_dir(path, capture)
    table = load(finalize(directory))
    # Tables of captures made before the spans carried their CPU time have no cpu_ns column.
    columns = [column for column in _COLUMNS if column in table.column_names]
    spans = table.filter(pc.equal(table["ph"], "X")).select(columns).to_pylist()
    by_name: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for span in spans:
        if span["step"] is not None:
            by_name[span["name"]].append(span)
    if is_hybrid(by_name):
        return _calibrate_hybrid(directory, table, by_name)
    if by_name[ALLREDUCE]:
        return _calibrate_allreduce(directory, table, by_name)
    worker_steps = [s for s in by_name[STEP] if s["role"].startswith("worker")]
    applies = by_name[APPLY]
    if not worker_steps or not applies or not by_name[PUSH]:
        raise ValueError(
            f"{directory} has no worker steps, pushes or PS applies; profile a few steady steps of a training run "
            "with Estimator(..., profile_steps=(a, b))"
        )
    num_steps = len(worker_steps)
    pushes = by_name[PUSH]
    shard_bytes = {s["role"]: s["bytes"] or 0 for s in applies}
    moved = sum(s["bytes"] or 0 for s in pushes + by_name[RECEIVE])
    moved += sum(shard_bytes.get(s["role"], 0) for s in by_name[REPLY])
    moving_us = sum(len(by_name[name]) * _median(by_name[name]) for name in (PUSH, RECEIVE, REPLY))
    applies_by_ps = _by_role(applies)
    first_ps = min(applies_by_ps, key=lambda role: int(role.partition(":")[2] or 0))
    global_steps_per_s = spans_per_s(applies_by_ps[first_ps])
    num_workers = len({s["role"] for s in worker_steps})
    cores = _cores_by_role(table)
    worker_steps_per_s = spans_per_s(worker_steps)
    model_bytes = _per_worker_step(pushes)
    return Calibration(
        capture=directory,
        num_workers=num_workers,
        num_ps=len(applies_by_ps),
        model_bytes=model_bytes,
        # Medians, not means: on a shared machine other programs preempt the roles now and then, and a preempted
        # span measures that wait, not the work.
        step_compute_s=statistics.median(_compute_us(by_name)) / 1e6,
        step_compute_cpu_s=_compute_cpu_s(by_name),
        bandwidth=moved / (moving_us / 1e6) if moving_us > 0 else float("inf"),
        ps_apply_s=sum(_median(spans) for spans in applies_by_ps.values()) / 1e6,
        worker_step_s=sum(s["dur"] for s in worker_steps) / num_steps / 1e6,
        global_steps_per_s=global_steps_per_s,
        worker_cpu_s=_cpu_per_worker_step(cores, "worker", num_workers, worker_steps_per_s),
        ps_cpu_s=_cpu_per_worker_step(cores, "ps", len(applies_by_ps), worker_steps_per_s),
        other_cores=sum(v for role, v in cores.items() if not role.startswith(("worker", "ps"))),
        busy_cores=sum(cores.values()) if cores else None,
        machine_busy_cores=_machine_busy_cores(table),
        # A worker pulls the dense parameters back after each push, never the rows it pushed gradients of.
        sparse_bytes=max(0.0, model_bytes - _per_worker_step(by_name[PULL_WAIT])) if by_name[PULL_WAIT] else 0.0,
        table_bytes=_table_bytes(table),
    )


def _per_worker_step(spans: list[dict[str, Any]]) -> float:
    """Mean bytes of the spans per (worker, step) that has any."""
    return sum(s["bytes"] or 0 for s in spans) / len({(s["role"], s["step"]) for s in spans})


def _calibrate_hybrid(directory: Path, table: Any, by_name: dict[str, list[dict[str, Any]]]) -> Calibration:
    cores = _cores_by_role(table)
    worker_steps = [s for s in by_name[STEP] if s["role"].startswith("worker")]
    num_workers = len({s["role"] for s in worker_steps})
    worker_cpu_s = _cpu_per_worker_step(cores, "worker", num_workers, spans_per_s(worker_steps))
    pushes = [s for s in by_name[PUSH] if s["role"].startswith("worker")]
    num_ps = round(len(pushes) / len({(s["role"], s["step"]) for s in pushes}))  # one push to every PS a step
    cost, ring, figures = hybrid_cost(by_name, worker_cpu_s, num_ps, directory)
    sparse_bytes = figures["sparse_bytes"]
    return Calibration(
        capture=directory,
        num_workers=num_workers,
        num_ps=num_ps,
        model_bytes=figures["model_bytes"] + sparse_bytes,
        step_compute_s=figures["step_compute_s"],
        step_compute_cpu_s=_compute_cpu_s(by_name),
        # The PS link: the rows over the push spans (the wait for the PS to take them is in cost.push_wait_s).
        bandwidth=sparse_bytes / (_median(pushes) * num_ps / 1e6) if pushes and _median(pushes) > 0 else float("inf"),
        ps_apply_s=0.0,
        worker_step_s=figures["worker_step_s"],
        global_steps_per_s=figures["global_steps_per_s"],
        worker_cpu_s=worker_cpu_s,
        other_cores=sum(v for role, v in cores.items() if not role.startswith(("worker", "ps"))),
        busy_cores=_hybrid_busy_cores(cores, cost.push_wait_s * figures["global_steps_per_s"]),
        machine_busy_cores=_machine_busy_cores(table),
        strategy="hybrid",
        ring=ring,
        allreduce_s=figures["allreduce_s"],
        sparse_bytes=sparse_bytes,
        hybrid=cost,
        table_bytes=_table_bytes(table),
    )


def _hybrid_busy_cores(cores: dict[str, float], waits_for_the_ps: float) -> float | None:
    """The cores a hybrid run's roles kept busy; where the capture holds no PS (one of before they joined it), their
    cores are the workers' waits for them (`waits_for_the_ps`, in seconds a second), which on loopback are the PS's
    work."""
    if not cores:
        return None
    has_ps = any(role.startswith("ps") for role in cores)
    return sum(cores.values()) + (0.0 if has_ps else waits_for_the_ps)


def _calibrate_allreduce(directory: Path, table: Any, by_name: dict[str, list[dict[str, Any]]]) -> Calibration:
    cores = _cores_by_role(table)
    num_workers = len({s["role"] for s in by_name[STEP] if s["role"].startswith("worker")})
    worker_steps_per_s = spans_per_s([s for s in by_name[STEP] if s["role"].startswith("worker")])
    worker_cpu_s = _cpu_per_worker_step(cores, "worker", num_workers, worker_steps_per_s)
    ring, figures = ring_cost(by_name, worker_cpu_s, directory)
    return Calibration(
        capture=directory,
        num_workers=num_workers,
        num_ps=0,
        model_bytes=figures["model_bytes"],
        step_compute_s=figures["step_compute_s"],
        step_compute_cpu_s=_compute_cpu_s(by_name),
        # No PS link to measure: the ring's bandwidth stands in for the links (inf for 1 worker: it moved nothing).
        bandwidth=ring.bandwidth if ring is not None else float("inf"),
        ps_apply_s=figures["apply_s"],
        worker_step_s=figures["worker_step_s"],
        global_steps_per_s=figures["global_steps_per_s"],
        worker_cpu_s=worker_cpu_s,
        other_cores=sum(v for role, v in cores.items() if not role.startswith("worker")),
        busy_cores=sum(cores.values()) if cores else None,
        machine_busy_cores=_machine_busy_cores(table),
        strategy="allreduce",
        ring=ring,
        allreduce_s=figures["allreduce_s"],
    )


def _by_role(spans: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    grouped: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for span in spans:
        grouped[span["role"]].append(span)
    return grouped


def _compute_us(by_name: dict[str, list[dict[str, Any]]]) -> list[float]:
    """Forward plus backward of each worker step, without the pushes that backward's hooks start."""
    compute_us: dict[tuple[str, int], float] = defaultdict(float)
    for span in by_name[FORWARD] + by_name[BACKWARD]:
        compute_us[(span["role"], span["step"])] += span["dur"]
    for span in _nested(by_name[PUSH], by_name[BACKWARD]):
        compute_us[(span["role"], span["step"])] -= span["dur"]
    return list(compute_us.values())


def _compute_cpu_s(by_name: dict[str, list[dict[str, Any]]]) -> float | None:
    """Median CPU seconds of forward plus backward per worker step, None unless every such span carries its CPU time.
    The pushes that backward's hooks start are left out in proportion: their share of the spans' wall time."""
    compute = [*by_name[FORWARD], *by_name[BACKWARD]]
    if not compute or any(span.get("cpu_ns") is None for span in compute):
        return None
    cpu_ns: dict[tuple[str, int], float] = defaultdict(float)
    wall_us: dict[tuple[str, int], float] = defaultdict(float)
    for span in compute:
        cpu_ns[(span["role"], span["step"])] += span["cpu_ns"]
        wall_us[(span["role"], span["step"])] += span["dur"]
    pushes_us: dict[tuple[str, int], float] = defaultdict(float)
    for span in _nested(by_name[PUSH], by_name[BACKWARD]):
        pushes_us[(span["role"], span["step"])] += span["dur"]
    compute_ns = [cpu * (1 - pushes_us[key] / wall_us[key]) if wall_us[key] > 0 else cpu for key, cpu in cpu_ns.items()]
    return statistics.median(compute_ns) / 1e9


def _cpu_per_worker_step(cores: dict[str, float], kind: str, num_roles: int, worker_steps_per_s: float) -> float | None:
    """CPU seconds the roles of `kind` use together per worker step; None unless every one of them was sampled."""
    measured = [value for role, value in cores.items() if role.startswith(kind)]
    # A role whose samples missed the window (it picked the capture up late) leaves the estimate to the model.
    if len(measured) != num_roles or worker_steps_per_s <= 0:
        return None
    return sum(measured) / worker_steps_per_s


def _table_bytes(table: Any) -> float:
    """The sf.nn tables' values over every PS, as the capture last counted them."""
    return sum(found.counters.get("values_bytes", 0.0) for found in table_counters(table))


def _machine_busy_cores(table: Any) -> float | None:
    """Mean cores busy on the machine, every program's, as the roles sampled them (the most any role saw)."""
    busy = _cores_by_role(table, USABLE_CPUS_BUSY)
    return max(busy.values()) if busy else None


def _cores_by_role(table: Any, counter: str = CPU_CORES) -> dict[str, float]:
    """Mean CPU cores each role kept busy over its samples: the integral of `cpu.cores` over their span."""
    counters = table.filter(pc.and_(pc.equal(table["ph"], "C"), pc.equal(table["name"], counter)))
    samples: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for row in counters.select(["role", "ts", "value"]).to_pylist():
        samples[row["role"]].append((row["ts"], row["value"]))
    cores = {}
    for role, series in samples.items():
        series.sort()
        window = series[-1][0] - series[0][0]
        if len(series) > 2 and window > 0:
            # Each value covers the time since the sample before it.
            busy = sum(value * (ts - previous) for (previous, _), (ts, value) in pairwise(series))
            cores[role] = busy / window
    return cores


def _median(spans: list[dict[str, Any]]) -> float:
    return statistics.median(s["dur"] for s in spans) if spans else 0.0


def _nested(inner: list[dict[str, Any]], outer: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The `inner` spans that lie inside an `outer` span of the same role and thread (outer spans never overlap)."""
    by_thread: dict[tuple[str, int], list[tuple[float, float]]] = defaultdict(list)
    for span in outer:
        by_thread[(span["role"], span["tid"])].append((span["ts"], span["ts"] + span["dur"]))
    for intervals in by_thread.values():
        intervals.sort()
    nested = []
    for span in inner:
        intervals = by_thread.get((span["role"], span["tid"]), [])
        i = bisect.bisect_right(intervals, (span["ts"], float("inf"))) - 1
        if i >= 0 and span["ts"] + span["dur"] <= intervals[i][1]:
            nested.append(span)
    return nested
