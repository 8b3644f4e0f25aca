"""sf.HybridStrategy under faults: a worker SIGKILLed at a random moment is restarted, the group formed again, and
the job ends at its exact global step with every record applied exactly once to the tables on the PS. A PS killed,
or both workers at once (the dense state is gone with them): every PS and every worker go back to the latest
checkpoint (or the start), and the same holds. The job's
audit table (jobs/tables.py "audit") has a row per record that each applied push of the record adds 1.0 to."""

from __future__ import annotations

import contextlib
import json
import os
import random
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

from shardflow.train.checkpoints import store
from shardflow.train.checkpoints.table_rows import CheckpointRows

from .conftest import JOBS, finish_launcher, kill_role_after

STEPS, BATCH = 30, 8


def _wait_for_batches(job, steps_log: Path, count: int) -> None:
    _wait_until(job, lambda: steps_log.exists() and len(steps_log.read_text().splitlines()) >= count, 60, 0.02)


def _wait_until(job, done: Any, timeout_s: float, every_s: float = 0.05) -> None:
    """Until `done()`, failing with the job's output once `timeout_s` passed or the job ended."""
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline and job.proc.poll() is None, job.finish(5)[1]
        time.sleep(every_s)


def _ends_exact_after_a_restore(job, tmp_path: Path) -> None:
    """The job exits 0 after every PS was restored, at STEPS with every record applied once."""
    code, output = job.finish(120)
    assert code == 0, output
    assert "every PS restored to global step" in output, output
    assert json.loads((tmp_path / "result.json").read_text())["global_step"] == STEPS, output
    _exactly_once(tmp_path / "model")


def _start_audited(start_job, env: dict[str, str] | None = None, **config: Any) -> Any:
    """The audit job (each record's id a row of a table on the PS) under HybridStrategy, async: 2 workers, 2 PS,
    STEPS global steps, SGD; a role may be restarted twice. `config` adds to it or overrides it."""
    settings: dict[str, Any] = {
        "strategy": "hybrid",
        "mode": "async",
        "audit": True,
        "optimizer": "SGD",
        "lr": 0.05,
        "num_workers": 2,
        "num_ps": 2,
        "num_batches": 2 * STEPS,
        "batch": BATCH,
        "step_delay_s": 0.03,
        "max_restarts": 2,
    }
    return start_job("tables.py", env, **{**settings, **config})


def _exactly_once(model_dir: Path, accumulation: int = 1) -> None:
    """Every record's row applied once: none twice, none never."""
    applied = _applied(model_dir, accumulation)
    twice, never = (applied > 1).nonzero().view(-1), (applied < 1).nonzero().view(-1)
    assert not twice.numel() and not never.numel(), f"applied twice: {twice.tolist()}; never: {never.tolist()}"


def _applied(model_dir: Path, accumulation: int = 1) -> torch.Tensor:
    """How many times each record was applied, from the audit table's rows in the latest checkpoint (with
    `accumulation`, each loss is divided by it: a push of a record adds 1 / accumulation)."""
    latest = store.latest(model_dir)
    assert latest is not None, f"no checkpoint in {model_dir}"
    rows = CheckpointRows(latest, "audit", lambda ids: torch.zeros(ids.numel(), 1))
    return rows.lookup(torch.arange(2 * STEPS * BATCH * accumulation)).view(-1) * accumulation


