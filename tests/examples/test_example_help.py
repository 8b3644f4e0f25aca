"""`python examples/<script>.py --help` answers at once: each example parses its arguments before its heavy imports."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SCRIPTS = sorted(path.name for path in EXAMPLES.glob("*.py") if "def parse_args" in path.read_text())
HEAVY_PACKAGES = {"torch", "numpy", "sklearn", "shardflow"}


def imported_packages(importtime_log: str) -> set[str]:
    """The top-level packages in `python -X importtime` output: lines "import time: self | cumulative | name"."""
    names = (line.rsplit("|", 1)[1].strip() for line in importtime_log.splitlines() if line.startswith("import time:"))
    return {name.split(".")[0] for name in names}


def test_every_example_is_checked():
    assert {"char_lm.py", "digits.py", "click_through.py"} <= set(SCRIPTS)


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_prints_usage_and_exits_without_importing_torch(script: str):
    done = subprocess.run(
        [sys.executable, "-X", "importtime", str(EXAMPLES / script), "--help"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"usage: {script}")
    imported = imported_packages(done.stderr)
    assert "argparse" in imported  # the log was read: the check below would otherwise pass for nothing
    assert not imported & HEAVY_PACKAGES, f"{script} --help imports {sorted(imported & HEAVY_PACKAGES)}"
