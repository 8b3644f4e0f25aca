"""A role's liveness file: a thread of the role's own touches it every second, from the role's start to its end
(`keep_touching`). A supervisor that finds it older than its deadline takes the role for hung (alive but silent:
stopped, frozen, swapped out) and kills it, so that it is restarted: the local launcher (cluster/launcher.py), which
judges a role from the moment it started it, or a cluster manager's liveness probe that tests the file's age
(deploy/jobset.yaml, deploy/tfjob.yaml). A kill is the only cure a supervisor has for a process that is alive:
nothing else restarts it."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from pathlib import Path

from shardflow import env

HUNG_TIMEOUT_S = 30.0
"""How long a role's liveness file may go untouched before its supervisor kills it, by default: three times the
heartbeat_timeout_s after which the chief names it lost, so that a role that stalls briefly comes back by itself."""
INTERVAL_S = 1.0
"""How often a role touches its liveness file."""

_touched: set[str] = set()
_touched_lock = threading.Lock()


def keep_touching(interval_s: float = INTERVAL_S) -> None:
    """Touches this process's liveness file (`SHARDFLOW_LIVENESS_FILE`; nothing when unset) now and every
    `interval_s` from a daemon thread that does nothing else, until the process ends; once per process. So a chief
    slow to answer, or a long step, never makes a live role look hung, while a stopped or frozen process falls
    silent."""
    path = env.get(env.LIVENESS_FILE)
    if path is None:
        return
    with _touched_lock:
        if path in _touched:
            return
        _touched.add(path)
    touch(path)
    threading.Thread(target=_touch_every, args=(path, interval_s), name="liveness", daemon=True).start()


def _touch_every(path: str, interval_s: float) -> None:
    while True:
        time.sleep(interval_s)
        touch(path)


def touch(path: str | os.PathLike[str]) -> None:
    """Marks the role alive now; a file that cannot be written (its directory removed at the job's end) is no
    reason to stop beating."""
    with contextlib.suppress(OSError):
        Path(path).touch()


def silent_for(path: str | os.PathLike[str]) -> float | None:
    """Seconds since `path` was last touched; None while there is none (a role a cluster manager started that has
    not touched it yet: its probe passes; the local launcher touches it as it starts the role)."""
    try:
        return max(0.0, time.time() - os.stat(path).st_mtime)
    except OSError:
        return None


def forget(path: str | os.PathLike[str]) -> None:
    """Removes a role's file once its supervisor killed it, so that it is killed once per hang."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
