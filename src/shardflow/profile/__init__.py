"""Cluster-wide profiler: span recorder, clock alignment, merged traces, analysis and report."""

from __future__ import annotations

from typing import TYPE_CHECKING

from shardflow._lazy import lazy_dir, lazy_getattr
from shardflow.profile.clock import ClockEstimate, estimate_offset
from shardflow.profile.recorder import SpanRecorder, get_recorder, set_recorder

if TYPE_CHECKING:
    from shardflow.profile.capture import capture_dir, finalize
    from shardflow.profile.memory import MemorySampler
    from shardflow.profile.merge import cut, merge
    from shardflow.profile.torch_ops import OpCapture
    from shardflow.profile.trace import write_trace

# Imported on first use: the runtime imports this package in every role for the recorder alone.
_LAZY = {
    "MemorySampler": "shardflow.profile.memory",
    "OpCapture": "shardflow.profile.torch_ops",
    "capture_dir": "shardflow.profile.capture",
    "cut": "shardflow.profile.merge",
    "finalize": "shardflow.profile.capture",
    "merge": "shardflow.profile.merge",
    "write_trace": "shardflow.profile.trace",
}

__all__ = [
    "ClockEstimate",
    "MemorySampler",
    "OpCapture",
    "SpanRecorder",
    "capture_dir",
    "cut",
    "estimate_offset",
    "finalize",
    "get_recorder",
    "merge",
    "set_recorder",
    "write_trace",
]


__getattr__ = lazy_getattr(__name__, _LAZY)
__dir__ = lazy_dir(__name__, _LAZY)
