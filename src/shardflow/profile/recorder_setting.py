"""Which recorder a role runs, from `SHARDFLOW_RECORDER`: on (the default), off, or alternate:N.

"off" and "alternate:N" exist to measure what the always-on recorder costs a real run
(benchmarks/profiler_overhead.py).
"""

from __future__ import annotations

from shardflow import env
from shardflow.profile.recorder import SpanRecorder


class NoRecorder(SpanRecorder):
    """Records nothing, at the cost of a method call."""

    def __init__(self, role: str) -> None:
        super().__init__(role, capacity=1)

    def end(self, name: str, step: int, start: int, arg0: int = -1, arg1: int = -1, thread: str | None = None) -> None:
        return None

    def flow(
        self, name: str, step: int, flow_id: int, start: bool, thread: str | None = None, at_ns: int | None = None
    ) -> None:
        return None


class AlternatingRecorder(SpanRecorder):
    """Records in blocks of `block` global steps with an even block number and drops everything in the others, so
    one run measures its steps with and without recording under the same load. Off, it costs what NoRecorder
    does plus an attribute test; on, that test is extra (the overhead measured is a little above the real one)."""

    def __init__(self, role: str, block: int) -> None:
        super().__init__(role)
        self.block = block
        self.on = True

    def at_step(self, step: int) -> None:
        self.on = (step // self.block) % 2 == 0

    def end(self, name: str, step: int, start: int, arg0: int = -1, arg1: int = -1, thread: str | None = None) -> None:
        if self.on:
            super().end(name, step, start, arg0, arg1, thread)

    def flow(
        self, name: str, step: int, flow_id: int, start: bool, thread: str | None = None, at_ns: int | None = None
    ) -> None:
        if self.on:
            super().flow(name, step, flow_id, start, thread, at_ns)


def make_recorder(role: str) -> SpanRecorder:
    """The recorder `SHARDFLOW_RECORDER` asks for; an error names the variable and its choices."""
    setting = env.get(env.RECORDER) or "on"
    kind, _, block = setting.partition(":")
    if setting == "off":
        return NoRecorder(role)
    if kind == "alternate" and block.isdigit():
        return AlternatingRecorder(role, max(1, int(block)))
    if setting != "on":
        raise ValueError(f"{env.RECORDER}={setting!r}: use on, off or alternate:N (blocks of N global steps)")
    return SpanRecorder(role)
