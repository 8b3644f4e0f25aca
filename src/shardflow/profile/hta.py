"""A capture as HolisticTraceAnalysis (HTA) reads a distributed job: a directory of one trace file per rank, one rank
per role, with `distributedInfo` and `ProfilerStep#N` spans.

HTA measures the busy and idle time of GPU streams. A role's device is its CPU, so each of its work spans (forward,
backward, apply; push, pull_wait, receive, reply) is written as a CPU op on its thread and as kernels on a stream of
that thread, tied by a correlation id; kernels of a stream never overlap, so a push inside backward cuts backward's
kernel in two. HTA's temporal breakdown then splits each role's time into compute, communication and idle (input
waits, stalls), and its idle-time breakdown reads the gaps. HTA tells communication kernels by their NCCL names, so
communication spans are written as `ncclKernel_<span>`.
"""

from __future__ import annotations

import gzip
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from shardflow.profile.spans import ALLREDUCE, APPLY, BACKWARD, FORWARD, PULL_WAIT, PUSH, RECEIVE, REPLY, STEP
from shardflow.profile.trace import open_events

COMPUTE = (FORWARD, BACKWARD, APPLY)
COMMUNICATION = (PUSH, PULL_WAIT, RECEIVE, REPLY, ALLREDUCE)
FIRST_STREAM = 7
"""The stream of a role's first thread with work, the next thread's one more (PyTorch's traces number CUDA's default
stream 7)."""
_STREAM_TID = 1 << 20


@dataclass(frozen=True)
class RankFile:
    role: str
    rank: int
    path: Path | None
    """None for a role with no work spans in the capture (HTA cannot analyse a rank without kernels)."""


def export_hta(merged_trace: str | Path, directory: str | Path) -> list[RankFile]:
    """Writes `rank-<N>.<role>.trace.json.gz` under `directory` for each role with work spans; one RankFile per role,
    in rank order."""
    metadata, stream = open_events(merged_trace)
    roles: dict[str, dict[str, Any]] = metadata.get("roles", {})
    if any("rank" not in info for info in roles.values()):
        raise ValueError(f"{merged_trace} names no rank per role: merge it again with this version of shardflow")
    by_pid: dict[int, list[dict[str, Any]]] = {}
    names: dict[int, str] = {}
    for event in stream:
        if event.get("name") == "process_name":
            names[event["pid"]] = event["args"]["name"]
        by_pid.setdefault(event["pid"], []).append(event)
    directory = Path(directory)
    if directory.is_dir() and any(path.suffix in (".json", ".gz") for path in directory.iterdir()):
        raise ValueError(f"{directory} already holds trace files, and HTA reads every one in it: choose an empty one")
    written = []
    for pid, role in sorted(names.items(), key=lambda item: roles[item[1]]["rank"]):
        info = roles[role]
        events = _rank_events(by_pid[pid], info["first_step"], info["last_step"])
        path = None
        if events:
            path = directory / f"rank-{info['rank']}.{re.sub(r'[^A-Za-z0-9_]', '_', role)}.trace.json.gz"
            trace = {
                "schemaVersion": 1,
                "distributedInfo": {"backend": "shardflow", "rank": info["rank"], "world_size": len(roles)},
                "baseTimeNanoseconds": metadata.get("base_time_ns", 0),
                "otherData": {"role": role},
                "traceEvents": events,
            }
            _write(trace, path)
        written.append(RankFile(role, info["rank"], path))
    return written