@pytest.mark.parametrize(
    ("killed", "save_checkpoints_steps", "seed"),
    [
        ("worker:1", None, 1),
        ("worker:0", 2, 2),
        ("worker:1", 1, 3),
        ("ps:0", 4, 4),
        ("ps:1", None, 5),
        ("worker:0+worker:1", 2, 9),
        ("ps:0>worker:1", 2, 10),
        ("ps:0>ps:1+worker:1", 2, 11),
    ],
    ids=[
        "worker1",
        "worker0-checkpoints-every-2",
        "worker1-checkpoints-every-step",
        "ps0-checkpoints-every-4",
        "ps1-no-checkpoint",
        "both-workers-checkpoints-every-2",
        "ps0-then-worker1-checkpoints-every-2",
        "ps0-then-ps1-and-worker1-checkpoints-every-2",
    ],
)
def test_a_killed_worker_rejoins_and_every_record_reaches_the_tables_once(
    start_job, tmp_path, killed, save_checkpoints_steps, seed
):
    steps_log = tmp_path / "steps.log"
    job = _start_audited(start_job, save_checkpoints_steps=save_checkpoints_steps, step_log=str(steps_log))
    count = random.Random(seed).randint(8, 40)
    for kill, at_once in enumerate(killed.split(">")):  # one fault after the other, 12 batches apart
        _wait_for_batches(job, steps_log, count + 12 * kill)
        for role in at_once.split("+"):
            job.roles()[role].kill()
    code, output = job.finish(120)
    assert code == 0, output
    if ">" in killed:  # a worker restarted after every PS was restored: they take its pushes once it rejoined
        assert "every PS restored to global step" in output, output
        # Restarted alone, it joins the group; restarted with a PS (lost at once), it may come back in time to go back
        # to the checkpoint with the others instead: either way it trains again.
        back = re.compile(r"worker:1 (joined the all-reduce group|went back to global step \d+, where every PS)")
        assert back.search(output.rpartition("restarted worker:1")[2]), output
    elif "+" in killed:  # the dense state is gone with them: as for a PS, back to the latest checkpoint
        assert "every worker was lost: the dense state" in output, output
        assert "every PS restored to global step" in output, output
    elif killed.startswith("ps"):  # every worker and PS went back to the latest checkpoint (or the start)
        assert "restarting it" in output and "every PS restored to global step" in output, output
    else:
        assert "restarting it" in output and "joined the all-reduce group at global step" in output, output
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["global_step"] == STEPS, output
    _exactly_once(tmp_path / "model")


def test_with_gradient_accumulation_a_killed_worker_rejoins_and_every_record_reaches_the_tables_once(
    start_job, tmp_path
):
    """2 batches per worker and global step, their rows' gradients in one push: worker:1 SIGKILLed is restarted, the
    group drops the step in progress and trains it again with the same batches, and the job ends at its exact
    global step with every record applied once."""
    steps_log = tmp_path / "steps.log"
    job = _start_audited(
        start_job, accumulation=2, num_batches=4 * STEPS, save_checkpoints_steps=4, step_log=str(steps_log)
    )
    _wait_for_batches(job, steps_log, random.Random(12).randint(16, 80))
    job.roles()["worker:1"].kill()
    code, output = job.finish(120)
    assert code == 0, output
    assert "restarting it" in output and "joined the all-reduce group at global step" in output, output
    assert json.loads((tmp_path / "result.json").read_text())["global_step"] == STEPS, output
    _exactly_once(tmp_path / "model", accumulation=2)


def test_a_worker_restarted_while_the_ps_are_restored_takes_part_in_the_restore(start_job, tmp_path):
    # worker:1 is stopped, so it never says it stopped for the recovery that ps:0's loss begins; killed and restarted
    # meanwhile, it must stop for it too, not wait for worker:0 (which waits for the restore) to form the group.
    steps_log = tmp_path / "steps.log"
    job = _start_audited(start_job, save_checkpoints_steps=2, step_log=str(steps_log))
    _wait_for_batches(job, steps_log, 16)
    roles = job.roles()
    roles["worker:1"].send_signal(signal.SIGSTOP)
    roles["ps:0"].kill()
    chief_log = tmp_path / "model" / "logs" / "chief.log"
    _wait_until(job, lambda: "ps:0 was lost" in (chief_log.read_text() if chief_log.exists() else ""), 30)
    roles["worker:1"].kill()
    _ends_exact_after_a_restore(job, tmp_path)


def test_a_worker_lost_while_worker0_has_the_ps_snapshot_its_rows_does_not_end_that_snapshot(start_job, tmp_path):
    # ps:1 hangs as it is first asked to snapshot its rows (stopped in the moment SHARDFLOW_FAULT gives
    # before it SIGKILLs itself), so worker:0 waits for its answer; worker:1 is killed and restarted meanwhile. The
    # snapshot asks the PS alone: worker:0 must wait on (the next collective meets worker:1's loss), not fail with
    # it; once ps:1 is killed too, every PS and worker go back to the latest checkpoint and the job ends exact.
    marker = tmp_path / "fault.fired"
    fault = {"role": "ps:1", "point": "snapshot", "marker": str(marker)}
    env = {**os.environ, "SHARDFLOW_FAULT": json.dumps(fault)}
    job = _start_audited(start_job, env=env, save_checkpoints_steps=2)
    _wait_until(job, lambda: {"ps:1", "worker:1"} <= job.roles().keys(), 60)
    roles = job.roles()
    _wait_until(job, marker.exists, 60, 0.005)
    with contextlib.suppress(psutil.NoSuchProcess):  # too late where this test was held up past its 0.1 s
        roles["ps:1"].send_signal(signal.SIGSTOP)
    roles["worker:1"].kill()
    # worker:1's new process beats, and worker:0 sees it (the old one's beats are gone).
    _wait_until(job, lambda: job.roles().get("worker:1", roles["worker:1"]).pid != roles["worker:1"].pid, 30)
    time.sleep(5)
    assert job.proc.poll() is None, job.finish(5)[1]
    with contextlib.suppress(psutil.NoSuchProcess):
        roles["ps:1"].kill()
    _ends_exact_after_a_restore(job, tmp_path)


