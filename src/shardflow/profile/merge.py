"""Merge role traces onto the chief's clock as one Chrome trace, and cut traces into step windows."""

from __future__ import annotations

import bisect
from pathlib import Path
from typing import Any

from shardflow.profile.trace import open_events, role_sort_key, write_trace

# Overflow lanes of a thread (spans that overlap without nesting) get tids above this.
_LANE_TID_STRIDE = 1000


def merge(role_traces: list[dict[str, Any]]) -> dict[str, Any]:
    """One process per role, sorted chief, workers, PS; each role shifted by its clock offset to the chief."""
    roles = [_only_role(trace) for trace in role_traces]
    if len(set(roles)) != len(roles):
        raise ValueError(f"each role must appear once, got {sorted(roles)}")
    order = sorted(range(len(roles)), key=lambda i: role_sort_key(roles[i]))
    chief_time_ns = [
        role_traces[i]["otherData"]["base_time_ns"] + round(_role_info(role_traces[i])["clock_offset_us"] * 1000)
        for i in order
    ]
    base_ns = min(chief_time_ns, default=0) // 1000 * 1000
    events: list[dict[str, Any]] = []
    for pid, (i, role_base_ns) in enumerate(zip(order, chief_time_ns, strict=True), start=1):
        shift_us = (role_base_ns - base_ns) / 1000
        events += _shift_role(role_traces[i]["traceEvents"], pid, shift_us, role_sort_key(roles[i]))
    events = _separate_lanes(_connect_flows(events))
    # Ranks as HolisticTraceAnalysis and torch.distributed number processes: one per role, in the roles' order.
    metadata = {
        "base_time_ns": base_ns,
        "roles": {roles[i]: {**_role_info(role_traces[i]), "rank": rank} for rank, i in enumerate(order)},
    }
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": metadata}


def cut(trace_path: str | Path, first_step: int, last_step: int, out_path: str | Path) -> Path:
    """The events of steps [first_step, last_step), with each role's counters over that time, and the arrows
    whose both ends are among them."""
    metadata, stream = open_events(trace_path)
    kept: list[dict[str, Any]] = []
    counters: list[dict[str, Any]] = []
    window: dict[int, tuple[float, float]] = {}
    for event in stream:
        if event.get("ph") == "M":
            kept.append(event)
        elif event.get("ph") == "C":
            counters.append(event)
        elif first_step <= event.get("args", {}).get("step", first_step - 1) < last_step:
            kept.append(event)
            if event["ph"] == "X":
                low, high = window.get(event["pid"], (event["ts"], event["ts"]))
                window[event["pid"]] = (min(low, event["ts"]), max(high, event["ts"] + event["dur"]))
    for counter in counters:
        low, high = window.get(counter["pid"], (1.0, 0.0))
        if low <= counter["ts"] <= high:
            kept.append(counter)
    for role in metadata.get("roles", {}).values():
        role["first_step"], role["last_step"] = first_step, last_step
    # An arrow from a push before the window to an apply inside it (async) loses its start here.
    return write_trace({"traceEvents": _connect_flows(kept), "otherData": metadata}, out_path)


def _only_role(trace: dict[str, Any]) -> str:
    roles = list(trace.get("otherData", {}).get("roles", {}))
    if len(roles) != 1:
        raise ValueError(f"a role trace names exactly one role in otherData.roles, got {roles}")
    return str(roles[0])


def _role_info(trace: dict[str, Any]) -> dict[str, Any]:
    info: dict[str, Any] = next(iter(trace["otherData"]["roles"].values()))
    return info


def _shift_role(
    events: list[dict[str, Any]], pid: int, shift_us: float, sort_key: tuple[int, str, int]
) -> list[dict[str, Any]]:
    shifted = [{"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}}]
    for event in events:
        event = {**event, "pid": pid}
        if event["ph"] == "M":
            if event["name"] == "thread_name":
                shifted.append({**event, "name": "thread_sort_index", "args": {"sort_index": event["tid"]}})
        else:
            event["ts"] = round(event["ts"] + shift_us, 3)
        shifted.append(event)
    return shifted


def _separate_lanes(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Moves spans that overlap a span of their thread without nesting in it onto an extra lane of that thread."""
    by_track: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for event in events:
        if event["ph"] == "X":
            by_track.setdefault((event["pid"], event["tid"]), []).append(event)
    thread_names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    extra: list[dict[str, Any]] = []
    for (pid, tid), spans in by_track.items():
        spans.sort(key=lambda e: (_ns(e["ts"]), -_ns(e["dur"])))
        lanes: list[list[int]] = []  # per lane, the end times (ns) of the open spans
        for span in spans:
            start, end = _ns(span["ts"]), _ns(span["ts"]) + _ns(span["dur"])
            lane = next((k for k, stack in enumerate(lanes) if _fits(stack, start, end)), len(lanes))
            if lane == len(lanes):
                lanes.append([])
                if lane:
                    name = f"{thread_names.get((pid, tid), tid)} ({lane + 1})"
                    lane_tid = tid + lane * _LANE_TID_STRIDE
                    extra.append(
                        {"ph": "M", "name": "thread_name", "pid": pid, "tid": lane_tid, "args": {"name": name}}
                    )
            lanes[lane].append(end)
            span["tid"] = tid + lane * _LANE_TID_STRIDE
    if extra:
        _rebind_flows(events, by_track)
    return extra + events


def _fits(stack: list[int], start: int, end: int) -> bool:
    """Whether a span fits on a lane, whose stack holds the end times of its spans still open at `start`."""
    while stack and stack[-1] <= start:
        stack.pop()
    return not stack or end <= stack[-1]


def _rebind_flows(events: list[dict[str, Any]], by_track: dict[tuple[int, int], list[dict[str, Any]]]) -> None:
    """A flow event binds to the innermost span enclosing it on its thread, so it follows that span's lane."""
    starts = {track: [_ns(span["ts"]) for span in spans] for track, spans in by_track.items()}
    for event in events:
        if event["ph"] not in ("s", "f") or (event["pid"], event["tid"]) not in by_track:
            continue
        spans, ts = by_track[(event["pid"], event["tid"])], _ns(event["ts"])
        for i in range(bisect.bisect_right(starts[(event["pid"], event["tid"])], ts) - 1, -1, -1):
            if _ns(spans[i]["ts"]) + _ns(spans[i]["dur"]) >= ts:
                event["tid"] = spans[i]["tid"]
                break


def _connect_flows(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Keeps flows whose start and end were both captured; both ends get the start's name so viewers pair them.
    Lead-in events (a push from before the window and its arrow, see SpanRecorder.to_role_trace) stay only when
    their arrow connects."""
    starts = {e["id"]: e["name"] for e in events if e["ph"] == "s"}
    connected_ids = starts.keys() & {e["id"] for e in events if e["ph"] == "f"}
    connected = []
    for event in events:
        lead_in = event.get("args", {}).get("lead_in")
        if lead_in is not None:
            if lead_in not in connected_ids:
                continue
            event = {**event, "args": {k: v for k, v in event["args"].items() if k != "lead_in"}}
        if event["ph"] in ("s", "f"):
            if event["id"] not in connected_ids:
                continue
            event = {**event, "name": starts[event["id"]], "cat": "flow"}
        connected.append(event)
    return connected


def _ns(us: float) -> int:
    return round(us * 1000)
