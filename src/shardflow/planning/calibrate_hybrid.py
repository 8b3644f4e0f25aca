"""Fit the plan model's inputs to a profiled sf.HybridStrategy run: a worker's step outside the all-reduce and the
wait for the PS, that wait, the rows it pushes and what the dense all-reduce's ring cost."""

from __future__ import annotations

import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

from shardflow.planning.calibrate_allreduce import ring_cost
from shardflow.planning.plan_model import HybridCost, RingCost
from shardflow.planning.strategies import ring_bytes
from shardflow.profile.spans import ALLREDUCE, PULL_WAIT, PUSH, STEP


def is_hybrid(spans: dict[str, list[dict[str, Any]]]) -> bool:
    """Whether the workers both all-reduced and pushed to a PS: a hybrid run's capture."""
    return any(s["role"].startswith("worker") for s in spans[ALLREDUCE]) and any(
        s["role"].startswith("worker") for s in spans[PUSH]
    )


def hybrid_cost(
    spans: dict[str, list[dict[str, Any]]], worker_cpu_s: float | None, num_ps: int, capture: Path
) -> tuple[HybridCost, RingCost | None, dict[str, float]]:
    """The hybrid run's cost from every worker's spans (by name), its ring's (ring_cost's: None for 1 worker), and
    the figures of its run the calibration also holds (ring_cost's, and sparse_bytes: the rows' gradients a worker
    pushes per step)."""
    ring, figures = ring_cost(spans, worker_cpu_s, capture)
    step = _per_step(spans[STEP])
    reduce = _per_step(spans[ALLREDUCE])
    # A hybrid worker's pull waits are its waits for the PS to take its rows (it pulls no dense parameter).
    push_wait = _per_step(spans[PUSH] + spans[PULL_WAIT])
    pushed = _per_step(spans[PUSH], "bytes")
    keys = [key for key in step if key in reduce and key in push_wait]
    if not keys:
        raise ValueError(
            f"{capture} has no hybrid worker step with both an all-reduce and a push; profile a few steady steps "
            "of an sf.HybridStrategy run with Estimator(..., profile_steps=(a, b))"
        )
    num_workers = len({role for role, _ in keys})
    # Means, not medians: the parts of a step trade off (a worker the PS served first waits longer in the ring for
    # the other), so only their means add up to the step.
    own_s = max(0.0, statistics.fmean(step[k] - reduce[k] - push_wait[k] for k in keys)) / 1e6
    cost = HybridCost(
        own_s=own_s,
        push_wait_s=statistics.fmean(push_wait[k] for k in keys) / 1e6,
        allreduce_s=statistics.fmean(reduce[k] for k in keys) / 1e6,
        copy_s=ring.copy_s if ring is not None else 0.0,
        worker_cpu_s=worker_cpu_s,
        ring_cpu_per_byte=_ring_cpu_per_byte(worker_cpu_s, own_s, ring_bytes(num_workers, figures["model_bytes"])),
        calibrated_workers=num_workers,
        calibrated_ps=num_ps,
    )
    return cost, ring, {**figures, "sparse_bytes": float(statistics.median(pushed[k] for k in keys if k in pushed))}


def _ring_cpu_per_byte(worker_cpu_s: float | None, own_s: float, ring: float) -> float:
    """What a worker's CPU per step exceeds its own part by (the waits use none) is the ring's: gloo's threads."""
    if worker_cpu_s is None or ring <= 0:
        return 0.0
    return max(0.0, worker_cpu_s - own_s) / ring


def _per_step(spans: list[dict[str, Any]], field: str = "dur") -> dict[tuple[str, int], float]:
    """`field` per (worker, global step), summed over the spans of that step."""
    total: dict[tuple[str, int], float] = defaultdict(float)
    for span in spans:
        if span["role"].startswith("worker"):
            total[(span["role"], span["step"])] += span[field] or 0
    return total
