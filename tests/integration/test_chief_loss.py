"""Losing the chief: the PS and workers keep their state and wait for it; a restarted chief (its supervisor's
doing, as a JobSet's or Slurm's restart policy would) resumes from the live PS at the exact global step, and every
record's gradient is applied exactly once. The chief dies inside a checkpoint save (SHARDFLOW_FAULT), its files
written but not renamed into place: the worst moment for the checkpoint."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from shardflow.train import checkpoint

from .test_cluster_environments import _free_ports

JOBS = Path(__file__).parent / "jobs"
NUM_RECORDS, BATCH = 1024, 8


def test_a_chief_killed_mid_checkpoint_and_restarted_resumes_from_the_live_ps_exactly(tmp_path):
    ports = _free_ports(5)
    cluster = {
        "chief": [f"127.0.0.1:{ports[0]}"],
        "ps": [f"127.0.0.1:{ports[1]}", f"127.0.0.1:{ports[2]}"],
        "worker": [f"127.0.0.1:{ports[3]}", f"127.0.0.1:{ports[4]}"],
    }
    model_dir = tmp_path / "model"
    config = tmp_path / "config.json"
    job = {"model_dir": str(model_dir), "result": str(tmp_path / "result.json"), "mode": "async"}
    config.write_text(json.dumps({**job, "save_checkpoints_steps": 16, "step_delay_s": 0.01}))
    fault = {"role": "chief", "point": "checkpoint", "step": 32, "marker": str(tmp_path / "fault.fired")}
    base_env = {**os.environ, "SHARDFLOW_FAULT": json.dumps(fault), "SHARDFLOW_CLUSTER_SECRET": "chief-loss"}

    def start(task_type: str, index: int) -> subprocess.Popen[str]:
        task = {"type": task_type, "index": index}
        env = {**base_env, "TF_CONFIG": json.dumps({"cluster": cluster, "task": task})}
        command = [sys.executable, str(JOBS / "audit.py"), str(config)]
        return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    procs = {name: start(*name) for name in (("chief", 0), ("ps", 0), ("ps", 1), ("worker", 0), ("worker", 1))}
    outputs: dict[tuple[str, int], str] = {}
    try:
        first_out, _ = procs["chief", 0].communicate(timeout=120)
        assert procs["chief", 0].returncode == -signal.SIGKILL, first_out
        # The checkpoint being saved is not there; the one before is intact.
        intact = checkpoint.latest(model_dir)
        assert intact is not None and intact.name.endswith("16"), intact
        procs["chief", 0] = start("chief", 0)
        outputs = {name: p.communicate(timeout=150)[0] for name, p in procs.items()}
    finally:
        for p in procs.values():
            p.kill()
    described = "\n".join(
        f"--- {name} exited {procs[name].returncode}:\n{out[-3000:]}" for name, out in outputs.items()
    )
    assert [p.returncode for p in procs.values()] == [0] * 5, described
    chief = outputs["chief", 0]
    assert "the chief was restarted: resumed from the live parameter servers at global step" in chief, chief
    resumed_at = int(chief.split("resumed from the live parameter servers at global step ")[1].split()[0])
    assert resumed_at >= 32, chief
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["global_step"] == NUM_RECORDS // BATCH
    applied = load_file(str(Path(result["checkpoint"]) / "model.safetensors"))["seen"]
    counts = torch.bincount(applied.round().long(), minlength=3)
    assert torch.equal(applied, torch.ones_like(applied)), f"records applied 0, 1, 2.. times: {counts.tolist()}"
