"""Row-sparse embeddings on real local clusters: sync training equals one process on the concatenated batches
while only the looked-up rows move, and checkpoints of the tables and their slots restore onto more PS."""

from __future__ import annotations

import gzip
import importlib.util
import json
from collections import defaultdict
from pathlib import Path

import torch

from shardflow.train.checkpoints import store

JOB = Path(__file__).parent / "jobs" / "embedding.py"
_spec = importlib.util.spec_from_file_location("embedding_job", JOB)
assert _spec is not None and _spec.loader is not None
job = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(job)


def final_state(model_dir: Path) -> tuple[dict[str, torch.Tensor], dict]:
    latest = store.latest(model_dir)
    assert latest is not None, f"no checkpoint in {model_dir}"
    state, manifest = store.load_state(latest)
    return {**state.params, **{f"{k}/{n}": t for k, d in state.slots.items() for n, t in d.items()}}, manifest


def test_sync_two_workers_with_sparse_embeddings_equals_single_process_and_pulls_only_rows(run_job, tmp_path):
    steps, batch = 8, 8
    proc, result = run_job(
        "embedding.py",
        mode="sync",
        num_workers=2,
        num_ps=2,
        num_batches=2 * steps,
        batch=batch,
        optimizer="Adagrad",
        lr=0.1,
        profile_steps=[3, 6],
    )
    assert proc.returncode == 0, proc.stdout
    assert result["global_step"] == steps

    # One process, the same model and torch.optim.Adagrad, on the two workers' batches concatenated.
    model = job.one_process(steps, batch)
    trained, manifest = final_state(tmp_path / "model")
    for name, expected in model.state_dict().items():
        torch.testing.assert_close(trained[name], expected, atol=1e-5, rtol=0, msg=name)
    slices = [p for p in manifest["placement"]["pieces"] if p["name"] == "ids.weight"]
    assert sorted(p["ps"] for p in slices) == [0, 1] and all(p["sparse"] for p in slices)

    # What each worker pulled in each captured step: the dense head and the rows its batch looks up.
    with gzip.open(Path(result["profile_dir"]) / "merged.trace.json.gz") as f:
        trace = json.load(f)
    roles = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "process_name"}
    pulled: dict[tuple[str, int], int] = defaultdict(int)
    pushed: dict[tuple[str, int], int] = defaultdict(int)
    for event in trace["traceEvents"]:
        if event["ph"] == "X" and event["name"] in ("pull_wait", "push"):
            moved = pulled if event["name"] == "pull_wait" else pushed
            moved[(roles[event["pid"]], event["args"]["step"])] += event["args"].get("bytes", 0)
    table_bytes = model.ids.weight.nbytes
    assert set(pulled) == {(f"worker:{w}", s) for w in (0, 1) for s in (3, 4, 5)}
    assert 0 < max(pulled.values()) < table_bytes / 20
    assert 0 < max(pushed.values()) < table_bytes / 20


def test_a_checkpoint_of_sparse_tables_and_their_lazy_adam_slots_resumes_exactly_on_more_ps(run_job, tmp_path):
    common = {"mode": "sync", "num_workers": 2, "num_batches": 40, "optimizer": "Adam", "lr": 0.05}
    run_job("embedding.py", num_ps=2, max_steps=8, model_dir=str(tmp_path / "whole"), **common)
    first = run_job("embedding.py", num_ps=2, max_steps=4, model_dir=str(tmp_path / "part"), **common)[1]
    proc, second = run_job("embedding.py", num_ps=3, max_steps=8, model_dir=str(tmp_path / "part"), **common)
    assert proc.returncode == 0, proc.stdout
    assert (first["global_step"], second["start_step"], second["global_step"]) == (4, 4, 8)

    whole, _ = final_state(tmp_path / "whole")
    resumed, manifest = final_state(tmp_path / "part")
    assert sorted(p["ps"] for p in manifest["placement"]["pieces"] if p["name"] == "ids.weight") == [0, 1, 2]
    assert {"exp_avg/ids.weight", "exp_avg_sq/tags.weight"} <= set(whole) and set(whole) == set(resumed)
    for name, tensor in whole.items():
        torch.testing.assert_close(resumed[name], tensor, atol=1e-5, rtol=1e-5, msg=name)
