"""sf.HybridStrategy under faults: a worker SIGKILLed at a random moment is restarted, the group formed again, and
the job ends at its exact global step with every record applied exactly once to the tables on the PS. A PS killed:
every PS and every worker go back to the latest checkpoint (or the start), and the same holds. The job's
audit table (jobs/tables.py "audit") has a row per record that each applied push of the record adds 1.0 to."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import pytest
import torch

from shardflow.train.checkpoints import store
from shardflow.train.checkpoints.table_rows import CheckpointRows

STEPS, BATCH = 30, 8


def _wait_for_batches(job, steps_log: Path, count: int) -> None:
    deadline = time.monotonic() + 60
    while not steps_log.exists() or len(steps_log.read_text().splitlines()) < count:
        assert time.monotonic() < deadline and job.proc.poll() is None, job.finish(5)[1]
        time.sleep(0.02)


def _applied(model_dir: Path) -> torch.Tensor:
    """How many times each record was applied, from the audit table's rows in the latest checkpoint."""
    latest = store.latest(model_dir)
    assert latest is not None, f"no checkpoint in {model_dir}"
    rows = CheckpointRows(latest, "audit", lambda ids: torch.zeros(ids.numel(), 1))
    return rows.lookup(torch.arange(2 * STEPS * BATCH)).view(-1)


@pytest.mark.parametrize(
    ("killed", "save_checkpoints_steps", "seed"),
    [("worker:1", None, 1), ("worker:0", 2, 2), ("worker:1", 1, 3), ("ps:0", 4, 4), ("ps:1", None, 5)],
    ids=[
        "worker1",
        "worker0-checkpoints-every-2",
        "worker1-checkpoints-every-step",
        "ps0-checkpoints-every-4",
        "ps1-no-checkpoint",
    ],
)
def test_a_killed_worker_rejoins_and_every_record_reaches_the_tables_once(
    start_job, tmp_path, killed, save_checkpoints_steps, seed
):
    steps_log = tmp_path / "steps.log"
    job = start_job(
        "tables.py",
        strategy="hybrid",
        mode="async",
        audit=True,
        optimizer="SGD",
        lr=0.05,
        num_workers=2,
        num_ps=2,
        num_batches=2 * STEPS,
        batch=BATCH,
        step_delay_s=0.03,
        step_log=str(steps_log),
        max_restarts=2,
        save_checkpoints_steps=save_checkpoints_steps,
    )
    _wait_for_batches(job, steps_log, random.Random(seed).randint(8, 40))
    job.roles()[killed].kill()
    code, output = job.finish(120)
    assert code == 0, output
    if killed.startswith("ps"):  # every worker and PS went back to the latest checkpoint (or the start)
        assert "restarting it" in output and "every PS restored to global step" in output, output
    else:
        assert "restarting it" in output and "joined the all-reduce group at global step" in output, output
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["global_step"] == STEPS, output
    applied = _applied(tmp_path / "model")
    twice, never = (applied > 1).nonzero().view(-1), (applied < 1).nonzero().view(-1)
    assert not twice.numel() and not never.numel(), f"applied twice: {twice.tolist()}; never: {never.tolist()}"
    assert torch.equal(applied, torch.ones_like(applied))
