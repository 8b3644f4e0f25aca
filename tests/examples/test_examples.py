"""Each example runs end to end on a local cluster in a tiny configuration and prints its summary."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import fresh_shell
import numpy as np
import pytest
import torch

from shardflow import data
from shardflow.train.checkpoints import store
from shardflow.train.checkpoints.table_rows import CheckpointRows

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


@pytest.fixture(scope="module")
def char_lm(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, dict[str, Any]]:
    """One run of char_lm.py as `make demo` runs it, smaller: its directory, output and result."""
    directory = tmp_path_factory.mktemp("char_lm")
    args = ("--max-files", "200", "--max-steps", "30", "--profile-steps", "5:8", "--eval-batches", "2")
    return directory, *run_example("char_lm.py", directory, *args)


def test_char_lm_trains_on_sharded_stdlib_files_and_writes_the_profile_report(char_lm):
    directory, output, result = char_lm
    assert result["global_step"] == 30
    assert result["final_loss"] < result["first_loss"]
    assert "held-out loss" in output and "perplexity" in output
    (report,) = (directory / "model" / "profile").glob("*/report.html")
    assert "<html" in report.read_text().lower()
    assert (report.parent / "merged.trace.json.gz").exists()
    assert str(report) in output


def summary_command(output: str, pattern: str) -> str:
    """The command a summary line prints: `pattern`'s group, searched line by line."""
    found = re.search(pattern, output, flags=re.MULTILINE)
    assert found, f"no summary line matches {pattern!r} in:\n{output}"
    return found[1]


def test_the_profile_command_the_demo_prints_runs_in_a_new_terminal(char_lm):
    directory, output, _ = char_lm
    command = summary_command(output, r"^  profile report .*\(or: (.+)\)$")
    done = fresh_shell.run(command, directory)
    assert done.returncode == 0, f"{command}\n{done.stderr}"
    assert "diagnosis:" in done.stdout


def test_the_train_further_command_the_demo_prints_finds_python_and_the_script_in_a_new_terminal(char_lm):
    directory, output, _ = char_lm
    command = summary_command(output, r"^  train further\s+(.+?)  \(continues")
    assert " --model-dir model " in command
    done = fresh_shell.run(f"{command} --help", directory)  # --help: the command as printed, without training more
    assert done.returncode == 0, f"{command}\n{done.stderr}"
    assert "--max-steps" in done.stdout


def test_the_tensorboard_command_the_demo_prints_finds_tensorboard_in_a_new_terminal(char_lm):
    directory, output, _ = char_lm
    program, logdir = summary_command(output, r"^  TensorBoard .*\((\S+ --logdir \S+)\)$").split(" --logdir ")
    assert (directory / logdir).is_dir()
    done = fresh_shell.run(f"command -v {program}", directory)  # not run: it would serve until stopped
    assert done.returncode == 0, f"{program} is not found in a new terminal"


def test_digits_evaluates_accuracy_during_training_for_shardflow_scale(tmp_path):
    pytest.importorskip("sklearn")
    output, result = run_example("digits.py", tmp_path, "--epochs", "2", "--eval-every", "20", "--workers", "1")
    assert [e["global_step"] for e in result["eval_history"]][:2] == [20, 40]
    assert "accuracy" in result["metrics"]
    assert "test accuracy" in output


def test_digits_without_scikit_learn_says_how_to_install_it(tmp_path):
    # A package named sklearn that is not there, as in a fresh `make demo` environment.
    (tmp_path / "sklearn").mkdir()
    (tmp_path / "sklearn" / "__init__.py").write_text("raise ModuleNotFoundError('No module named sklearn')\n")
    pythonpath = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "digits.py"), "--model-dir", str(tmp_path / "model")],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": pythonpath},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1
    assert "scikit-learn is not installed" in done.stderr and "pip install scikit-learn" in done.stderr


@pytest.fixture(scope="module")
def click_through(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, dict[str, Any]]:
    """One run of click_through.py on 4,000 records: its directory, output and result."""
    directory = tmp_path_factory.mktemp("click_through")
    args = ("--records", "4000", "--epochs", "1", "--data-dir", str(directory / "logs"))
    return directory, *run_example("click_through.py", directory, *args)


def test_click_through_writes_tfrecord_logs_and_reports_auc(click_through):
    directory, output, result = click_through
    assert len(list((directory / "logs").glob("train-*.tfrecord"))) == 8
    assert 0.0 <= result["metrics"]["auc"] <= 1.0
    assert "test AUC" in output and "examples/s" in output
    assert "sf.nn table      user_id 10000x16, by id mod 2: 5000 rows on ps:0, 5000 rows on ps:1" in output
    assert "dense table      hour 24x4: rows 0-24 on ps:" in output


def test_click_through_dynamic_table_holds_a_row_for_each_cross_seen_at_least_twice(click_through):
    directory, output, _ = click_through
    example = _load_example("click_through.py")
    files = sorted(str(path) for path in (directory / "logs").glob("train-*.tfrecord"))
    crosses = np.concatenate(
        [batch[example.CROSS] for batch in data.TFRecordDataset(files).batch(1000).map(example.parse)]
    )
    unique, counts = np.unique(crosses, return_counts=True)
    checkpoint = store.latest(directory / "model")
    assert checkpoint is not None
    rows = CheckpointRows(checkpoint, f"embeddings.{example.CROSS}", default=torch.zeros_like)
    assert rows.ids.tolist() == unique[counts >= 2].tolist()
    assert f"{len(rows)} ids admitted after 2 sightings" in output


def _load_example(script: str) -> ModuleType:
    """examples/SCRIPT as a module (its main does not run), with examples/ importable for its own imports."""
    sys.path.insert(0, str(EXAMPLES))
    try:
        spec = importlib.util.spec_from_file_location(Path(script).stem, EXAMPLES / script)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(EXAMPLES))
    return module


def test_click_through_with_hybrid_reaches_the_ps_strategys_held_out_log_loss_within_1_percent(tmp_path):
    """The example's 100,000 records, everything on the PS (async), and with HybridStrategy (the sf.nn tables on the
    PS, async; the MLP and small dense tables all-reduced): the same test log-loss, within 1%, as the mean of two
    seeds each. Runs seeded alike (--seed: the dense layers' initial values, each worker's shuffle) differ by the
    strategy and the timing of async updates only: unseeded, either strategy's log-loss moved by about 1% between
    runs here (PS 0.3579 to 0.3656, hybrid 0.3577 to 0.3667); with seed 0, PS 0.3586 to 0.3615 and hybrid 0.3618
    to 0.3626 (one run in six of PS against hybrid alone missed the 1%)."""
    losses: dict[str, list[float]] = {"ps": [], "hybrid": []}
    for seed in ("0", "1"):
        logs = ("--data-dir", str(tmp_path / "logs"), "--seed", seed)
        for strategy in losses:
            directory = tmp_path / f"{strategy}-{seed}"
            directory.mkdir()
            output, result = run_example("click_through.py", directory, *logs, "--strategy", strategy)
            losses[strategy].append(result["metrics"]["loss"])
    assert "hybrid training (tables on the PS, the rest all-reduced)" in output
    assert "dense table      hour 24x4: on every worker, all-reduced" in output
    assert "sf.nn table      user_id 10000x16, by id mod 2: 5000 rows on ps:0, 5000 rows on ps:1" in output
    ps, hybrid = (sum(values) / len(values) for values in losses.values())
    print(f"test log-loss (mean of seeds 0 and 1): PS {ps:.4f}, hybrid {hybrid:.4f}; {losses}")
    assert hybrid <= 1.01 * ps, losses
