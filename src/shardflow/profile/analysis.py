"""One analyzer per question over the events table: top, memory peaks, diff of two captures."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from shardflow.profile.diagnose import steps, summarize
from shardflow.profile.events import Filter
from shardflow.profile.trace import role_sort_key

GroupBy = Literal["op", "source", "shape", "role", "device"]
_GROUP_COLUMN = {"op": "name", "source": "source", "shape": "shape", "role": "role", "device": "device"}


@dataclass(frozen=True)
class TopRow:
    key: str
    calls: int
    """Shown entries in the group (allocations, for --by memory)."""
    self_value: float
    """µs (or bytes) in the group's entries themselves, plus hidden entries below them."""
    total_value: float
    """µs (or bytes) including everything below the group's entries."""
    share: float
    """self_value as a fraction of all self_value."""


def top(
    table: pa.Table,
    by: Literal["time", "memory"] = "time",
    group_by: GroupBy = "op",
    shown: Filter | None = None,
    step_range: Filter | None = None,
) -> list[TopRow]:
    """Time (or allocated bytes) per group; entries that `shown` hides roll up into their nearest shown parent."""
    table = table.filter(pc.is_in(table["ph"], pa.array(["X", "i"])))
    if step_range is not None:
        table = table.filter(step_range(table))
    is_span = table["ph"].to_numpy(zero_copy_only=False) == "X"
    displayed = is_span & (shown(table) if shown is not None else True)
    tree = _nest(table)
    duration = pc.fill_null(table["dur"], 0.0).to_numpy()
    keys, names = _codes(table[_GROUP_COLUMN[group_by]])
    owner = tree.owners(displayed)
    if by == "time":
        children = np.bincount(
            tree.parent[is_span & (tree.parent >= 0)],
            weights=duration[is_span & (tree.parent >= 0)],
            minlength=len(duration),
        )
        metric = np.where(is_span, duration - children, 0.0)
        total = np.where(displayed, duration, 0.0)
    else:
        allocated = np.where(
            table["name"].to_numpy(zero_copy_only=False) == "alloc", pc.fill_null(table["bytes"], 0).to_numpy(), 0
        )
        metric = allocated.astype(np.float64)
        total = tree.inclusive(owner, metric)
    attributed = owner >= 0
    self_by_key = np.bincount(keys[owner[attributed]], weights=metric[attributed], minlength=len(names))
    total_by_key = np.bincount(keys[displayed], weights=total[displayed], minlength=len(names))
    counted = displayed if by == "time" else attributed & (metric > 0)
    calls = np.bincount(keys[owner[counted]] if by == "memory" else keys[counted], minlength=len(names))
    grand = self_by_key.sum() or 1.0
    rows = [
        TopRow(names[k], int(calls[k]), float(self_by_key[k]), float(total_by_key[k]), float(self_by_key[k] / grand))
        for k in range(len(names))
        if calls[k] or self_by_key[k]
    ]
    return sorted(rows, key=lambda row: (-row.self_value, row.key))


@dataclass
class _Tree:
    parent: np.ndarray
    order: list[int]

    def owners(self, displayed: np.ndarray) -> np.ndarray:
        """Each row's nearest shown ancestor-or-self, -1 if none; parents precede children in `order`."""
        owner = np.full(len(self.parent), -1, dtype=np.int64)
        parent, shown = self.parent.tolist(), displayed.tolist()
        result = owner.tolist()
        for i in self.order:
            result[i] = i if shown[i] else (result[parent[i]] if parent[i] >= 0 else -1)
        return np.array(result, dtype=np.int64)

    def inclusive(self, owner: np.ndarray, metric: np.ndarray) -> np.ndarray:
        """metric summed into every shown ancestor, not only the nearest."""
        total = np.zeros(len(metric))
        parent, owners = self.parent.tolist(), owner.tolist()
        for i in np.flatnonzero(metric).tolist():
            node = owners[i]
            while node >= 0:
                total[node] += metric[i]
                node = owners[parent[node]] if parent[node] >= 0 else -1
        return total


def _nest(table: pa.Table) -> _Tree:
    """Parent of each X/i row: the innermost X row on the same thread that encloses it."""
    pid, tid = table["pid"].to_numpy(), table["tid"].to_numpy()
    ts = table["ts"].to_numpy()
    end = ts + pc.fill_null(table["dur"], 0.0).to_numpy()
    is_span = table["ph"].to_numpy(zero_copy_only=False) == "X"
    order = np.lexsort((~is_span, ts - end, ts, tid, pid)).tolist()
    parent = [-1] * len(ts)
    track_list = (pid.astype(np.int64) << 32 | tid.astype(np.int64)).tolist()
    ts_list, end_list, span_list = ts.tolist(), end.tolist(), is_span.tolist()
    stack: list[int] = []
    track = None
    for i in order:
        if track_list[i] != track:
            track, stack = track_list[i], []
        while stack and end_list[stack[-1]] <= ts_list[i]:
            stack.pop()
        if stack:
            parent[i] = stack[-1]
        if span_list[i]:
            stack.append(i)
    return _Tree(np.array(parent, dtype=np.int64), order)


def _codes(column: pa.ChunkedArray) -> tuple[np.ndarray, list[str]]:
    encoded = pc.dictionary_encode(pc.fill_null(column.cast(pa.string()), "-")).combine_chunks()
    return encoded.indices.to_numpy(zero_copy_only=False).astype(np.int64), encoded.dictionary.to_pylist()


