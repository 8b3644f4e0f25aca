"""A simulated async PS cluster recorded with real SpanRecorders on fake clocks, for tests that need known timings.

Workers loop input_wait -> forward -> backward -> push to every PS -> pull_wait; each PS applies one push at a
time on its handler thread, so a PS with more work than time makes workers wait in pull_wait.
"""

from __future__ import annotations

import contextlib
import heapq
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from shardflow.profile import recorder as recorder_module
from shardflow.profile import spans
from shardflow.profile.recorder import SpanRecorder

EPOCH_NS = 1_700_000_000_000_000_000


class FakeTime:
    """Stands in for the `time` module inside the recorder: perf_counter_ns is true time, time_ns is skewed."""

    def __init__(self, skew_ns: int = 0, perf_origin_ns: int = 5_000_000_000) -> None:
        self.now_ns = 0
        self.skew_ns = skew_ns
        self.perf_origin_ns = perf_origin_ns

    def perf_counter_ns(self) -> int:
        return self.perf_origin_ns + self.now_ns

    def time_ns(self) -> int:
        return EPOCH_NS + self.now_ns + self.skew_ns


@contextlib.contextmanager
def fake_time(clock: FakeTime) -> Iterator[FakeTime]:
    real = vars(recorder_module)["time"]
    setattr(recorder_module, "time", clock)  # noqa: B010 (the module's `time` is not exported, so mypy would refuse it)
    try:
        yield clock
    finally:
        setattr(recorder_module, "time", real)  # noqa: B010


def record(
    recorder: SpanRecorder, clock: FakeTime, name: str, step: int, start_us: float, dur_us: float, **kwargs: Any
) -> None:
    with fake_time(clock):
        clock.now_ns = round(start_us * 1000)
        token = recorder.begin(name, step)
        clock.now_ns = round((start_us + dur_us) * 1000)
        recorder.end(name, step, token, kwargs.get("arg0", -1), kwargs.get("arg1", -1), kwargs.get("thread"))


def flow(
    recorder: SpanRecorder,
    clock: FakeTime,
    name: str,
    step: int,
    at_us: float,
    flow_id: int,
    start: bool,
    thread: str | None = None,
) -> None:
    with fake_time(clock):
        clock.now_ns = round(at_us * 1000)
        recorder.flow(name, step, flow_id, start, thread)


@dataclass
class Cluster:
    num_workers: int = 2
    num_ps: int = 1
    num_steps: int = 20
    input_us: float = 100
    compute_us: float = 800
    push_us: float = 20
    apply_us: float = 50
    reply_us: float = 10
    bytes_per_ps: int = 1_000_000
    skew_us: dict[str, float] = field(default_factory=dict)
    """Role -> how far its wall clock runs ahead of the chief's."""

    def role_traces(self) -> list[dict]:
        roles = ["chief"] + [f"worker:{w}" for w in range(self.num_workers)] + [f"ps:{p}" for p in range(self.num_ps)]
        clocks = {role: FakeTime(round(self.skew_us.get(role, 0) * 1000)) for role in roles}
        recorders = {}
        for role in roles:
            with fake_time(clocks[role]):
                recorders[role] = SpanRecorder(role)
        self._run(recorders, clocks)
        return [recorders[role].to_role_trace(0, self.num_steps, -self.skew_us.get(role, 0.0), 5.0) for role in roles]

    def _run(self, recorders: dict[str, SpanRecorder], clocks: dict[str, FakeTime]) -> None:
        ps_free = [0.0] * self.num_ps
        ready = [(0.0, w) for w in range(self.num_workers)]  # (time the worker starts its next step, worker)
        for step in range(self.num_steps):
            t, w = heapq.heappop(ready)
            rec, clock = recorders[f"worker:{w}"], clocks[f"worker:{w}"]
            phases = [
                (spans.INPUT_WAIT, self.input_us),
                (spans.FORWARD, self.compute_us / 3),
                (spans.BACKWARD, 2 * self.compute_us / 3),
            ]
            start = t
            for name, duration in phases:
                record(rec, clock, name, step, t, duration)
                t += duration
            replies = []
            for p in range(self.num_ps):
                flow_id = step * 1000 + p
                record(rec, clock, spans.PUSH, step, t, self.push_us, arg0=p, arg1=self.bytes_per_ps)
                flow(rec, clock, spans.PUSH, step, t + self.push_us / 2, flow_id, True)
                t += self.push_us
                replies.append(self._serve(recorders, clocks, p, w, step, t, flow_id, ps_free))
            end = max(replies)
            record(rec, clock, spans.PULL_WAIT, step, t, end - t, arg0=0)
            record(rec, clock, spans.STEP, step, start, end - start)
            with fake_time(clock):
                rec.counter("memory.rss", 100e6 + step * 1e6)
            heapq.heappush(ready, (end, w))
            if step % 10 == 9:
                record(recorders["chief"], clocks["chief"], spans.CHECKPOINT, step, end, 200)

    def _serve(
        self, recorders, clocks, p: int, w: int, step: int, arrival: float, flow_id: int, ps_free: list[float]
    ) -> float:
        rec, clock = recorders[f"ps:{p}"], clocks[f"ps:{p}"]
        record(rec, clock, spans.RECEIVE, step, arrival, 5, arg0=w, arg1=self.bytes_per_ps, thread="receiver")
        begin = max(arrival + 5, ps_free[p])
        record(rec, clock, spans.APPLY, step, begin, self.apply_us, arg0=w, arg1=self.bytes_per_ps, thread="handler")
        flow(rec, clock, spans.APPLY, step, begin + self.apply_us / 2, flow_id, False, thread="handler")
        record(rec, clock, spans.REPLY, step, begin + self.apply_us, self.reply_us, arg0=w, thread="handler")
        ps_free[p] = begin + self.apply_us + self.reply_us
        return ps_free[p]
