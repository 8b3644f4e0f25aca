"""Losing the chief: the PS and workers keep their state and wait for it; a restarted chief (its supervisor's
doing, as a JobSet's or Slurm's restart policy would) resumes from the live PS at the exact global step, and every
record's gradient is applied exactly once. The chief dies inside a checkpoint save (SHARDFLOW_FAULT), its files
written but not renamed into place: the worst moment for the checkpoint."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import torch
from safetensors.torch import load_file

from shardflow.train.checkpoints import store

from .conftest import TFConfigJob

NUM_RECORDS, BATCH = 1024, 8


def test_a_chief_killed_mid_checkpoint_and_restarted_resumes_from_the_live_ps_exactly(tmp_path):
    model_dir = tmp_path / "model"
    config = tmp_path / "config.json"
    job = {"model_dir": str(model_dir), "result": str(tmp_path / "result.json"), "mode": "async"}
    config.write_text(json.dumps({**job, "save_checkpoints_steps": 16, "step_delay_s": 0.01}))
    fault = {"role": "chief", "point": "checkpoint", "step": 32, "marker": str(tmp_path / "fault.fired")}
    env = {**os.environ, "SHARDFLOW_FAULT": json.dumps(fault), "SHARDFLOW_CLUSTER_SECRET": "chief-loss"}
    roles = TFConfigJob("audit.py", config, env)
    try:
        first_out, _ = roles.procs["chief", 0].communicate(timeout=120)
        assert roles.procs["chief", 0].returncode == -signal.SIGKILL, first_out
        # The checkpoint being saved is not there; the one before is intact.
        intact = store.latest(model_dir)
        assert intact is not None and intact.name.endswith("16"), intact
        roles.start("chief", 0)
        outputs = roles.finish()
    finally:
        roles.kill()
    assert [p.returncode for p in roles.procs.values()] == [0] * 5, roles.describe(outputs)
    chief = outputs["chief", 0]
    assert "the chief was restarted: resumed from the live parameter servers at global step" in chief, chief
    resumed_at = int(chief.split("resumed from the live parameter servers at global step ")[1].split()[0])
    assert resumed_at >= 32, chief
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["global_step"] == NUM_RECORDS // BATCH
    applied = load_file(str(Path(result["checkpoint"]) / "model.safetensors"))["seen"]
    counts = torch.bincount(applied.round().long(), minlength=3)
    assert torch.equal(applied, torch.ones_like(applied)), f"records applied 0, 1, 2.. times: {counts.tolist()}"
