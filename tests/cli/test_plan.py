"""`shardflow plan` as users run it: the talk's example by flags, errors, and calibration from a real profiled run."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from shardflow.cli.main import main
from shardflow.planning.calibrate import calibrate

JOB = Path(__file__).parent / "jobs" / "tiny_classifier.py"
# The job's MLP 16-32-4: (16·32 + 32 + 32·4 + 4) float32 parameters.
TINY_MODEL_BYTES = (16 * 32 + 32 + 32 * 4 + 4) * 4


@pytest.fixture(scope="module")
def profiled_run(tmp_path_factory):
    """One worker and one PS train the tiny job for 400 steps, profiling steps [100, 300)."""
    directory = tmp_path_factory.mktemp("profiled")
    env = {
        **os.environ,
        "SHARDFLOW_MODEL_DIR": str(directory / "model"),
        "SHARDFLOW_RESULT_JSON": str(directory / "result.json"),
        "SHARDFLOW_PROFILE_STEPS": "100,300",
    }
    command = [sys.executable, "-m", "shardflow", "launch", "--workers", "1", "--ps", "1", str(JOB), "400", "1000"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    return directory / "model"


def test_plan_prints_the_step_bottleneck_and_ps_needed_for_the_talks_example(capsys):
    args = ["--params", "100M", "--workers", "64", "--ps", "8", "--bandwidth", "25Gbit", "--step-compute", "120ms"]
    assert main(["plan", *args, "--allreduce"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"step time +2\.17 s", out), out
    assert re.search(r"step time with overlap +2\.05 s", out), out
    assert "bottleneck: PS link" in out
    assert "PS needed: 64 PS stop the PS being the bottleneck" in out
    assert "all-reduce (sync, 2(n-1)/n·M/B = 252 ms per step): step 372 ms" in out


def test_plan_names_missing_flags_with_examples(capsys):
    assert main(["plan", "--params", "100M"]) == 2
    err = capsys.readouterr().err
    assert "missing --workers, --ps, --bandwidth, --step-compute" in err
    assert "--bandwidth 25Gbit" in err


def test_plan_names_the_flag_of_a_bad_unit(capsys):
    args = ["--params", "100M", "--workers", "4", "--ps", "1", "--bandwidth", "25GB", "--step-compute", "1ms"]
    assert main(["plan", *args]) == 2
    assert "--bandwidth: cannot read '25GB'" in capsys.readouterr().err


def test_calibrate_measures_the_model_compute_bandwidth_and_apply_of_a_profiled_run(profiled_run):
    measured = calibrate(profiled_run)
    assert (measured.num_workers, measured.num_ps) == (1, 1)
    assert measured.model_bytes == TINY_MODEL_BYTES
    assert 0 < measured.step_compute_s < measured.worker_step_s
    assert measured.bandwidth > 0 and measured.ps_apply_s > 0 and measured.global_steps_per_s > 0
    # All threads of the roles: at least the work inside the spans, and at most what 2 cores could give.
    assert measured.worker_cpu_s is not None and measured.ps_cpu_s is not None
    assert 0.5 * measured.step_compute_s < measured.worker_cpu_s < 2 * 2 * measured.worker_step_s
    assert 0 < measured.ps_cpu_s < 2 * 2 * measured.worker_step_s


def test_plan_calibrate_prints_what_it_measured_and_predicts_with_it(profiled_run, capsys):
    assert main(["plan", "--calibrate", str(profiled_run), "--workers", "2", "--cores", "2"]) == 0
    out = capsys.readouterr().out
    assert "measured in" in out and "(1 worker, 1 PS)" in out
    model_row = next(line for line in out.splitlines() if line.startswith("model on the wire"))
    assert model_row.split()[4:] == [f"{TINY_MODEL_BYTES / 1e3:.3g}", "kB", "pushed", "per", "worker", "step"]
    assert "2 workers, 1 PS, async" in out and "2 shared CPU cores" in out
    assert "CPU per worker step" in out
    assert "bottleneck: " in out


def test_plan_calibrate_without_a_capture_says_how_to_make_one(tmp_path, capsys):
    assert main(["plan", "--calibrate", str(tmp_path)]) == 2
    assert "profile_steps" in capsys.readouterr().err


def test_calibrate_also_reads_a_capture_directory_itself(profiled_run):
    (capture,) = (profiled_run / "profile").iterdir()
    assert calibrate(capture).step_compute_s == calibrate(profiled_run).step_compute_s


def test_plan_names_hybrid_the_winner_for_a_model_of_large_tables(capsys):
    args = ["--params", "10M", "--sparse-params", "9M", "--table-params", "1B", "--workers", "4", "--ps", "4"]
    args += ["--bandwidth", "10Gbit", "--step-compute", "50ms", "--batch-size", "256"]
    assert main(["plan", *args, "--strategy", "all"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^hybrid +16 +64\.1 +16,410 ", out, re.MULTILINE), out
    assert "winner: hybrid, 64.1 batches/s against 62.5 for PS (1.03x)" in out


def test_plan_strategy_allreduce_prints_only_its_row_and_no_winner(capsys):
    args = ["--params", "1M", "--workers", "4", "--ps", "1", "--bandwidth", "8Gbit", "--step-compute", "10ms"]
    assert main(["plan", *args, "--strategy", "allreduce"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^all-reduce +100 +400 +moves 6 MB each way per worker", out, re.MULTILINE), out
    assert "bottleneck:" not in out and "winner:" not in out


def test_plan_calibrated_names_allreduce_the_winner_for_a_large_dense_model(profiled_run, capsys):
    args = ["--calibrate", str(profiled_run), "--workers", "8", "--params", "100M", "--bandwidth", "10Gbit"]
    assert main(["plan", *args]) == 0
    winner_line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("winner:"))
    assert winner_line.startswith("winner: all-reduce, ")
    assert "PS moves 3.2 GB each way through ps:0, the busiest link, per round" in winner_line


def test_plan_cores_measured_uses_the_cores_the_calibrated_run_kept_busy(profiled_run, capsys):
    busy = calibrate(profiled_run).busy_cores
    assert busy is not None and 0 < busy <= 2
    assert main(["plan", "--calibrate", str(profiled_run), "--workers", "2", "--cores", "measured"]) == 0
    assert f"{busy:g} shared CPU cores" in capsys.readouterr().out


def test_plan_cores_measured_without_a_calibration_is_named(capsys):
    args = ["--params", "1M", "--workers", "4", "--ps", "1", "--bandwidth", "8Gbit", "--step-compute", "10ms"]
    assert main(["plan", *args, "--cores", "measured"]) == 2
    assert "--cores measured needs --calibrate MODEL_DIR" in capsys.readouterr().err


def test_plan_for_more_roles_than_the_calibrating_run_says_what_reloading_the_caches_costs(profiled_run, capsys):
    # Calibrated on 1 worker + 1 PS; 4 workers + 1 PS on 1 core: 4 roles per core beyond one against 1.
    assert main(["plan", "--calibrate", str(profiled_run), "--workers", "4", "--cores", "1"]) == 0
    out = capsys.readouterr().out
    config_line = "5 roles on 1 cores, the calibrating run had 2: a worker step costs"
    assert config_line in out and "more CPU on its worker and as much on the PS" in out, out
    assert main(["plan", "--calibrate", str(profiled_run), "--workers", "1", "--cores", "2"]) == 0
    assert "the calibrating run had" not in capsys.readouterr().out  # as many roles as the run: nothing to add


@pytest.mark.parametrize(
    "content", [b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\x03", b"\xff\xfe not a trace"], ids=["truncated-gzip", "garbage"]
)
def test_plan_on_a_damaged_capture_names_its_trace(tmp_path, capsys, content):
    capture = tmp_path / "model" / "profile" / "steps-1-2"
    capture.mkdir(parents=True)
    (capture / "merged.trace.json.gz").write_bytes(content)
    assert main(["plan", "--calibrate", str(tmp_path / "model"), "--workers", "4", "--cores", "2"]) == 2
    err = capsys.readouterr().err
    assert f"{capture / 'merged.trace.json.gz'} is not a readable trace" in err and "capture the run again" in err
