"""Fit the plan model's inputs to a profiled all-reduce run: compute, the optimizer's step, and what gloo's ring
costs on this machine, in wall time and in CPU per byte."""

from __future__ import annotations

import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

from shardflow.planning.plan_model import RingCost
from shardflow.planning.strategies import ring_bytes
from shardflow.profile.spans import ALLREDUCE, ALLREDUCE_BUCKET, APPLY, BACKWARD, FORWARD, STEP


def ring_cost(
    spans: dict[str, list[dict[str, Any]]], worker_cpu_s: float | None, capture: Path
) -> tuple[RingCost | None, dict[str, float]]:
    """The ring's cost from every worker's spans (by name), None for a run of 1 worker (which all-reduces nothing),
    and the figures of its run the calibration also holds: model_bytes, step_compute_s, apply_s, allreduce_s,
    worker_step_s, global_steps_per_s. `worker_cpu_s`: CPU seconds a worker used per step, all its threads, None if
    the capture has no cpu.cores counters."""
    steps = [s for s in spans[STEP] if s["role"].startswith("worker")]
    reduces = [s for s in spans[ALLREDUCE] if s["role"].startswith("worker")]
    if not steps or not reduces:
        raise ValueError(
            f"{capture} has no all-reduce worker steps; profile a few steady steps of an sf.AllReduceStrategy run "
            "with Estimator(..., profile_steps=(a, b))"
        )
    num_workers = len({s["role"] for s in steps})
    model_bytes = float(statistics.median(s["bytes"] or 0 for s in reduces))
    # Medians, not means: on a shared machine other programs preempt the workers now and then.
    allreduce_s = _median(reduces) / 1e6
    compute_s = statistics.median(_per_step(spans[FORWARD] + spans[BACKWARD]).values()) / 1e6
    apply_s = _median([s for s in spans[APPLY] if s["role"].startswith("worker")]) / 1e6  # not a hybrid PS's
    copy_s = _copy_us(reduces, spans[ALLREDUCE_BUCKET]) / 1e6
    outside = _per_step(steps)
    for key, value in _per_step(reduces).items():
        outside[key] = outside.get(key, 0.0) - value
    outside_s = statistics.median(outside.values()) / 1e6
    first = min({s["role"] for s in steps}, key=lambda role: int(role.partition(":")[2] or 0))
    steps_per_s = spans_per_s([s for s in steps if s["role"] == first])
    ring = ring_bytes(num_workers, model_bytes)
    # What a worker's CPU per step exceeds the rest of its step by is the ring's: gloo's threads and the messages.
    own_cpu_s = outside_s + copy_s
    cpu_per_byte = None
    if worker_cpu_s is not None and ring > 0:
        cpu_per_byte = max(0.0, worker_cpu_s - own_cpu_s) / ring
    cost = None
    if ring > 0 and allreduce_s > copy_s:
        cost = RingCost(
            bandwidth=ring / (allreduce_s - copy_s),
            cpu_per_byte=cpu_per_byte,
            apply_s=apply_s,
            copy_s=copy_s,
            own_cpu_s=own_cpu_s if worker_cpu_s is not None else None,
            calibrated_workers=num_workers,
        )
    figures = {
        "model_bytes": model_bytes,
        "step_compute_s": compute_s,
        "apply_s": apply_s,
        "allreduce_s": allreduce_s,
        "worker_step_s": sum(s["dur"] for s in steps) / len(steps) / 1e6,
        "global_steps_per_s": steps_per_s,
    }
    return cost, figures


def _per_step(spans: list[dict[str, Any]]) -> dict[tuple[str, int], float]:
    """µs per (worker, global step), summed over the spans of that step."""
    total: dict[tuple[str, int], float] = defaultdict(float)
    for span in spans:
        if span["role"].startswith("worker"):
            total[(span["role"], span["step"])] += span["dur"]
    return total


def _copy_us(reduces: list[dict[str, Any]], buckets: list[dict[str, Any]]) -> float:
    """Median µs from the start of a worker's all-reduce to the issue of its last bucket: the copies of the
    gradients into the buckets, which grow with the model and not with the ring."""
    last_issue: dict[tuple[str, int], float] = {}
    for span in buckets:
        key = (span["role"], span["step"])
        last_issue[key] = max(last_issue.get(key, span["ts"]), span["ts"])
    copies = [last_issue[(s["role"], s["step"])] - s["ts"] for s in reduces if (s["role"], s["step"]) in last_issue]
    return statistics.median(copies) if copies else 0.0


def _median(spans: list[dict[str, Any]]) -> float:
    return statistics.median(s["dur"] for s in spans) if spans else 0.0


def spans_per_s(spans: list[dict[str, Any]]) -> float:
    """Spans per second between the first start and the last, less one span per role (one role's applies, or every
    worker's steps together). Every worker's steps are one window, not a sum of each worker's rate: a worker other
    programs kept off the cores for part of the window starts its first step late (or its last early), and its rate
    over its own shorter window counts the missing time as work (two CI runs planned 16% and 54% above the run they
    were calibrated on so)."""
    starts = sorted(s["ts"] for s in spans)
    roles = len({s["role"] for s in spans})
    return (
        (len(starts) - roles) / ((starts[-1] - starts[0]) / 1e6)
        if len(starts) > roles and starts[-1] > starts[0]
        else 0.0
    )
