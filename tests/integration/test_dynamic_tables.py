"""A dynamic table on a real local cluster, fed millions of distinct hashed ids from a 2^62 space (Zipf): admission
after 2 sightings makes rows for exactly the ids seen at least twice; expiry and the per-PS capacity hold."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

from shardflow.ps.embeddings.chains import replay
from shardflow.ps.embeddings.files import read_header
from shardflow.ps.embeddings.table import ShardTable
from shardflow.train.checkpoints import store

JOB = Path(__file__).parent / "jobs" / "dynamic.py"
_spec = importlib.util.spec_from_file_location("dynamic_job", JOB)
assert _spec is not None and _spec.loader is not None
job = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(job)


def saved_rows(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The dynamic table's rows in `checkpoint` with their counters, read into one PS."""
    state, _ = store.load_state(checkpoint)
    assert state.tables is not None, f"{checkpoint} holds no tables"
    chain = state.tables.chains["users"]
    spec, _ = read_header(checkpoint / chain[0])  # as the job resolved it, with its row optimizer
    assert spec.optimizer is not None
    table = ShardTable(spec, spec.optimizer, 0, 1)
    replay([(checkpoint / path, None) for path in chain], spec, table.load_rows)
    return table.rows_state(changed_only=False)


def test_admission_after_two_sightings_makes_rows_for_exactly_the_ids_seen_twice(run_job):
    config = {"num_batches": 100, "batch": 2048, "num_ranks": 1 << 40}
    proc, result = run_job("dynamic.py", timeout_s=300, **config)
    assert proc.returncode == 0, proc.stdout
    assert result["global_step"] == 100
    ids, counts = np.unique(job.make_ids(100, 2048, 1 << 40), return_counts=True)
    assert ids.size > 1_500_000 and (counts >= 2).sum() < ids.size // 5  # ~2M distinct ids, most seen once
    rows = saved_rows(Path(result["checkpoint"]))
    expected = torch.from_numpy(ids[counts >= 2])
    missing, extra = np.setdiff1d(expected, rows["ids"]).size, np.setdiff1d(rows["ids"], expected).size
    assert torch.equal(rows["ids"], expected), f"{missing} ids seen twice have no row; {extra} rows of ids seen once"
    # Every sighting of an id is counted, the one that admitted it included.
    assert torch.equal(rows["counts"], torch.from_numpy(counts[counts >= 2]))


def test_expiry_and_capacity_bound_the_rows_of_each_ps(run_job):
    capacity, expire = 20_000, 40
    config = {"num_batches": 120, "batch": 512, "num_ranks": 1 << 40, "admit_after": 1}
    limits = {"capacity_per_ps": capacity, "expire_after_steps": expire}
    proc, result = run_job("dynamic.py", profile_steps=[60, 70], **limits, **config)
    assert proc.returncode == 0, proc.stdout
    stats = {
        name: {key.rsplit("/", 1)[1]: value for key, value in ps.items() if key.startswith("table/users/")}
        for name, ps in result["ps_stats"].items()
    }
    assert all(s["rows"] <= capacity for s in stats.values()), stats
    assert all(s["evicted"] > 0 and s["expired"] > 0 for s in stats.values()), stats
    rows = saved_rows(Path(result["checkpoint"]))
    # Each row was seen within the last `expire` steps (checked at most every expire // 8 steps).
    assert int(rows["last_seen"].min()) >= result["global_step"] - expire - expire // 8, rows["last_seen"].min()

    # The counters are in the capture too: `shardflow profile steps` shows them per PS.
    model_dir = Path(result["checkpoint"]).parents[1]
    shown = subprocess.run(
        [sys.executable, "-m", "shardflow", "profile", "steps", str(model_dir)], capture_output=True, text=True
    )
    assert shown.returncode == 0, shown.stderr
    assert "sf.nn tables" in shown.stdout and all(f"ps:{k}" in shown.stdout for k in (0, 1)), shown.stdout
