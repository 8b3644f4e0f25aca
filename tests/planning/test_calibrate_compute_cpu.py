"""The compute's CPU time calibrated from a real profiled PS run (two workers and a PS train a small MLP), the plan
model that uses it reproducing that run, and a capture whose table predates it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from shardflow.planning.calibrate import Calibration, calibrate
from shardflow.planning.plan_model import PlanConfig
from shardflow.planning.strategies import predict_strategy
from shardflow.profile.capture import EVENTS, MERGED, capture_dir

JOB = Path(__file__).parents[1] / "cli" / "jobs" / "tiny_classifier.py"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two workers and one PS train the tiny job for 800 steps, profiling steps [100, 700): about 0.25 s, 25 samples
    of the cores' counters (every 10 ms). A window of 150 steps (60 ms) left the CPU time of the window to 6 samples,
    10% off when another program shared the cores."""
    directory = tmp_path_factory.mktemp("compute-cpu")
    env = {
        **os.environ,
        "SHARDFLOW_MODEL_DIR": str(directory / "model"),
        "SHARDFLOW_RESULT_JSON": str(directory / "result.json"),
        "SHARDFLOW_PROFILE_STEPS": "100,700",
    }
    command = [sys.executable, "-m", "shardflow", "launch", "--workers", "2", "--ps", "1", str(JOB), "800", "1000"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    return directory / "model"


@pytest.fixture(scope="module")
def measured(model_dir: Path) -> Calibration:
    return calibrate(model_dir)


def test_a_ps_run_calibrates_the_cpu_time_of_its_compute_within_its_wall_time(measured):
    # Per step the CPU time of forward and backward is at most their wall time; the pushes that backward's hooks
    # start come off both.
    assert measured.step_compute_cpu_s is not None
    assert 0 < measured.step_compute_cpu_s <= measured.step_compute_s


def test_a_ps_calibration_with_the_compute_cpu_time_reproduces_its_own_run(measured):
    assert measured.busy_cores is not None
    config = PlanConfig(
        num_params=measured.model_bytes / 4,
        num_workers=measured.num_workers,
        num_ps=measured.num_ps,
        bandwidth=measured.bandwidth,
        step_compute_s=measured.step_compute_s,
        step_compute_cpu_s=measured.step_compute_cpu_s,
        ps_apply_s=measured.ps_apply_s,
        cores=measured.busy_cores,
        worker_cpu_s=measured.worker_cpu_s,
        ps_cpu_s=measured.ps_cpu_s,
        other_cores=measured.other_cores,
        calibrated_on=measured.strategy,
    )
    predicted = predict_strategy(config, "ps").global_steps_per_s
    # Alone on the machine, within 0.5%; beside busy loops that come and go, within 4% in twelve runs. Two CI runs
    # had planned +16% and +54%: the workers' rate was the sum of each one's over its own window, so a worker kept
    # off the cores at the start counted that time as work (test_calibrate_ps_rate.py).
    assert predicted == pytest.approx(measured.global_steps_per_s, rel=0.15)


def test_a_capture_whose_table_predates_the_cpu_time_calibrates_without_it(model_dir, measured, tmp_path):
    old = tmp_path / "old"
    shutil.copytree(capture_dir(model_dir), old)
    table = pq.read_table(old / EVENTS)
    pq.write_table(table.drop_columns(["cpu_ns"]), old / EVENTS)
    os.utime(old / EVENTS, (os.stat(old / MERGED).st_mtime + 1,) * 2)  # newer than the trace: not rebuilt
    calibrated = calibrate(old)
    assert calibrated.step_compute_cpu_s is None
    assert calibrated.step_compute_s == measured.step_compute_s
