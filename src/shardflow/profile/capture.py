"""Where captures live under MODEL_DIR/profile/<capture>/, and how the roles' traces become its merged trace and
its events table."""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from shardflow.profile.merge import merge
from shardflow.profile.trace import write_trace

MERGED = "merged.trace.json.gz"
EVENTS = "events.parquet"


class CaptureNotFoundError(FileNotFoundError):
    pass


def check_steps(steps: Sequence[int], what: str = "profile_steps") -> tuple[int, int]:
    """`steps` as (first, last), the global steps [first, last) of a capture; a ValueError naming `what` unless
    0 <= first < last."""
    if len(steps) != 2 or not 0 <= steps[0] < steps[1]:
        raise ValueError(f"{what} must be (first, last) with 0 <= first < last, got {tuple(steps)}")
    return int(steps[0]), int(steps[1])


CAPTURE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,99}")
"""What a capture may be called: it becomes a directory under model_dir/profile, and nothing may lead outside."""


def check_capture_name(name: object) -> str:
    """`name` if it is a valid capture name; else a ValueError saying what is allowed."""
    if not isinstance(name, str) or not CAPTURE_NAME.fullmatch(name):
        raise ValueError(
            f"a capture name is 1 to 100 letters, digits, '_' or '-', starting with a letter or digit; got {name!r}"
        )
    return name


def capture_dir(model_dir: str | Path, name: str | None = None) -> Path:
    """The named capture, or the latest one (by modification time) when name is None."""
    root = Path(model_dir) / "profile"
    if name is not None:
        path = root / name
        if not path.is_dir():
            raise CaptureNotFoundError(f"no capture {name!r} in {root}")
        return path
    captures = [p for p in root.glob("*/") if any(p.glob("*.trace.json.gz"))] if root.is_dir() else []
    if not captures:
        raise CaptureNotFoundError(
            f"no capture in {root}: run with Estimator(..., profile_steps=(a, b)) or `shardflow profile capture`"
        )
    return max(captures, key=lambda p: (max(f.stat().st_mtime for f in p.iterdir()), p.name))


def write_capture(role_traces: list[dict[str, Any]], directory: str | Path) -> Path:
    """Merges the roles' traces (one dict per role) and writes the merged trace and its events table, both from
    the merged events in memory; returns the directory."""
    from shardflow.profile.events import write_table  # pyarrow: 0.3-0.4 s of every role's start-up otherwise

    directory = Path(directory)
    merged = merge(role_traces)
    write_trace(merged, directory / MERGED)
    write_table(merged["traceEvents"], directory / EVENTS, merged["otherData"])
    return directory


def finalize(directory: str | Path) -> Path:
    """The events table of a capture, rebuilt from its merged trace when missing or older; returns its path."""
    from shardflow.profile.events import build_table

    directory = Path(directory)
    merged, events = directory / MERGED, directory / EVENTS
    if not merged.exists():
        raise CaptureNotFoundError(f"no merged trace ({MERGED}) in {directory}")
    if not events.exists() or events.stat().st_mtime < merged.stat().st_mtime:
        try:
            build_table(merged, events)
        except (ValueError, EOFError, OSError) as error:  # a truncated gzip ends early; bad bytes decode to nothing
            raise ValueError(f"{merged} is not a readable trace ({error}); capture the run again") from None
    return events
