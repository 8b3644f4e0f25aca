"""Faults on purpose, for the tests and `make faults` that prove the survival claims: SIGKILL at an exact moment
that a test could not hit from outside (between a worker's pushes to two PS, inside a PS's update, inside a
checkpoint save).

`SHARDFLOW_FAULT` is JSON: {"role": "worker:1", "point": "push", "step": 7, "marker": "<file>"}. The process of
that role SIGKILLs itself when it reaches `point` at `step` (without "step": at any), once per job: it first creates
`marker`, and a process that finds the marker (the same role, restarted) goes on. The points:

- `push`: a worker, in the push of its own step `step`, after ps:0 got it and before any other PS did.
- `apply`: a PS, while it applies the update that makes global step `step`.
- `checkpoint`: the chief, while it saves the checkpoint of global step `step`, its files written but not yet
  renamed into place.
- `state`, `stop`, `lost`: a PS at global step `step`, as the chief asks it for its state now (not a snapshot: the
  final checkpoint's), to stop training (preemption, early stopping), or tells it a worker is lost; before it
  answers.
- `snapshot`, `snapshot_state`: a PS, as it is asked to snapshot its state at global step `step` (sf.HybridStrategy's
  worker:0 asks, for each state it hands over), or as the chief asks it for that snapshot; before it answers.

Unset (always, outside such tests), each check is one dictionary lookup.
"""

from __future__ import annotations

import json
import os
import signal
import time
from functools import cache
from typing import Any

from shardflow import env

POINTS = ("push", "apply", "checkpoint", "state", "hold", "stop", "lost", "snapshot", "snapshot_state")


@cache
def _fault() -> dict[str, Any] | None:
    value = env.get(env.FAULT)
    if value is None:
        return None
    try:
        fault = json.loads(value)
        if fault["point"] not in POINTS:
            raise ValueError(f"point must be one of {POINTS}")
        return {
            "role": str(fault["role"]),
            "point": fault["point"],
            "step": int(fault["step"]) if "step" in fault else None,
            "marker": fault["marker"],
        }
    except (ValueError, KeyError, TypeError) as error:
        raise ValueError(f"{env.FAULT}={value!r}: expected JSON with role, point, step and marker ({error})") from None


def reached(point: str, role: str, step: int) -> None:
    """SIGKILL this process if `SHARDFLOW_FAULT` names this point, role and step, and it has not fired yet."""
    fault = _fault()
    if fault is None or (fault["point"], fault["role"]) != (point, role) or fault["step"] not in (None, step):
        return
    try:
        os.close(os.open(fault["marker"], os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return  # fired already, in an earlier run of this role
    # What was sent before this point leaves the process (ZeroMQ sends from a thread of its own) before it dies.
    time.sleep(0.1)
    os.kill(os.getpid(), signal.SIGKILL)
