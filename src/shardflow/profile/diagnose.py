"""Where each step's time goes, per role, and which part of the cluster bounds the step time, in words."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import pyarrow as pa
import pyarrow.compute as pc

from shardflow.profile.events import Filter
from shardflow.profile.host_load import HostLoad, host_loads
from shardflow.profile.spans import (
    ALLREDUCE,
    APPLY,
    BACKWARD,
    CHECKPOINT,
    EVAL,
    FORWARD,
    INPUT_WAIT,
    PULL_WAIT,
    PUSH,
    RECEIVE,
    REPLY,
    STEP,
)

# Worker, PS and chief spans by the part of a step they account for: `apply` is a PS's update, or an all-reduce
# worker's optimizer step; an all-reduce worker's buckets lie inside its ALLREDUCE span and are not counted again.
CATEGORY = {
    INPUT_WAIT: "input_wait",
    FORWARD: "compute",
    BACKWARD: "compute",
    PUSH: "communication",
    PULL_WAIT: "communication",
    RECEIVE: "communication",
    REPLY: "communication",
    ALLREDUCE: "communication",
    APPLY: "apply",
    CHECKPOINT: "other",
    EVAL: "other",
}
CATEGORIES = ("input_wait", "compute", "communication", "apply", "other")


@dataclass(frozen=True)
class StepRow:
    role: str
    step: int
    step_us: float
    """Worker: its step span; PS and chief: the capture's wall time divided by its number of global steps."""
    parts_us: dict[str, float] = field(default_factory=dict)
    """Time per category (CATEGORIES) and "idle", the rest of step_us."""


def steps(table: pa.Table, step_range: Filter | None = None) -> list[StepRow]:
    """Per role and step, where the time went: a worker's parts are its spans on its step span's thread."""
    spans = table.filter(pc.equal(table["ph"], "X"))
    spans = spans.filter(pc.invert(pc.is_null(spans["step"])))
    if step_range is not None:
        spans = spans.filter(step_range(spans))
    rows = spans.select(["role", "tid", "name", "step", "ts", "dur"]).to_pylist()
    if not rows:
        return []
    window_us = max(r["ts"] + r["dur"] for r in rows) - min(r["ts"] for r in rows)
    num_steps = len(global_steps(spans))
    step_spans = {(r["role"], r["step"]): r for r in rows if r["name"] == STEP}
    stepping_roles = {role for role, _ in step_spans}
    parts: dict[tuple[str, int], dict[str, float]] = {}
    backwards = {(r["role"], r["step"], r["tid"]): r for r in rows if r["name"] == BACKWARD}
    for r in rows:
        category = CATEGORY.get(r["name"])
        owner = step_spans.get((r["role"], r["step"]))
        if category is None or (r["role"] in stepping_roles and (owner is None or owner["tid"] != r["tid"])):
            continue
        bucket = parts.setdefault((r["role"], r["step"]), dict.fromkeys(CATEGORIES, 0.0))
        bucket[category] += r["dur"]
        # A push sent from inside backward (as soon as a PS's gradients are ready) is communication, not compute.
        around = backwards.get((r["role"], r["step"], r["tid"])) if r["name"] == PUSH else None
        if around is not None and around["ts"] <= r["ts"] and r["ts"] + r["dur"] <= around["ts"] + around["dur"]:
            bucket["compute"] -= r["dur"]
    result = []
    for role, step in sorted(
        {(r["role"], r["step"]) for r in rows if r["role"] not in stepping_roles} | set(step_spans)
    ):
        step_us = step_spans[(role, step)]["dur"] if role in stepping_roles else window_us / num_steps
        part = parts.get((role, step), dict.fromkeys(CATEGORIES, 0.0))
        part["idle"] = max(0.0, step_us - sum(part.values()))
        result.append(StepRow(role, step, step_us, part))
    return result


def global_steps(table: pa.Table) -> list[int]:
    """The global steps the events are of: those a PS applied, since an async worker's push may carry the older step
    it computed at; every step an event carries where no PS applied any."""
    applied = table.filter(pc.equal(table["name"], APPLY))["step"].drop_null()
    held: list[int] = pc.unique(applied if len(applied) else table["step"].drop_null()).to_pylist()
    return sorted(held)


@dataclass(frozen=True)
class RoleSummary:
    role: str
    num_steps: int
    step_us: float
    parts_us: dict[str, float]
    """Mean µs per step for each category and "idle"."""

    def fraction(self, part: str) -> float:
        return self.parts_us.get(part, 0.0) / self.step_us if self.step_us else 0.0


