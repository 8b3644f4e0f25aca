"""Where captures live under MODEL_DIR/profile/<capture>/ and how the per-role files become one table."""

from __future__ import annotations

from pathlib import Path

from shardflow.profile.events import build_table
from shardflow.profile.merge import merge
from shardflow.profile.trace import read_trace

MERGED = "merged.trace.json.gz"
EVENTS = "events.parquet"


class CaptureNotFoundError(FileNotFoundError):
    pass


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


def finalize(directory: str | Path) -> Path:
    """Merges the role files of a capture (if not yet merged) and builds its events table; returns the table."""
    directory = Path(directory)
    merged, events = directory / MERGED, directory / EVENTS
    if not merged.exists():
        role_files = sorted(p for p in directory.glob("*.trace.json.gz") if p.name != MERGED)
        if not role_files:
            raise CaptureNotFoundError(f"no role traces (*.trace.json.gz) in {directory}")
        merge([read_trace(p) for p in role_files], merged)
    if not events.exists() or events.stat().st_mtime < merged.stat().st_mtime:
        build_table(merged, events)
    return events