def _rank_events(events: list[dict[str, Any]], first_step: int, last_step: int) -> list[dict[str, Any]]:
    """The role's names, its profiler steps, and each work span as a CPU op and a kernel; nothing when no work."""
    spans = [
        e for e in events if e["ph"] == "X" and e.get("cat") == "span" and first_step <= e["args"]["step"] < last_step
    ]
    work = [e for e in spans if e["name"] in COMPUTE or e["name"] in COMMUNICATION]
    if not work:
        return []
    pid = work[0]["pid"]
    threads = {e["tid"]: e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    out = [e for e in events if e["ph"] == "M"]
    out += _profiler_steps(spans, last_step)
    correlations = {id(span): i for i, span in enumerate(sorted(work, key=lambda e: e["ts"]), start=1)}
    for span in work:
        args = {**span["args"], "correlation": correlations[id(span)]}
        out.append({**span, "cat": "cpu_op", "args": args})
    for stream, tid in enumerate(sorted({e["tid"] for e in work}), start=FIRST_STREAM):
        name = f"stream {stream} ({threads.get(tid, tid)})"
        out.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": _STREAM_TID + stream, "args": {"name": name}})
        for span, start, stop in _innermost_pieces([e for e in work if e["tid"] == tid]):
            out.append(
                {
                    "ph": "X",
                    "name": span["name"] if span["name"] in COMPUTE else f"ncclKernel_{span['name']}",
                    "cat": "kernel",
                    "pid": pid,
                    "tid": _STREAM_TID + stream,
                    "ts": start,
                    "dur": round(stop - start, 3),
                    "args": {"stream": stream, "device": 0, "correlation": correlations[id(span)]},
                }
            )
    return out


def _innermost_pieces(spans: list[dict[str, Any]]) -> list[tuple[dict[str, Any], float, float]]:
    """The spans of one thread (nested, as merge leaves them) cut into (span, start, stop) pieces that do not
    overlap, each moment going to the innermost span open then: kernels of one stream never overlap."""
    pieces: list[tuple[dict[str, Any], float, float]] = []
    stack: list[list[Any]] = []  # [span, where its next piece starts]

    def close_until(moment: float) -> None:
        while stack and stack[-1][0]["ts"] + stack[-1][0]["dur"] <= moment:
            span, cursor = stack.pop()
            pieces.append((span, cursor, span["ts"] + span["dur"]))
            if stack:
                stack[-1][1] = span["ts"] + span["dur"]

    for span in sorted(spans, key=lambda e: (e["ts"], -e["dur"])):
        close_until(span["ts"])
        if stack:
            pieces.append((stack[-1][0], stack[-1][1], span["ts"]))
        stack.append([span, span["ts"]])
    close_until(float("inf"))
    return [(span, start, stop) for span, start, stop in pieces if stop > start]


def _profiler_steps(spans: list[dict[str, Any]], last_step: int) -> list[dict[str, Any]]:
    """`ProfilerStep#<global step>`: a worker's step spans; for a role without them (PS, chief), each global step
    from its first span to the next step's first span, the last to its last span's end. A zero-length
    `ProfilerStep#<last_step>` closes the window where PyTorch's profiler leaves the step it stopped in, which HTA
    leaves out of its analyses."""
    steps = sorted((e for e in spans if e["name"] == STEP), key=lambda e: e["ts"])
    if steps:
        bounds = [(e["args"]["step"], e["ts"], e["ts"] + e["dur"], e["tid"]) for e in steps]
    else:
        first: dict[int, dict[str, Any]] = {}
        for span in sorted(spans, key=lambda e: e["ts"]):
            first.setdefault(span["args"]["step"], span)
        end = max(e["ts"] + e["dur"] for e in spans)
        ordered = sorted(first.values(), key=lambda e: e["ts"])
        starts = [e["ts"] for e in ordered[1:]] + [end]
        bounds = [(e["args"]["step"], e["ts"], stop, e["tid"]) for e, stop in zip(ordered, starts, strict=True)]
    end = max(stop for _, _, stop, _ in bounds)
    bounds.append((last_step, end, end, bounds[-1][3]))
    return [
        {
            "ph": "X",
            "name": f"ProfilerStep#{step}",
            "cat": "user_annotation",
            "pid": spans[0]["pid"],
            "tid": tid,
            "ts": start,
            "dur": round(stop - start, 3),
            "args": {"step": step},
        }
        for step, start, stop, tid in bounds
    ]


def _write(trace: dict[str, Any], path: Path) -> None:
    """The head as PyTorch writes it (HTA finds the rank with a regex that wants `"rank": N`), then one event per
    line."""
    path.parent.mkdir(parents=True, exist_ok=True)
    head = {key: value for key, value in trace.items() if key != "traceEvents"}
    events = trace["traceEvents"]
    with gzip.open(path, "wb", compresslevel=3) as file:
        file.write(json.dumps(head)[:-1].encode() + b', "traceEvents": [\n')
        for i, event in enumerate(events):
            file.write(orjson.dumps(event) + (b",\n" if i + 1 < len(events) else b"\n"))
        file.write(b"]}\n")
