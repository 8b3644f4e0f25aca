"""Commands run as a user pastes them into a new terminal: bash, with a PATH that does not hold the virtual
environment running the tests, so `shardflow` and `python` are found only as the docs or the demo say to find them
(by path, or after `source .venv/bin/activate`)."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

VENV_BIN = Path(sys.executable).parent
"""Where the environment running the tests keeps `python`, `shardflow` and `tensorboard`: the docs' .venv/bin."""


def environment() -> dict[str, str]:
    """This process's environment as a new terminal has it: no virtual environment active. PYTHONPATH stays: it is
    how a test run points at the sources under test, not something a user activates."""
    path = [part for part in os.environ.get("PATH", os.defpath).split(os.pathsep) if part and Path(part) != VENV_BIN]
    fresh = {name: value for name, value in os.environ.items() if name not in ("VIRTUAL_ENV", "PYTHONHOME")}
    return {**fresh, "PATH": os.pathsep.join(path)}


def activate() -> str:
    """What the docs' `source .venv/bin/activate` is for the environment running the tests."""
    script = VENV_BIN / "activate"
    if script.exists():
        return f"source {shlex.quote(str(script))}"
    return f'export PATH={shlex.quote(str(VENV_BIN))}:"$PATH"'  # not a virtual environment: put its bin first


def run(command: str, cwd: Path, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    """`command` as one bash command line in a fresh terminal in `cwd`."""
    return subprocess.run(
        ["bash", "-c", command],
        cwd=cwd,
        env=environment(),
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
