"""Always-on span recorder: a fixed-size ring of spans, flows and counters per process."""

from __future__ import annotations

import itertools
import os
import socket
import threading
import time
import zlib
from types import TracebackType
from typing import Any

import numpy as np

from shardflow.profile.spans import ARG_NAMES

get_ident = threading.get_ident

SPAN, FLOW_START, FLOW_END = 0, 1, 2
LEAD_IN_STEPS = 64
"""How many global steps before a window its trace looks back for the pushes the window's applies consumed."""
_THREAD_SHIFT, _KIND_SHIFT = 20, 40
_ID_MASK = (1 << _THREAD_SHIFT) - 1


class SpanRecorder:
    """Records spans of one role into a fixed-size ring; the oldest entries are overwritten when full.

    Timestamps are `time.perf_counter_ns()` values; `base_time_ns` is the wall clock (`time.time_ns()`)
    at construction, and exported timestamps are microseconds since then, which keeps ns precision.
    """

    def __init__(self, role: str, capacity: int = 1 << 16) -> None:
        if capacity <= 0 or capacity & (capacity - 1):
            raise ValueError(f"capacity must be a power of two, got {capacity}")
        self.role = role
        self.capacity = capacity
        self._mask = capacity - 1
        # The midpoint of two perf readings around the wall reading pairs the two clocks most closely.
        before = time.perf_counter_ns()
        self.base_time_ns = time.time_ns()
        self._anchor_perf_ns = (before + time.perf_counter_ns()) // 2
        # One tuple per entry, (name, thread id | kind << 20, step, start, end, arg0, arg1): a single list store
        # costs half of six array stores, and names are interned only when a capture is exported.
        self._ring: list[tuple[str, int, int, int, int, int, int] | None] = [None] * capacity
        self._counters: list[tuple[str, int, float] | None] = [None] * capacity
        self._next = itertools.count()  # next() on a count is atomic under the GIL
        self._next_counter = itertools.count()
        self._names: dict[str, int] = {}
        self.name_list: list[str] = []
        self._threads: dict[int | str, int] = {}
        self.thread_names: list[str] = []
        self.thread_native_ids: list[int] = []
        self._intern_lock = threading.Lock()

    def begin(self, name: str, step: int) -> int:
        """A start token for `end`; name and step are taken by `end`."""
        return time.perf_counter_ns()

    def end(self, name: str, step: int, start: int, arg0: int = -1, arg1: int = -1, thread: str | None = None) -> None:
        now = time.perf_counter_ns()
        thread_key: int | str = get_ident() if thread is None else thread
        try:
            thread_id = self._threads[thread_key]
        except KeyError:
            thread_id = self._intern_thread(thread_key)
        self._ring[next(self._next) & self._mask] = (name, thread_id, step, start, now, arg0, arg1)

    def span(self, name: str, step: int, arg0: int = -1, arg1: int = -1) -> _Span:
        return _Span(self, name, step, arg0, arg1)

    def flow(
        self, name: str, step: int, flow_id: int, start: bool, thread: str | None = None, at_ns: int | None = None
    ) -> None:
        """Call inside the span the arrow binds to (same thread): the push (start=True) or the apply (start=False).
        `at_ns`: the `time.perf_counter_ns()` of the arrow's end when it came before its id was known (a push is
        stamped before it is sent: the PS may apply it before `send()` returns with the id)."""
        now = time.perf_counter_ns() if at_ns is None else at_ns
        thread_key: int | str = get_ident() if thread is None else thread
        thread_id = self._threads.get(thread_key)
        thread_id = self._intern_thread(thread_key) if thread_id is None else thread_id
        key = thread_id | (FLOW_START if start else FLOW_END) << _THREAD_SHIFT
        self._ring[next(self._next) & self._mask] = (name, key, step, now, now, flow_id, -1)

    def counter(self, name: str, value: float) -> None:
        self._counters[next(self._next_counter) & self._mask] = (name, time.perf_counter_ns(), value)

    def events(self, first_step: int, last_step: int) -> list[dict[str, Any]]:
        """Chrome-trace dicts for steps [first_step, last_step), ts in µs since `base_time_ns` (no pid), with the
        counters over the time those steps took, each counter's value at its start included."""
        return self._events(self._snapshot_spans(), first_step, last_step)

    def _events(self, snapshot: dict[str, np.ndarray], first_step: int, last_step: int) -> list[dict[str, Any]]:
        spans = _steps(snapshot, first_step, last_step)
        order = np.argsort(spans["start"], kind="stable")
        events = [self._span_event(spans, int(i)) for i in order]
        if len(order):
            events.extend(self._counter_events(int(spans["start"].min()), int(spans["end"].max())))
            events.sort(key=lambda event: event["ts"])
        return events

    def _lead_in(self, snapshot: dict[str, np.ndarray], first_step: int) -> list[dict[str, Any]]:
        """Arrows started in the LEAD_IN_STEPS global steps before `first_step`, each with the innermost span it
        binds to, both with the arrow's id as `lead_in`: in async training a push is applied global steps after the
        one it was computed at, so the applies in a window consume pushes from before it. merge keeps the lead-in
        events whose arrow ends in the window."""
        spans = _steps(snapshot, first_step - LEAD_IN_STEPS, first_step)
        kind = spans["key"] >> _KIND_SHIFT
        track = (spans["key"] >> _THREAD_SHIFT) & _ID_MASK
        events = []
        for i in np.flatnonzero(kind == FLOW_START).tolist():
            around = np.flatnonzero(
                (kind == SPAN)
                & (track == track[i])
                & (spans["step"] == spans["step"][i])
                & (spans["start"] <= spans["start"][i])
                & (spans["end"] >= spans["start"][i])
            )
            if len(around):
                innermost = int(around[np.argmin(spans["end"][around] - spans["start"][around])])
                for event in (self._span_event(spans, innermost), self._span_event(spans, i)):
                    event["args"]["lead_in"] = int(spans["arg0"][i])
                    events.append(event)
        return events

    def to_role_trace(
        self,
        first_step: int,
        last_step: int,
        clock_offset_us: float,
        clock_error_us: float,
        extra_events: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        """One role's trace; clock_offset_us is added to this role's timestamps to get the chief's clock.

        `extra_events` (torch ops) are kept where they lie within the time of the window's spans: a role that
        starts recording ops before its window (the PS) records more than the window. Arrows started in the
        LEAD_IN_STEPS steps before the window come with the spans they bind to, marked `lead_in` (see `_lead_in`).
        """
        snapshot = self._snapshot_spans()
        events = self._events(snapshot, first_step, last_step)
        spans = [event for event in events if event["ph"] == "X"]
        if spans and extra_events:
            low, high = min(e["ts"] for e in spans), max(e["ts"] + e["dur"] for e in spans)
            events += [e for e in extra_events if low <= e["ts"] and e["ts"] + e.get("dur", 0.0) <= high]
        events += self._lead_in(snapshot, first_step)
        thread_ids = sorted({e["tid"] for e in events if "tid" in e})
        metadata: list[dict[str, Any]] = [
            {"ph": "M", "name": "process_name", "pid": 0, "tid": 0, "args": {"name": self.role}},
            *(
                {"ph": "M", "name": "thread_name", "pid": 0, "tid": tid, "args": {"name": self.thread_names[tid]}}
                for tid in thread_ids
                if tid < len(self.thread_names)
            ),
        ]
        events = [{**event, "pid": 0} for event in events]
        role = {
            "clock_offset_us": clock_offset_us,
            "clock_error_us": clock_error_us,
            "first_step": first_step,
            "last_step": last_step,
            "complete": self._holds_step(first_step),
            **process_info(),
        }
        return {
            "traceEvents": metadata + events,
            "displayTimeUnit": "ms",
            "otherData": {"base_time_ns": self.base_time_ns, "roles": {self.role: role}},
        }

    def thread_id(self, name: str) -> int:
        """The small id of a named thread track, created if new (e.g. for torch ops)."""
        return self._threads[name] if name in self._threads else self._intern_thread(name)

    def _intern_name(self, name: str) -> int:
        with self._intern_lock:
            if name not in self._names:
                self._names[name] = len(self.name_list)
                self.name_list.append(name)
            return self._names[name]

    def _intern_thread(self, key: int | str) -> int:
        with self._intern_lock:
            if key not in self._threads:
                if isinstance(key, str):
                    self.thread_names.append(key)
                    self.thread_native_ids.append(-1)
                else:
                    self.thread_names.append(threading.current_thread().name)
                    self.thread_native_ids.append(threading.get_native_id())
                self._threads[key] = len(self.thread_names) - 1
            return self._threads[key]

    def _snapshot_spans(self) -> dict[str, np.ndarray]:
        """The filled slots as columns; key = name id | thread id << 20 | kind << 40."""
        entries = [entry for entry in self._ring[:] if entry is not None]  # the slice is one atomic copy
        if not entries:
            return {column: np.zeros(0, dtype=np.int64) for column in ("key", "step", "start", "end", "arg0", "arg1")}
        names, keys, step, start, end, arg0, arg1 = zip(*entries, strict=True)
        name_ids = np.array([self._name_id(name) for name in names], dtype=np.int64)
        return {
            "key": name_ids | np.array(keys, dtype=np.int64) << _THREAD_SHIFT,
            "step": np.array(step, dtype=np.int64),
            "start": np.array(start, dtype=np.int64),
            "end": np.array(end, dtype=np.int64),
            "arg0": np.array(arg0, dtype=np.int64),
            "arg1": np.array(arg1, dtype=np.int64),
        }

    def _name_id(self, name: str) -> int:
        name_id = self._names.get(name)
        return self._intern_name(name) if name_id is None else name_id

    def _holds_step(self, step: int) -> bool:
        """True unless the ring wrapped over events of `step` or earlier."""
        ring = self._ring[:]
        if any(entry is None for entry in ring):
            return True
        return min(entry[2] for entry in ring if entry is not None) < step

    def _us(self, perf_ns: int) -> float:
        return round((perf_ns - self._anchor_perf_ns) / 1000, 3)

    def _span_event(self, spans: dict[str, np.ndarray], i: int) -> dict[str, Any]:
        key = int(spans["key"][i])
        name = self.name_list[key & _ID_MASK]
        tid = (key >> _THREAD_SHIFT) & _ID_MASK
        kind = key >> _KIND_SHIFT
        step = int(spans["step"][i])
        start = int(spans["start"][i])
        if kind != SPAN:
            phase = {"ph": "s"} if kind == FLOW_START else {"ph": "f", "bp": "e"}
            args = {"step": step}
            return {
                **phase,
                "name": name,
                "cat": "flow",
                "id": int(spans["arg0"][i]),
                "ts": self._us(start),
                "tid": tid,
                "args": args,
            }
        args = {"step": step}
        arg_names = ARG_NAMES.get(name, ("arg0", "arg1"))
        for arg_name, value in zip(arg_names, (int(spans["arg0"][i]), int(spans["arg1"][i])), strict=True):
            if value != -1:
                args[arg_name] = value
        duration = round((int(spans["end"][i]) - start) / 1000, 3)
        return {
            "ph": "X",
            "name": name,
            "cat": "span",
            "ts": self._us(start),
            "dur": duration,
            "tid": tid,
            "args": args,
        }

    def _counter_events(self, start_ns: int, end_ns: int) -> list[dict[str, Any]]:
        """Samples between start_ns and end_ns, and for each counter the last one before start_ns, moved to it: a
        counter holds its value until the next sample, and a short window may fall between two samples."""
        samples = sorted((entry for entry in self._counters[:] if entry is not None), key=lambda entry: entry[1])
        before = {name: (name, start_ns, value) for name, ts, value in samples if ts < start_ns}
        inside = [entry for entry in samples if start_ns <= entry[1] <= end_ns]
        return [
            {"ph": "C", "name": name, "ts": self._us(ts), "args": {"value": value}}
            for name, ts, value in [*before.values(), *inside]
        ]


def _steps(spans: dict[str, np.ndarray], first_step: int, last_step: int) -> dict[str, np.ndarray]:
    keep = (spans["step"] >= first_step) & (spans["step"] < last_step)
    return {column: values[keep] for column, values in spans.items()}


class _Span:
    __slots__ = ("_arg0", "_arg1", "_name", "_recorder", "_start", "_step")

    def __init__(self, recorder: SpanRecorder, name: str, step: int, arg0: int, arg1: int) -> None:
        self._recorder, self._name, self._step, self._arg0, self._arg1 = recorder, name, step, arg0, arg1
        self._start = 0

    def __enter__(self) -> None:
        self._start = time.perf_counter_ns()

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self._recorder.end(self._name, self._step, self._start, self._arg0, self._arg1)


_recorder: SpanRecorder | None = None


def get_recorder() -> SpanRecorder | None:
    """The process's recorder, or None where profiling is off: `if (r := get_recorder()) is not None: ...`."""
    return _recorder


def set_recorder(recorder: SpanRecorder | None) -> None:
    global _recorder
    _recorder = recorder


def process_info() -> dict[str, Any]:
    """Where this process runs, for the diagnosis to tell when the cores of a host are the limit: the host, the
    process, the host's CPUs and the ones this process may run on (its affinity, as set by taskset or a cgroup)."""
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "cpu_count": os.cpu_count() or 1,
        "cpus": sorted(usable_cpus()),
    }


def usable_cpus() -> set[int]:
    """The CPUs this process may run on: its affinity (taskset, a cgroup's cpuset), else all of them."""
    return os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))


def flow_id(sender: str, seq: int) -> int:
    """The id of the flow arrow from a push to the apply that consumed it; both ends derive it from the
    request's (sender, sequence). Kept below 2**53 so JSON readers hold it exactly."""
    return (zlib.crc32(sender.encode()) << 20) | (seq & 0xFFFFF)
