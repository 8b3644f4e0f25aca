"""Helpers that run the real training jobs in tests/integration/jobs as separate processes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil
import pytest

JOBS = Path(__file__).parent / "jobs"


class JobRun:
    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path

    def __call__(self, job: str, timeout_s: float = 120, **config: Any) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
        config.setdefault("model_dir", str(self.tmp_path / "model"))
        config.setdefault("result", str(self.tmp_path / "result.json"))
        config_path = self.tmp_path / "config.json"
        config_path.write_text(json.dumps(config))
        proc = subprocess.Popen(
            [sys.executable, str(JOBS / job), str(config_path)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        try:
            out, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_tree(proc.pid)
            out, _ = proc.communicate()
            pytest.fail(f"{job} did not finish in {timeout_s}s:\n{out}")
        finally:
            _kill_tree(proc.pid)
        done = subprocess.CompletedProcess(proc.args, proc.returncode, out, "")
        result_path = Path(config["result"])
        result = json.loads(result_path.read_text()) if result_path.exists() else {}
        return done, result


def _kill_tree(pid: int) -> None:
    try:
        parent = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return
    for child in parent.children(recursive=True):
        child.kill()
    parent.kill()


@pytest.fixture
def run_job(tmp_path: Path) -> JobRun:
    return JobRun(tmp_path)