@pytest.mark.parametrize("point", ["snapshot", "snapshot_state"])
def test_a_ps_lost_in_the_final_hand_over_sends_every_worker_back_and_the_job_ends_exact(start_job, tmp_path, point):
    # ps:0 dies as worker:0 has every PS snapshot its rows for the final state, or as the chief reads that snapshot:
    # the final state cannot be saved; every worker goes back to the restore (the start: no checkpoint before) and
    # trains to the end again.
    marker = tmp_path / "fault.fired"
    fault = {"role": "ps:0", "point": point, "marker": str(marker)}
    end_log = tmp_path / "end.log"
    env = {**os.environ, "SHARDFLOW_FAULT": json.dumps(fault)}
    job = _start_audited(start_job, env=env, step_delay_s=0.0, end_log=str(end_log))
    code, output = job.finish(120)
    assert code == 0, output
    assert marker.exists(), output
    assert "a parameter server was lost before the final state was saved; training goes on" in output, output
    assert "every PS restored to global step 0 after ps:0 was lost" in output, output
    assert json.loads((tmp_path / "result.json").read_text())["global_step"] == STEPS, output
    _exactly_once(tmp_path / "model")
    # Each worker's `end` hooks ran once, after its true last step, not at the end dropped.
    assert sorted(end_log.read_text().splitlines()) == [f"worker:0 {STEPS}", f"worker:1 {STEPS}"], output


@pytest.mark.parametrize(
    ("killed", "save_checkpoints_steps", "seed"),
    [(("chief",), 2, 6), (("chief",), None, 7), (("chief", "ps:0"), 2, 8)],
    ids=["checkpoints-every-2", "none", "with-ps0-checkpoints-every-2"],
)
def test_a_killed_chief_is_restarted_and_adopts_the_live_workers_and_ps(tmp_path, killed, save_checkpoints_steps, seed):
    """Under `shardflow launch` (which restarts a chief killed by a signal): the restarted chief adopts the group and
    the PS as they are, and every record still reaches the tables once. Killed with a PS, the restarted chief finds
    that PS empty and every PS and worker go back to the latest checkpoint, as after a PS lost alone."""
    steps_log = tmp_path / "steps.log"
    config = {
        "strategy": "hybrid",
        "mode": "async",
        "audit": True,
        "optimizer": "SGD",
        "lr": 0.05,
        "num_batches": 2 * STEPS,
        "batch": BATCH,
        "step_delay_s": 0.03,
        "step_log": str(steps_log),
        "save_checkpoints_steps": save_checkpoints_steps,
        "model_dir": str(tmp_path / "model"),
        "result": str(tmp_path / "result.json"),
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    command = [sys.executable, "-m", "shardflow", "launch", "--workers", "2", "--ps", "2", "--max-restarts", "2"]
    command += ["--restart-backoff", "0.1", str(JOBS / "tables.py"), str(path)]
    launcher = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    count = random.Random(seed).randint(8, 40)
    for role in killed:
        kill_role_after(launcher, steps_log, role, count)
    output = finish_launcher(launcher, 150)
    assert launcher.returncode == 0, output
    if "ps:0" in killed:
        assert "the chief was restarted while ps:0 was too" in output, output
        assert "every PS restored to global step" in output, output
    else:
        assert "adopted the live parameter servers" in output, output
    assert json.loads((tmp_path / "result.json").read_text())["global_step"] == STEPS, output
    applied = _applied(tmp_path / "model")
    assert torch.equal(applied, torch.ones_like(applied)), f"applied 0, 1, 2.. times: {torch.bincount(applied.long())}"
