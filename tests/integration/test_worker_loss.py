"""Losing a worker: the PS and the other workers keep training, the dead worker is restarted and resumes its shard
after the last step every PS applied, and every record's gradient is applied exactly once.

Each job is tests/integration/jobs/audit.py, whose final parameters count the applications of every record. The
worker is killed with SIGKILL at a chosen moment: by SHARDFLOW_FAULT (shardflow/faults.py) between its push to ps:0
and its push to ps:1, the worst moment, or from outside, at a moment picked by the test."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
from safetensors.torch import load_file

from shardflow.cluster.zygote import role_of
from shardflow.train import job_keys

from .test_cluster_environments import _free_ports

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))  # the audit's helpers, shared with make faults
from audited_runs import dynamic_counts

JOBS = Path(__file__).parent / "jobs"
NUM_RECORDS, BATCH = 1024, 8


def _write_config(tmp_path: Path, **config: Any) -> Path:
    config = {"model_dir": str(tmp_path / "model"), "result": str(tmp_path / "result.json"), **config}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return path


def _fault_env(tmp_path: Path, role: str, point: str, step: int) -> dict[str, str]:
    fault = {"role": role, "point": point, "step": step, "marker": str(tmp_path / "fault.fired")}
    return {**os.environ, "SHARDFLOW_FAULT": json.dumps(fault)}


def _run(command: list[str], env: dict[str, str], timeout_s: float = 150) -> tuple[int, str]:
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        for child in psutil.Process(proc.pid).children(recursive=True):
            child.kill()
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"the job did not finish within {timeout_s}s:\n{out}")
    return proc.returncode, out


def _audit(
    tmp_path: Path, epochs: int = 1, num_records: int = NUM_RECORDS, replicas: int = 1, resumed: bool = False
) -> dict[str, Any]:
    """The result, checked: the exact global step (a step is `replicas` batches), and every record's gradient
    applied exactly `epochs` times; and every batch a worker step, unless the run `resumed` (a restarted chief, a
    re-run: the result counts the workers' steps since then)."""
    result = json.loads((tmp_path / "result.json").read_text())
    batches = epochs * num_records // BATCH
    assert result["global_step"] == batches // replicas
    # A sync step averages its replicas' gradients: each application adds 1 / replicas (a power of two: exact).
    applied = load_file(str(Path(result["checkpoint"]) / "model.safetensors"))["seen"] * replicas
    counts = torch.bincount(applied.round().long(), minlength=epochs + 2)
    assert torch.equal(applied, torch.full_like(applied, float(epochs))), (
        f"records applied 0, 1, 2.. times: {counts.tolist()}"
    )
    dynamic = dynamic_counts(Path(result["checkpoint"]), num_records)
    if dynamic is not None:  # the sf.nn.DynamicEmbedding's rows count them too
        dynamic = dynamic * replicas
        counts = torch.bincount(dynamic.round().long().clamp(min=0), minlength=epochs + 2)
        assert torch.equal(dynamic, torch.full_like(dynamic, float(epochs))), (
            f"records applied 0, 1, 2.. times by the dynamic table: {counts.tolist()}"
        )
    if not resumed:
        assert sum(result["worker_steps"].values()) == batches
    return result


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_a_worker_killed_between_its_pushes_to_two_ps_is_restarted_and_no_record_is_lost_or_doubled(tmp_path, mode):
    config = _write_config(tmp_path, mode=mode)
    env = _fault_env(tmp_path, "worker:1", "push", 20)
    returncode, out = _run([sys.executable, str(JOBS / "audit.py"), str(config)], env)
    assert returncode == 0, out
    assert (tmp_path / "fault.fired").exists()
    assert "worker:1" in out and "SIGKILL" in out and "restarting it" in out, out
    assert "rejoins the job after 19 steps" in out, out
    result = _audit(tmp_path, replicas=2 if mode == "sync" else 1)
    # ps:0 had the push of step 20 when the worker died, ps:1 did not: the restarted worker repeated it, and only
    # ps:1 applied it.
    assert [result["ps_stats"][ps]["repeated"] for ps in ("ps:0", "ps:1")] == [1, 0]


def test_under_shardflow_launch_a_worker_killed_from_outside_mid_training_rejoins(tmp_path):
    num_records = 16 * NUM_RECORDS  # 1024 steps per worker, paced to take >= 4 s: a worker is killed in the middle
    config = _write_config(tmp_path, mode="async", num_records=num_records, step_delay_s=0.004)
    command = [sys.executable, "-m", "shardflow", "launch", "--workers", "2", "--ps", "2"]
    command += ["--restart-backoff", "0.2", str(JOBS / "audit.py"), str(config)]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait_for_training(proc, tmp_path, 1.5)  # of about 5s
        _role(proc, "worker:0").send_signal(signal.SIGKILL)
        out, _ = proc.communicate(timeout=150)
    finally:
        _kill_if_running(proc)
    assert proc.returncode == 0, out
    assert "worker:0" in out and "SIGKILL" in out and "restarting it" in out, out
    assert "[chief] [chief]" not in out and "[chief] global step" in out, out  # the launcher's prefix alone
    _audit(tmp_path, num_records=num_records)


def _wait_for_training(proc: subprocess.Popen[str], tmp_path: Path, seconds: float) -> None:
    """Until `seconds` after the chief let the workers start (it writes job.json just before)."""
    job_file = tmp_path / "model" / "job.json"
    deadline = time.monotonic() + 60
    while not job_file.exists():
        assert proc.poll() is None and time.monotonic() < deadline, "the chief never started"
        time.sleep(0.05)
    time.sleep(seconds)


def _kill_if_running(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        for child in psutil.Process(proc.pid).children(recursive=True):
            child.kill()
        proc.kill()


def _role(proc: subprocess.Popen[str], name: str) -> psutil.Process:
    for child in psutil.Process(proc.pid).children(recursive=True):
        try:
            if role_of(child) == name:
                return child
        except psutil.Error:
            continue
    pytest.fail(f"no process of {name} under the launcher")


def test_under_tf_config_a_supervisor_restarts_the_killed_worker_and_it_rejoins(tmp_path):
    ports = _free_ports(5)
    cluster = {
        "chief": [f"127.0.0.1:{ports[0]}"],
        "ps": [f"127.0.0.1:{ports[1]}", f"127.0.0.1:{ports[2]}"],
        "worker": [f"127.0.0.1:{ports[3]}", f"127.0.0.1:{ports[4]}"],
    }
    config = _write_config(tmp_path, mode="async")
    fault = _fault_env(tmp_path, "worker:1", "push", 30)

    def start(task_type: str, index: int) -> subprocess.Popen[str]:
        task = {"type": task_type, "index": index}
        env = {**fault, "TF_CONFIG": json.dumps({"cluster": cluster, "task": task})}
        command = [sys.executable, str(JOBS / "audit.py"), str(config)]
        return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    procs = {name: start(*name) for name in (("chief", 0), ("ps", 0), ("ps", 1), ("worker", 0), ("worker", 1))}
    outputs: dict[tuple[str, int], str] = {}
    try:
        # The supervisor (as a JobSet's or Slurm's restart policy would): worker:1 dies by the fault; start it again.
        first_out, _ = procs["worker", 1].communicate(timeout=120)
        assert procs["worker", 1].returncode == -signal.SIGKILL, first_out
        procs["worker", 1] = start("worker", 1)
        outputs = {name: p.communicate(timeout=120)[0] for name, p in procs.items()}
    finally:
        for p in procs.values():
            p.kill()
    assert [p.returncode for p in procs.values()] == [0] * 5, outputs
    assert "rejoins the job after 29 steps" in outputs["worker", 1], outputs["worker", 1]
    _audit(tmp_path)


def _start_and_pause(tmp_path: Path, **config: Any) -> tuple[subprocess.Popen[str], float]:
    """The audit job, embedded, with worker:1 stopped (SIGSTOP: alive, silent) once training runs; when it was."""
    path = _write_config(tmp_path, **config)
    proc = subprocess.Popen(
        [sys.executable, str(JOBS / "audit.py"), str(path)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    _wait_for_training(proc, tmp_path, 1.0)
    _role(proc, "worker:1").send_signal(signal.SIGSTOP)
    return proc, time.monotonic()


def test_a_silent_worker_is_named_lost_within_the_heartbeat_deadline_and_rejoins_when_it_wakes(tmp_path):
    proc, _ = _start_and_pause(tmp_path, num_records=16 * NUM_RECORDS, heartbeat_timeout_s=2.0)
    try:
        time.sleep(4.0)
        _role(proc, "worker:1").send_signal(signal.SIGCONT)
        out, _ = proc.communicate(timeout=150)
    finally:
        _kill_if_running(proc)
    assert proc.returncode == 0, out
    assert "worker:1 is lost: no heartbeat for 2." in out and "worker:1 rejoined" in out, out
    _audit(tmp_path, num_records=16 * NUM_RECORDS)


def test_a_worker_that_never_comes_back_fails_the_job_naming_it(tmp_path):
    # Sync: its shard cannot go to another worker (async with epochs hands it over: test_handover.py).
    proc, paused_at = _start_and_pause(
        tmp_path, mode="sync", num_records=16 * NUM_RECORDS, heartbeat_timeout_s=2.0, worker_rejoin_timeout_s=3.0
    )
    try:
        out, _ = proc.communicate(timeout=60)
        ended_after = time.monotonic() - paused_at
    finally:
        _kill_if_running(proc)
    assert proc.returncode != 0, out
    assert "worker:1 was lost" in out and "worker_rejoin_timeout_s=3" in out, out
    # Lost after 2s of silence, failed 3s later; the rest is stopping the roles.
    assert ended_after < 15, (ended_after, out)


# Sync is the same path (make faults runs both; RELIABILITY.md), so the suite runs async alone.
@pytest.mark.parametrize("mode", ["async"])
def test_a_ps_killed_mid_apply_is_restarted_and_every_ps_resumes_from_the_latest_checkpoint(tmp_path, mode):
    # Slow steps (20 a second per worker), so the chief has saved the checkpoint of step 32 when step 40 comes.
    config = _write_config(tmp_path, mode=mode, save_checkpoints_steps=16, step_delay_s=0.05)
    env = _fault_env(tmp_path, "ps:1", "apply", 40)
    returncode, out = _run([sys.executable, str(JOBS / "audit.py"), str(config)], env)
    assert returncode == 0, out
    assert (tmp_path / "fault.fired").exists()
    assert "ps:1" in out and "SIGKILL" in out and "restarting it" in out, out
    restored = re.search(r"ps:1 was lost and restarted: every PS restored to global step (\d+) \(the latest", out)
    # The checkpoint of step 32, or of 16 when the chief had not saved 32 yet (it saves a few polls later).
    assert restored is not None and int(restored[1]) in (16, 32), out
    # Restored with the checkpoint: the parameters, optimizer slots and every worker's input position of step 32.
    # The records applied after it were applied again, once: none twice, none lost.
    _audit(tmp_path, replicas=2 if mode == "sync" else 1)


def test_a_malformed_capture_request_on_the_control_plane_is_refused_and_the_job_goes_on(tmp_path):
    import msgspec

    from shardflow.cluster.control_plane import ControlPlane
    from shardflow.comm.security import job_credentials

    path = _write_config(tmp_path, mode="async", step_delay_s=0.03)
    proc = subprocess.Popen(
        [sys.executable, str(JOBS / "audit.py"), str(path)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        _wait_for_training(proc, tmp_path, 0.0)
        job = json.loads((tmp_path / "model" / "job.json").read_text())
        # A member of the job (the secret its chief left for the user's tools) with a bad request: the chief's
        # own validation is what refuses it.
        member = job_credentials(tmp_path / "model")
        assert member.secret is not None
        outsider = ControlPlane(job["control"], timeout_s=10, credentials=member)
        escape = tmp_path / "escaped"
        request = {"name": f"../../../{escape.relative_to('/')}", "first": 5, "last": 8}
        outsider.set(job_keys.CAPTURE_REQUEST.name, msgspec.msgpack.encode(request))
        out, _ = proc.communicate(timeout=120)
    finally:
        _kill_if_running(proc)
    assert proc.returncode == 0, out
    assert "refused a capture request on the control plane: the value of 'capture/request'" in out, out
    assert "a capture name is" in out, out
    assert not escape.exists() and not (tmp_path / "model" / "profile").exists()
    _audit(tmp_path)