def summarize(rows: list[StepRow]) -> list[RoleSummary]:
    """Mean per step of each role; roles keep the order of `rows`."""
    by_role: dict[str, list[StepRow]] = {}
    for row in rows:
        by_role.setdefault(row.role, []).append(row)
    return [
        RoleSummary(
            role,
            len(group),
            sum(r.step_us for r in group) / len(group),
            {part: sum(r.parts_us[part] for r in group) / len(group) for part in (*CATEGORIES, "idle")},
        )
        for role, group in by_role.items()
    ]


Bottleneck = Literal["input", "ps", "communication", "compute"]


@dataclass(frozen=True)
class Finding:
    bottleneck: Bottleneck
    role: str
    """The role to look at first: the worker waiting most for data, the busiest PS, the slowest worker."""
    fraction: float
    """The share of step time that makes this the bottleneck."""
    message: str


def diagnose(table: pa.Table, step_range: Filter | None = None) -> list[Finding]:
    """Candidate bottlenecks, most likely first, from the workers' step breakdown and the PS's load."""
    summaries = summarize(steps(table, step_range))
    workers = [s for s in summaries if s.role.startswith("worker")]
    if not workers:
        return []
    servers = [s for s in summaries if s.role.startswith("ps")]
    full = {role: load for load in host_loads(table) if load.saturated for role in load.roles}
    findings = [
        _input(workers, full),
        _communication(workers, servers, _bytes_by_ps(table)),
        _compute(workers, full),
    ]
    return sorted(findings, key=lambda finding: -finding.fraction)


def _input(workers: list[RoleSummary], full: dict[str, HostLoad]) -> Finding:
    worst = max(workers, key=lambda s: s.fraction("input_wait"))
    share = worst.fraction("input_wait")
    message = f"input-bound: {worst.role} waits for data {share:.0%} of each step; "
    if worst.role in full:
        message += (
            f"{full[worst.role].describe()}: the cores are the limit, and more parallel calls would only share "
            "them; give the job more cores (fewer processes per host, or more hosts)"
        )
    else:
        message += "raise num_parallel_calls or prefetch"
    return Finding("input", worst.role, share, message)


def _communication(workers: list[RoleSummary], servers: list[RoleSummary], bytes_by_ps: dict[str, int]) -> Finding:
    waiting = sum(s.fraction("communication") for s in workers) / len(workers)
    if not servers:  # all-reduce: the workers sum their gradients among themselves
        slowest = max(workers, key=lambda s: s.fraction("communication"))
        message = (
            f"communication-bound: workers spend {waiting:.0%} of each step in the all-reduce of their gradients; "
            "fewer, larger buckets (bucket_bytes) or fewer bytes per parameter shorten it"
        )
        return Finding("communication", slowest.role, waiting, message)
    busiest = max(servers, key=lambda s: s.fraction("apply") + s.fraction("communication"))
    busy = busiest.fraction("apply") + busiest.fraction("communication")
    bytes_share = bytes_by_ps.get(busiest.role, 0) / (sum(bytes_by_ps.values()) or 1)
    if busy >= 0.5:
        message = (
            f"PS-bound: {busiest.role} applies {bytes_share:.0%} of all bytes and is busy {busy:.0%} of the time; "
            f"workers wait on the PS {waiting:.0%} of each step; add a PS or repartition"
        )
        return Finding("ps", busiest.role, waiting, message)
    message = (
        f"communication-bound: workers wait on PS replies {waiting:.0%} of each step while the busiest PS "
        f"({busiest.role}) works {busy:.0%} of the time; "
        "overlap push and pull with compute or send fewer, larger messages"
    )
    return Finding("communication", busiest.role, waiting, message)


def _compute(workers: list[RoleSummary], full: dict[str, HostLoad]) -> Finding:
    share = sum(s.fraction("compute") for s in workers) / len(workers)
    slowest = max(workers, key=lambda s: s.step_us)
    message = (
        f"compute-bound: forward and backward take {share:.0%} of each step "
        f"(slowest {slowest.role}, {slowest.step_us / 1000:.2f} ms per step); "
    )
    if slowest.role in full:
        message += (
            f"{full[slowest.role].describe()}: the cores, not the workers, are the limit, and more workers there "
            "would only share them; give the job more cores (more hosts) or a faster device"
        )
    else:
        message += "add workers or a faster device"
    return Finding("compute", slowest.role, share, message)


def _bytes_by_ps(table: pa.Table) -> dict[str, int]:
    applies = table.filter(pc.and_(pc.equal(table["ph"], "X"), pc.equal(table["name"], APPLY)))
    totals: dict[str, int] = {}
    for role, size in zip(applies["role"].to_pylist(), applies["bytes"].to_pylist(), strict=True):
        totals[role] = totals.get(role, 0) + (size or 0)
    return totals
