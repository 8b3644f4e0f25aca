"""benchmarks/gpu_training.py runs on any machine with --device cpu and prints the rows of its CPU targets."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_training_runs_on_the_cpu_and_rates_the_cpu_targets():
    command = [sys.executable, str(ROOT / "benchmarks" / "gpu_training.py"), "--device", "cpu", "--models", "rec,mlp"]
    command += ["--setups", "async-1w1ps", "--steps", "40", "--local-steps", "10", "--rec-rows", "1000"]
    command += ["--mlp-steps", "40", "--mlp-local-steps", "10"]
    src = str(ROOT / "src")
    environ = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=environ)
    assert done.returncode == 0, done.stdout + done.stderr
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    result = json.loads(line.removeprefix("RESULT "))
    assert [(row["target"], row["peer"]) for row in result["rows"]] == [
        (">= 0.7", "one-process PyTorch loop, same device"),
        (">= 0.8", "one-process PyTorch loop, same device"),
    ]
    assert "1,000 x 32" in result["rows"][0]["measure"] and "CPU" in result["rows"][0]["measure"]
    assert all(rate > 0 for runs in result["figures"]["runs"].values() for rates in runs.values() for rate in rates)
