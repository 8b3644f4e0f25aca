"""Always-on span recorder: a fixed-size ring of spans, flows and counters per process."""

from __future__ import annotations

import itertools
import threading
import time
import zlib
from types import TracebackType
from typing import Any

import numpy as np

from shardflow.profile.spans import ARG_NAMES

get_ident = threading.get_ident

SPAN, FLOW_START, FLOW_END = 0, 1, 2
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

    def flow(self, name: str, step: int, flow_id: int, start: bool, thread: str | None = None) -> None:
        """Call inside the span the arrow binds to (same thread): the push (start=True) or the apply (start=False)."""
        now = time.perf_counter_ns()
        thread_key: int | str = get_ident() if thread is None else thread
        thread_id = self._threads.get(thread_key)
        thread_id = self._intern_thread(thread_key) if thread_id is None else thread_id
        key = thread_id | (FLOW_START if start else FLOW_END) << _THREAD_SHIFT
        self._ring[next(self._next) & self._mask] = (name, key, step, now, now, flow_id, -1)

    def counter(self, name: str, value: float) -> None:
        self._counters[next(self._next_counter) & self._mask] = (name, time.perf_counter_ns(), value)

    def events(self, first_step: int, last_step: int) -> list[dict[str, Any]]:
        """Chrome-trace dicts for steps [first_step, last_step), ts in µs since `base_time_ns` (no pid)."""
        spans = self._snapshot_spans()
        keep = (spans["step"] >= first_step) & (spans["step"] < last_step)
        spans = {column: values[keep] for column, values in spans.items()}
        order = np.argsort(spans["start"], kind="stable")
        events = [self._span_event(spans, int(i)) for i in order]
        if len(order):
            events.extend(self._counter_events(int(spans["start"].min()), int(spans["end"].max())))
            events.sort(key=lambda event: event["ts"])
        return events

    def to_role_trace(
        self,
        first_step: int,
        last_step: int,
        clock_offset_us: float,
        clock_error_us: float,
        extra_events: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        """One role's trace; clock_offset_us is added to this role's timestamps to get the chief's clock."""
        events = self.events(first_step, last_step) + list(extra_events or [])
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
        inside = sorted(
            (entry for entry in self._counters[:] if entry is not None and start_ns <= entry[1] <= end_ns),
            key=lambda entry: entry[1],
        )
        return [{"ph": "C", "name": name, "ts": self._us(ts), "args": {"value": value}} for name, ts, value in inside]


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


def flow_id(sender: str, seq: int) -> int:
    """The id of the flow arrow from a push to the apply that consumed it; both ends derive it from the
    request's (sender, sequence). Kept below 2**53 so JSON readers hold it exactly."""
    return (zlib.crc32(sender.encode()) << 20) | (seq & 0xFFFFF)
