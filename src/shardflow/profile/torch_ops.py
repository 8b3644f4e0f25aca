"""Optional op-level detail: torch.profiler over the captured steps, folded into the role's trace."""

from __future__ import annotations

import os
import tempfile
from types import TracebackType
from typing import Any

import numpy as np
import orjson

from shardflow.profile.recorder import SpanRecorder
from shardflow.profile.spans import STEP

_GPU_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset"}
_LIBRARY_FRAMES = ("torch/", "<built-in", "site-packages/", "shardflow/profile/")


class OpCapture:
    """Profiles ops between start and stop; `events()` gives them on the recorder's clock and steps.

    Ops go on their own track per thread ("MainThread ops"): torch.profiler converts its clock to wall time
    separately, so a few µs of disagreement could otherwise misnest ops inside the recorder's spans.
    """

    def __init__(
        self, recorder: SpanRecorder, record_shapes: bool = True, profile_memory: bool = True, with_stack: bool = True
    ) -> None:
        self.recorder = recorder
        self.record_shapes, self.profile_memory, self.with_stack = record_shapes, profile_memory, with_stack
        self._profiler: Any = None
        self._events: list[dict[str, Any]] = []

    def start(self) -> None:
        import torch.profiler

        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._profiler = torch.profiler.profile(
            activities=activities,
            record_shapes=self.record_shapes,
            profile_memory=self.profile_memory,
            with_stack=self.with_stack,
        )
        self._profiler.__enter__()

    def stop(self) -> None:
        profiler, self._profiler = self._profiler, None
        profiler.__exit__(None, None, None)
        handle, path = tempfile.mkstemp(suffix=".json")
        os.close(handle)
        try:
            profiler.export_chrome_trace(path)
            with open(path, "rb") as file:
                exported = orjson.loads(file.read())
        finally:
            os.unlink(path)
        self._events = convert(exported, self.recorder)

    def events(self) -> list[dict[str, Any]]:
        return self._events

    def __enter__(self) -> OpCapture:
        self.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()


def warm_up() -> None:
    """Starts and stops torch.profiler once. Its first start in a process initialises its backend, which takes
    seconds on a busy host: a role does that when it learns of a capture, not inside the captured steps."""
    import torch.profiler

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        pass


def convert(exported: dict[str, Any], recorder: SpanRecorder) -> list[dict[str, Any]]:
    """torch.profiler's Chrome trace -> op, kernel, allocation and counter events of the recorder's role."""
    shift_us = (exported.get("baseTimeNanoseconds", 0) - recorder.base_time_ns) / 1000
    raw = sorted((e for e in exported["traceEvents"] if "ts" in e), key=lambda e: (e["ts"], -e.get("dur", 0)))
    step_starts, step_numbers = _step_spans(recorder)
    tracks: dict[int, int] = {}
    events: list[dict[str, Any]] = []
    open_ops: dict[int, list[dict[str, Any]]] = {}  # per OS thread: ops enclosing the current time
    open_frames: dict[int, list[tuple[float, str]]] = {}  # per OS thread: (end, frame) of user Python frames
    for event in raw:
        ts, os_tid, category = event["ts"], event.get("tid", 0), event.get("cat", "")
        ops = open_ops.setdefault(os_tid, [])
        frames = open_frames.setdefault(os_tid, [])
        while ops and ops[-1]["_end"] <= ts:
            ops.pop()
        while frames and frames[-1][0] <= ts:
            frames.pop()
        recorder_ts = round(ts + shift_us, 3)
        step = int(step_numbers[i]) if (i := np.searchsorted(step_starts, recorder_ts, "right") - 1) >= 0 else -1
        if category == "python_function":
            if ".py(" in event["name"] and not any(part in event["name"] for part in _LIBRARY_FRAMES):
                frames.append((ts + event["dur"], event["name"]))
        elif category == "cpu_op" or category in _GPU_CATEGORIES:
            gpu = category in _GPU_CATEGORIES
            args = event.get("args", {})
            device = f"cuda:{args.get('device', 0)}" if gpu else "cpu"
            op = {
                "ph": "X",
                "name": event["name"],
                "cat": "kernel" if gpu else "op",
                "ts": recorder_ts,
                "dur": round(event["dur"], 3),
                "tid": _track(tracks, recorder, os_tid, f"{device} stream {os_tid}" if gpu else None),
                "args": {"step": step, "device": device},
            }
            if "Input Dims" in args:
                op["args"]["shape"] = _compact(args["Input Dims"])
            if frames:
                op["args"]["source"] = frames[-1][1]
            events.append(op)
            if not gpu:
                ops.append({**op, "_end": ts + event["dur"]})
        elif event.get("name") == "[memory]":
            events += _memory_events(event, recorder_ts, step, ops, _track(tracks, recorder, os_tid, None))
    return events


def _memory_events(
    event: dict[str, Any], ts: float, step: int, ops: list[dict[str, Any]], tid: int
) -> list[dict[str, Any]]:
    args = event["args"]
    device = "cpu" if args.get("Device Type", 0) == 0 else f"cuda:{args.get('Device Id', 0)}"
    allocation: dict[str, Any] = {
        "step": step,
        "bytes": args["Bytes"],
        "addr": args.get("Addr", -1),
        "device": device,
        "total_allocated": args.get("Total Allocated", 0),
    }
    if ops:
        allocation["op"] = ops[-1]["name"]
        allocation["shape"] = ops[-1]["args"].get("shape", "")
    name = "alloc" if args["Bytes"] >= 0 else "free"
    counter = "memory.torch_cpu_allocated" if device == "cpu" else "memory.cuda_allocated"
    return [
        {"ph": "i", "s": "t", "name": name, "cat": "memory", "ts": ts, "tid": tid, "args": allocation},
        {"ph": "C", "name": counter, "ts": ts, "args": {"value": float(args.get("Total Allocated", 0))}},
    ]


def _track(tracks: dict[int, int], recorder: SpanRecorder, os_tid: int, name: str | None) -> int:
    """The recorder thread id of the ops track for an OS thread, named after the recorder's thread."""
    key = hash((os_tid, name))
    if key not in tracks:
        if name is None:
            native = recorder.thread_native_ids
            owner = recorder.thread_names[native.index(os_tid)] if os_tid in native else f"thread {os_tid}"
            name = f"{owner} ops"
        tracks[key] = recorder.thread_id(name)
    return tracks[key]


def _step_spans(recorder: SpanRecorder) -> tuple[np.ndarray, np.ndarray]:
    steps = [e for e in recorder.events(-(1 << 62), 1 << 62) if e["ph"] == "X" and e["name"] == STEP]
    return np.array([e["ts"] for e in steps], dtype=np.float64), np.array([e["args"]["step"] for e in steps])


def _compact(dims: list[Any]) -> str:
    return orjson.dumps([d for d in dims if d != []]).decode()
