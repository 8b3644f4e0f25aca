"""A local cluster's private directory for its roles' UNIX sockets and liveness files, and the clean-up of the ones
launchers that are gone left behind."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

RUNTIME_DIR_PREFIX = "shardflow-"
_OWNER_FILE = "launcher.pid"


def make_runtime_dir() -> str:
    """A fresh directory for a local cluster's UNIX sockets (a PS serves this machine's roles there as well as over
    TCP), private to this user (mkdtemp makes it 0700); the launcher removes it when it stops. A launcher that was
    SIGKILLed could not: first the directories of this user's launchers that are gone are removed."""
    for path in Path(tempfile.gettempdir()).glob(RUNTIME_DIR_PREFIX + "*"):
        with contextlib.suppress(OSError, ValueError):
            if path.stat().st_uid == os.getuid() and not _alive(int((path / _OWNER_FILE).read_text())):
                shutil.rmtree(path, ignore_errors=True)
    made = tempfile.mkdtemp(prefix=RUNTIME_DIR_PREFIX)
    (Path(made) / _OWNER_FILE).write_text(str(os.getpid()))
    return made


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
