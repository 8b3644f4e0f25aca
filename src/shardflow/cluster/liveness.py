"""A role's liveness file: its heartbeat thread touches it every beat (train/heartbeat.py). A supervisor that finds
it older than its deadline takes the role for hung (alive but silent: stopped, deadlocked, swapped out) and kills
it, so that it is restarted: the local launcher (cluster/launcher.py), or a cluster manager's liveness probe that
tests the file's age (deploy/jobset.yaml, deploy/tfjob.yaml). A kill is the only cure a supervisor has for a process
that is alive: nothing else restarts it."""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

HUNG_TIMEOUT_S = 30.0
"""How long a role's liveness file may go untouched before its supervisor kills it, by default: three times the
heartbeat_timeout_s after which the chief names it lost, so that a role that stalls briefly comes back by itself."""


def touch(path: str | os.PathLike[str]) -> None:
    """Marks the role alive now; a file that cannot be written (its directory removed at the job's end) is no
    reason to stop beating."""
    with contextlib.suppress(OSError):
        Path(path).touch()


def silent_for(path: str | os.PathLike[str]) -> float | None:
    """Seconds since the role last touched `path`; None while it has not (a role still starting is not judged by
    this: startup_timeout_s is its deadline)."""
    try:
        return max(0.0, time.time() - os.stat(path).st_mtime)
    except OSError:
        return None


def forget(path: str | os.PathLike[str]) -> None:
    """Removes a role's file before its process is started again, so that the new process is not judged by the
    silence of the one it replaces."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
