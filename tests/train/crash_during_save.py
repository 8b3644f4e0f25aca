"""Crash a checkpoint save at every filesystem operation: `python crash_during_save.py MODE BASE_DIR`.

For k = 0, 1, 2, ... a forked child saves step 1 in BASE_DIR/<k>, then (MODE "new-step") saves step 2 or
(MODE "same-step") saves step 1 again with other values, and hard-exits (os._exit, as SIGKILL would) right before
or right after its k-th filesystem operation. The loop ends with the first k at which the save completes. Prints one
JSON line per k: {"model_dir", "crashed_at"} (crashed_at is None for the completed save).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from shardflow.train.checkpoints import store

CRASHED = 17
# Each is wrapped so that the process can die on either side of it; rmtree's own unlink and rmdir calls count too.
OPERATIONS: list[tuple[Any, str]] = [
    (os, "mkdir"),
    (os, "open"),
    (os, "write"),
    (os, "fsync"),
    (os, "rename"),
    (os, "replace"),
    (os, "unlink"),
    (os, "rmdir"),
    (shutil, "rmtree"),
    (store, "save_file"),
]


def crash_at(k: int, note: Path) -> None:
    """Make the k-th crash point of this process exit at once, writing where it was to `note`."""
    count = 0

    def point(where: str) -> None:
        nonlocal count
        if count == k:
            note.write_text(where)  # builtins.open, not one of the wrapped calls
            os._exit(CRASHED)
        count += 1

    def wrap(name: str, function: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            point(f"before {name}")
            result = function(*args, **kwargs)
            point(f"after {name}")
            return result

        return wrapper

    for module, name in OPERATIONS:
        setattr(module, name, wrap(name, getattr(module, name)))


def run_once(mode: str, model_dir: Path, k: int) -> str | None:
    note = model_dir.parent / f"{model_dir.name}.crash"
    pid = os.fork()
    if pid == 0:
        try:
            store.save(model_dir, 1, {"w": torch.full((64,), 1.0)}, {"written": "first"})
            crash_at(k, note)
            if mode == "new-step":
                store.save(model_dir, 2, {"w": torch.full((64,), 2.0)}, {"written": "second"})
            else:
                store.save(model_dir, 1, {"w": torch.full((64,), 3.0)}, {"written": "second"})
        except BaseException as error:  # an error is a failure of the test, not a crash
            print(f"save failed: {error!r}", file=sys.stderr)
            os._exit(1)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    if code == CRASHED:
        return note.read_text()
    if code != 0:
        raise SystemExit(f"the child saving with crash point {k} failed with status {code}")
    return None


def main() -> None:
    mode, base = sys.argv[1], Path(sys.argv[2])
    for k in range(1000):
        model_dir = base / str(k)
        crashed_at = run_once(mode, model_dir, k)
        print(json.dumps({"model_dir": str(model_dir), "crashed_at": crashed_at}), flush=True)
        if crashed_at is None:
            return
    raise SystemExit("the save never completed in 1000 crash points")


if __name__ == "__main__":
    main()