@dataclass(frozen=True)
class LiveGroup:
    op: str
    shape: str
    device: str
    bytes: int
    count: int


@dataclass(frozen=True)
class MemoryPeak:
    role: str
    counter: str
    peak: float
    ts: float
    step: int | None
    """The global step of the innermost span open at the peak, if any."""
    active: list[str]
    """Spans and ops of the role open at the peak, outermost first."""
    live: list[LiveGroup]
    """Allocations made and not yet freed at the peak, by op and shape, largest first."""


def memory(table: pa.Table, step_range: Filter | None = None) -> list[MemoryPeak]:
    """The peak of every memory counter of every role, with what was running and live at that moment."""
    spans = table.filter(pc.equal(table["ph"], "X"))
    if step_range is not None:
        spans = spans.filter(step_range(spans))
    counters = table.filter(pc.and_(pc.equal(table["ph"], "C"), pc.starts_with(table["name"], "memory.")))
    allocations = table.filter(pc.and_(pc.equal(table["ph"], "i"), pc.equal(table["cat"], "memory")))
    peaks = []
    for role in sorted(set(counters["role"].to_pylist()), key=role_sort_key):
        role_spans = spans.filter(pc.equal(spans["role"], role)).to_pylist()
        low = min((s["ts"] for s in role_spans), default=-np.inf)
        high = max((s["ts"] + s["dur"] for s in role_spans), default=np.inf)
        samples = counters.filter(pc.equal(counters["role"], role)).to_pylist()
        for name in sorted({s["name"] for s in samples}):
            inside = [s for s in samples if s["name"] == name and low <= s["ts"] <= high]
            if not inside:
                continue
            peak = max(inside, key=lambda s: (s["value"], -s["ts"]))
            active = sorted(
                (s for s in role_spans if s["ts"] <= peak["ts"] < s["ts"] + s["dur"]), key=lambda s: s["ts"]
            )
            live = _live(allocations.filter(pc.equal(allocations["role"], role)), peak["ts"])
            step = active[-1]["step"] if active else None
            peaks.append(MemoryPeak(role, name, peak["value"], peak["ts"], step, [s["name"] for s in active], live))
    return peaks


def _live(allocations: pa.Table, at_ts: float) -> list[LiveGroup]:
    live: dict[int, dict[str, Any]] = {}
    for event in sorted(allocations.to_pylist(), key=lambda e: e["ts"]):
        if event["ts"] > at_ts:
            break
        if event["name"] == "alloc":
            live[event["addr"]] = event
        else:
            live.pop(event["addr"], None)
    groups: dict[tuple[str, str, str], list[int]] = {}
    for event in live.values():
        key = (event["op"] or "-", event["shape"] or "-", event["device"] or "-")
        groups.setdefault(key, []).append(event["bytes"])
    rows = [LiveGroup(op, shape, device, sum(sizes), len(sizes)) for (op, shape, device), sizes in groups.items()]
    return sorted(rows, key=lambda row: -row.bytes)


@dataclass(frozen=True)
class DiffRow:
    key: str
    a_us: float
    """Mean µs per global step in capture A."""
    b_us: float

    @property
    def delta_us(self) -> float:
        return self.b_us - self.a_us


def diff(a: pa.Table, b: pa.Table) -> list[DiffRow]:
    """Per-step time of each role's step parts and of each span or op name, B against A, largest change first."""
    a_values, b_values = _per_step_profile(a), _per_step_profile(b)
    keys = sorted(set(a_values) | set(b_values))
    rows = [DiffRow(key, a_values.get(key, 0.0), b_values.get(key, 0.0)) for key in keys]
    return sorted(rows, key=lambda row: (-abs(row.delta_us), row.key))


def _per_step_profile(table: pa.Table) -> dict[str, float]:
    values = {
        f"{summary.role} {part}": value
        for summary in summarize(steps(table))
        for part, value in {"step": summary.step_us, **summary.parts_us}.items()
    }
    num_steps = len(set(table["step"].drop_null().to_pylist())) or 1
    values.update({f"self {row.key}": row.self_value / num_steps for row in top(table)})
    return values


@dataclass(frozen=True)
class TableCounters:
    role: str
    table: str
    counters: dict[str, float]
    """Each counter's last value in the capture (rows, admitted, rejected, evicted, expired, memory_bytes,
    values_bytes)."""


def table_counters(table: pa.Table) -> list[TableCounters]:
    """Per PS and `sf.nn` table, its counters as the capture last saw them (counters named `table/<table>/<name>`)."""
    counters = table.filter(pc.and_(pc.equal(table["ph"], "C"), pc.starts_with(table["name"], "table/")))
    last: dict[tuple[str, str], dict[str, float]] = {}
    for event in sorted(counters.select(["role", "name", "ts", "value"]).to_pylist(), key=lambda e: e["ts"]):
        _, name, counter = event["name"].rsplit("/", 2) if event["name"].count("/") >= 2 else ("", "", "")
        if name:
            last.setdefault((event["role"], name), {})[counter] = event["value"]
    ordered = sorted(last.items(), key=lambda item: (role_sort_key(item[0][0]), item[0][1]))
    return [TableCounters(role, name, values) for (role, name), values in ordered]
