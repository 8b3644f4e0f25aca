"""A finished job run again says what it restored and that there is nothing to train, and adds nothing to
TensorBoard; `shardflow launch` with other numbers than the script's strategy says which won and why."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

from tensorboard.compat.proto.event_pb2 import Event

from shardflow.data import TFRecordDataset

JOB = Path(__file__).parent / "jobs" / "unsharded.py"
NUM_RECORDS, BATCH = 96, 8


def scalars(model_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every training scalar TensorBoard shows: tag -> [(global step, value)]."""
    found: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for path in sorted((model_dir / "tensorboard").glob("events.out.tfevents.*")):
        for record in TFRecordDataset(str(path)):
            event = Event.FromString(record)
            for value in event.summary.value:
                found[value.tag].append((event.step, value.simple_value))
    return dict(found)


def test_rerunning_a_finished_epochs_job_says_it_has_nothing_to_train(run_job, tmp_path):
    steps = NUM_RECORDS // BATCH
    proc, first = run_job("unsharded.py", source="tensors", epochs=1, save_summary_steps=4)
    assert proc.returncode == 0, proc.stdout
    assert first["global_step"] == steps
    before = scalars(tmp_path / "model")

    proc, again = run_job("unsharded.py", source="tensors", epochs=1, save_summary_steps=4)
    assert proc.returncode == 0, proc.stdout
    assert again["global_step"] == steps and again["seen"] == [1.0] * NUM_RECORDS
    line = f"restored ckpt-{steps:09d} at global step {steps}: training is already done (epochs=1 reached); nothing"
    assert proc.stdout.count(line) == 1, proc.stdout
    assert "global steps/s" not in proc.stdout and "rejoins the job" not in proc.stdout, proc.stdout
    assert scalars(tmp_path / "model") == before


def test_rerunning_a_finished_max_steps_job_says_it_has_nothing_to_train(run_job):
    proc, _ = run_job("unsharded.py", source="tensors", max_steps=6)
    assert proc.returncode == 0, proc.stdout
    proc, again = run_job("unsharded.py", source="tensors", max_steps=6)
    assert proc.returncode == 0, proc.stdout
    assert again["global_step"] == 6
    line = "restored ckpt-000000006 at global step 6: training is already done (max_steps=6 reached); nothing to train"
    assert line in proc.stdout, proc.stdout


def test_shardflow_launch_with_other_numbers_than_the_strategy_says_which_won(tmp_path):
    config = tmp_path / "config.json"
    model_dir, result = tmp_path / "model", tmp_path / "result.json"
    config.write_text(
        json.dumps({"source": "tensors", "epochs": 1, "model_dir": str(model_dir), "result": str(result)})
    )
    command = [sys.executable, "-m", "shardflow", "launch", "--workers", "1", "--ps", "1", str(JOB), str(config)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout + proc.stderr
    line = (
        "[chief] training uses the 1 worker(s) and 1 PS that shardflow launch started; the strategy's num_workers=2, "
        "num_ps=1 apply only where the script starts its own local cluster (python script.py): start it with "
        "`shardflow launch --workers 2 --ps 1` to use them"
    )
    assert out.count(line) == 1, out
    assert json.loads(result.read_text())["global_step"] == NUM_RECORDS // BATCH
