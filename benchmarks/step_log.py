"""Global steps/s in the steady state, from the step logs that benchmark jobs write: each worker's list of
[perf_counter, global step] after every step (perf_counter is the machine's monotonic clock, shared by processes)."""

from __future__ import annotations

import json
from pathlib import Path


def read_step_logs(prefix: str) -> list[list[list[float]]]:
    """Each worker's log, PREFIX.<worker index>, removed once read."""
    logs = []
    for path in sorted(Path(prefix).parent.glob(f"{Path(prefix).name}.*")):
        logs.append(json.loads(path.read_text()))
        path.unlink()
    return logs


def steady_steps_per_s(logs: list[list[list[float]]], warmup_steps: int) -> float:
    """Global steps/s from the moment every worker has made `warmup_steps` steps to the last step of any, as the
    peers time theirs after untimed warm-up steps."""
    started = max(log[min(warmup_steps, len(log) - 1)][0] for log in logs)
    after = sorted(entry for log in logs for entry in log if entry[0] >= started)
    (t0, step0), (t1, step1) = after[0], max(after, key=lambda entry: entry[1])
    return (step1 - step0) / (t1 - t0)
