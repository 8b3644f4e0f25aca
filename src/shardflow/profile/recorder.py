"""Always-on span recorder: a fixed-size ring of spans, flows and counters per process."""

from __future__ import annotations

import itertools
import threading
import time
import zlib
from array import array
from types import TracebackType
from typing import Any

import numpy as np

# What the two integer arguments of a span mean, by span name; other spans call them arg0 and arg1.
ARG_NAMES: dict[str, tuple[str, str]] = {
    "push": ("ps", "bytes"),
    "pull_wait": ("ps", "bytes"),
    "receive": ("worker", "bytes"),
    "queue": ("worker", "bytes"),
    "apply": ("worker", "bytes"),
    "reply": ("worker", "bytes"),
}
SPAN, FLOW_START, FLOW_END = 0, 1, 2
_THREAD_SHIFT, _KIND_SHIFT = 20, 40
_ID_MASK = (1 << _THREAD_SHIFT) - 1


class SpanRecorder:
    """Records spans of one role into preallocated arrays; the oldest entries are overwritten when full.

    Timestamps are `time.perf_counter_ns()` values; `base_time_ns` is the wall clock (`time.time_ns()`)
    at construction, and exported timestamps are microseconds since then, which keeps ns precision.
    """

    def __init__(self, role: str, capacity: int = 1 << 17) -> None:
        if capacity <= 0 or capacity & (capacity - 1):
            raise ValueError(f"capacity must be a power of two, got {capacity}")
        self.role = role
        self.capacity = capacity
        self._mask = capacity - 1
        # The midpoint of two perf readings around the wall reading pairs the two clocks most closely.
        before = time.perf_counter_ns()
        self.base_time_ns = time.time_ns()
        self._anchor_perf_ns = (before + time.perf_counter_ns()) // 2
        # key = name id | thread id << 20 | kind << 40, so one write stores all three.
        self._key, self._step, self._start, self._end, self._arg0, self._arg1 = (
            array("q", bytes(8 * capacity)) for _ in range(6)
        )
        self._counter_key, self._counter_ts = array("q", bytes(8 * capacity)), array("q", bytes(8 * capacity))
        self._counter_value = array("d", bytes(8 * capacity))
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
        try:
            name_id = self._names[name]
        except KeyError:
            name_id = self._intern_name(name)
        thread_key: int | str = threading.get_ident() if thread is None else thread
        try:
            thread_id = self._threads[thread_key]
        except KeyError:
            thread_id = self._intern_thread(thread_key)
        i = next(self._next) & self._mask
        self._key[i] = name_id | thread_id << _THREAD_SHIFT
        self._step[i] = step
        self._start[i] = start
        self._end[i] = now
        self._arg0[i] = arg0
        self._arg1[i] = arg1

    def span(self, name: str, step: int, arg0: int = -1, arg1: int = -1) -> _Span:
        return _Span(self, name, step, arg0, arg1)

    def flow(self, name: str, step: int, flow_id: int, start: bool, thread: str | None = None) -> None:
        """Call inside the span the arrow binds to (same thread): the push (start=True) or the apply (start=False)."""
        now = time.perf_counter_ns()
        name_id = self._names.get(name)
        name_id = self._intern_name(name) if name_id is None else name_id
        thread_key: int | str = threading.get_ident() if thread is None else thread
        thread_id = self._threads.get(thread_key)
        thread_id = self._intern_thread(thread_key) if thread_id is None else thread_id
        kind = FLOW_START if start else FLOW_END
        i = next(self._next) & self._mask
        self._key[i] = name_id | thread_id << _THREAD_SHIFT | kind << _KIND_SHIFT
        self._step[i] = step
        self._start[i] = self._end[i] = now
        self._arg0[i] = flow_id
        self._arg1[i] = -1

    def counter(self, name: str, value: float) -> None:
        now = time.perf_counter_ns()
        try:
            name_id = self._names[name]
        except KeyError:
            name_id = self._intern_name(name)
        i = next(self._next_counter) & self._mask
        self._counter_key[i] = name_id
        self._counter_ts[i] = now
        self._counter_value[i] = value

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
        """A copy of the filled slots; perf_counter_ns is never 0, so an empty slot has end == 0."""
        columns = {
            "key": self._key,
            "step": self._step,
            "start": self._start,
            "end": self._end,
            "arg0": self._arg0,
            "arg1": self._arg1,
        }
        spans = {column: np.frombuffer(values, dtype=np.int64).copy() for column, values in columns.items()}
        filled = spans["end"] != 0
        return {column: values[filled] for column, values in spans.items()}

    def _holds_step(self, step: int) -> bool:
        """True unless the ring wrapped over events of `step` or earlier."""
        if not np.frombuffer(self._end, dtype=np.int64).all():
            return True
        return bool(np.frombuffer(self._step, dtype=np.int64).min() < step)

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
        ts = np.frombuffer(self._counter_ts, dtype=np.int64).copy()
        keys = np.frombuffer(self._counter_key, dtype=np.int64).copy()
        values = np.frombuffer(self._counter_value, dtype=np.float64).copy()
        inside = np.flatnonzero((ts >= start_ns) & (ts <= end_ns) & (ts != 0))
        inside = inside[np.argsort(ts[inside], kind="stable")]
        return [
            {
                "ph": "C",
                "name": self.name_list[int(keys[i])],
                "ts": self._us(int(ts[i])),
                "args": {"value": float(values[i])},
            }
            for i in inside
        ]


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
