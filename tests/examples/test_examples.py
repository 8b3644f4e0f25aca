"""Each example runs end to end on a local cluster in a tiny configuration and prints its summary."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def run_example(script: str, tmp_path: Path, *args: str, timeout_s: float = 120) -> tuple[str, dict[str, Any]]:
    """Runs examples/SCRIPT as a user would (the script starts its own local cluster); returns its output and the
    chief's result file."""
    result_path = tmp_path / "result.json"
    env = {**os.environ, "SHARDFLOW_RESULT_JSON": str(result_path)}
    args = ("--model-dir", str(tmp_path / "model"), *args)
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / script), *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    return output, json.loads(result_path.read_text())


def test_char_lm_trains_on_sharded_stdlib_files_and_writes_the_profile_report(tmp_path):
    args = ("--max-files", "200", "--max-steps", "30", "--profile-steps", "5:8", "--eval-batches", "2")
    output, result = run_example("char_lm.py", tmp_path, *args)
    assert result["global_step"] == 30
    assert result["final_loss"] < result["first_loss"]
    assert "held-out loss" in output and "perplexity" in output
    (report,) = (tmp_path / "model" / "profile").glob("*/report.html")
    assert "<html" in report.read_text().lower()
    assert (report.parent / "merged.trace.json.gz").exists()
    assert str(report) in output


def test_digits_evaluates_accuracy_during_training_for_shardflow_scale(tmp_path):
    pytest.importorskip("sklearn")
    output, result = run_example("digits.py", tmp_path, "--epochs", "2", "--eval-every", "20", "--workers", "1")
    assert [e["global_step"] for e in result["eval_history"]][:2] == [20, 40]
    assert "accuracy" in result["metrics"]
    assert "test accuracy" in output


def test_click_through_writes_tfrecord_logs_and_reports_auc(tmp_path):
    data_dir = tmp_path / "logs"
    args = ("--records", "4000", "--epochs", "1", "--data-dir", str(data_dir))
    output, result = run_example("click_through.py", tmp_path, *args)
    assert len(list(data_dir.glob("train-*.tfrecord"))) == 8
    assert 0.0 <= result["metrics"]["auc"] <= 1.0
    assert "test AUC" in output and "rows 0-" in output
    assert "user_id 10000x16, row-sparse: rows 0-" in output
