"""`sf.nn` tables on real local clusters: sync training equals one process with torch's sparse optimizers, and a
checkpoint of 2 PS (full and increments) restores onto 3 PS with the same rows."""

from __future__ import annotations

import functools
import importlib.util
import json
import time
from pathlib import Path

import psutil
import pytest
import torch

import shardflow as sf
from shardflow.nn.modules import table_specs
from shardflow.ps.embeddings.chains import replay
from shardflow.ps.embeddings.init import initial_rows
from shardflow.ps.embeddings.table import ShardTable
from shardflow.train.checkpoints import store
from shardflow.train.checkpoints.table_rows import CheckpointRows

JOB = Path(__file__).parent / "jobs" / "tables.py"
_spec = importlib.util.spec_from_file_location("tables_job", JOB)
assert _spec is not None and _spec.loader is not None
job = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(job)

# The job's optimizer, and what one process applies: the dense head's and the tables' (torch's sparse path).
_REFERENCE = {
    "SGD": (torch.optim.SGD, torch.optim.SGD),
    "Adagrad": (torch.optim.Adagrad, torch.optim.Adagrad),
    "Adam": (torch.optim.Adam, torch.optim.SparseAdam),
}


def one_process(
    optimizer: str, lr: float, steps: int, batch: int, num_batches: int | None = None
) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """The same model with torch.nn.Embedding(sparse=True) tables holding the rows the PS initialise, trained in one
    process on two workers' batches concatenated, as a sync job with 2 workers takes them (`num_batches` odd: the
    last step has worker:0's batch alone)."""
    num_batches = num_batches or 2 * steps
    data = job.make_data(num_batches, batch)
    torch.manual_seed(0)  # as the job's model_fn: the sf.nn tables draw nothing from torch's generator
    model = job.Model()
    specs = {spec.name: spec for spec in table_specs(model)}
    ids = torch.nn.Embedding(job.NUM_IDS, job.DIM, sparse=True)
    tags = torch.nn.EmbeddingBag(job.NUM_TAGS, 4, mode="mean", sparse=True)
    with torch.no_grad():
        ids.weight.copy_(initial_rows(specs["ids"], torch.arange(job.NUM_IDS)))
        tags.weight.copy_(initial_rows(specs["tags"], torch.arange(job.NUM_TAGS)))
    dense_cls, sparse_cls = _REFERENCE[optimizer]
    optimizers = [dense_cls(model.head.parameters(), lr=lr), sparse_cls([ids.weight, tags.weight], lr=lr)]
    for step in range(steps):
        rows = slice(2 * step * batch, min(2 * step + 2, num_batches) * batch)
        b = {key: value[rows] for key, value in data.items()}
        for o in optimizers:
            o.zero_grad()
        out = model.head(torch.cat([ids(b["ids"]).mean(dim=1), tags(b["tags"])], dim=1))
        torch.nn.functional.mse_loss(out, b["targets"]).backward()
        for o in optimizers:
            o.step()
    return model, {"ids": ids.weight.detach(), "tags": tags.weight.detach()}


def assert_equals_one_process(
    model_dir: Path, reference: tuple[torch.nn.Module, dict[str, torch.Tensor]], atol: float = 1e-5
) -> None:
    """The latest checkpoint's dense head and table rows equal `reference` (one_process's model and tables)."""
    model, expected = reference
    params, rows = trained_tables(model_dir)
    head: torch.nn.Module = model.head  # type: ignore[assignment]
    for name, value in head.state_dict().items():
        torch.testing.assert_close(params[f"head.{name}"], value, atol=atol, rtol=0, msg=name)
    for name, weights in expected.items():
        got = rows[name].lookup(torch.arange(weights.shape[0]))
        torch.testing.assert_close(got, weights, atol=atol, rtol=0, msg=name)


def trained_tables(model_dir: Path) -> tuple[dict[str, torch.Tensor], dict[str, CheckpointRows]]:
    latest = store.latest(model_dir)
    assert latest is not None, f"no checkpoint in {model_dir}"
    state, manifest = store.load_state(latest)
    assert state.tables is not None, f"{latest} holds no sf.nn tables: {sorted(manifest)}"
    specs = {spec.name: spec for spec in table_specs(job.Model())}
    rows = {
        name: CheckpointRows(latest, name, functools.partial(initial_rows, specs[name])) for name in state.tables.chains
    }
    return state.params, rows


@pytest.mark.parametrize(
    ("strategy", "optimizer", "accumulation"),
    [
        ("ps", "SGD", 1),
        ("ps", "Adagrad", 1),
        ("ps", "Adam", 1),
        ("hybrid", "Adagrad", 1),
        ("hybrid", "Adam", 1),
        ("hybrid", "Adagrad", 2),
    ],
)
def test_sync_training_of_sf_nn_tables_equals_one_process_with_torch_sparse_optimizers(
    run_job, tmp_path, strategy, optimizer, accumulation
):
    """ParameterServerStrategy in sync mode, and HybridStrategy with sparse_mode="sync" (the head all-reduced, the
    tables' rows applied once per global step on the PS). With gradient accumulation, each worker pushes the rows'
    gradients of its batches of a step to every PS at once, and the PS apply their mean over the workers once per
    global step, as one process does on all of them together."""
    steps, batch, lr = 6 // accumulation, 8, 0.1
    proc, result = run_job(
        "tables.py",
        strategy=strategy,
        optimizer=optimizer,
        lr=lr,
        mode="sync",
        num_workers=2,
        num_ps=2,
        accumulation=accumulation,
        num_batches=2 * accumulation * steps,
    )
    assert proc.returncode == 0, proc.stdout
    assert result["global_step"] == steps
    # Each of one_process's steps takes 2 of its batches: one per worker, of `accumulation` of the job's batches.
    assert_equals_one_process(tmp_path / "model", one_process(optimizer, lr, steps, accumulation * batch))


def test_a_table_of_40_million_rows_trains_while_the_chief_and_workers_hold_none_of_it(start_job, tmp_path):
    """2.4 GiB of rows (40M x 16 float32) on 2 PS: the chief and each worker stay under 700 MiB of peak RSS,
    measured from outside the job, and the loss falls."""
    running = start_job(
        "tables.py", num_ids=40_000_000, optimizer="SGD", lr=0.05, mode="async", num_batches=120, batch=256
    )
    peak: dict[str, int] = {}
    chief = psutil.Process(running.proc.pid)  # a local cluster's chief is the process the user started
    while running.proc.poll() is None:
        for name, process in {**running.roles(), "chief": chief}.items():
            try:
                peak[name] = max(peak.get(name, 0), process.memory_info().rss)
            except psutil.Error:
                continue
        time.sleep(0.05)
    code, out = running.finish(10)
    assert code == 0, out
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["global_step"] == 120
    assert result["final_loss"] < result["first_loss"]
    mib = {name: rss >> 20 for name, rss in peak.items()}
    print("peak RSS MiB:", mib)
    assert {"chief", "worker:0", "worker:1", "ps:0", "ps:1"} <= set(mib), mib
    assert all(mib[name] < 700 for name in ("chief", "worker:0", "worker:1")), mib
    # The rows are on the PS: each holds its half (1.2 GiB), made there.
    assert all(mib[f"ps:{k}"] > 1200 for k in (0, 1)), mib


def _table_states(checkpoint: Path) -> dict[str, dict[str, torch.Tensor]]:
    """Every row of every table in `checkpoint` with its optimizer slots and counters, read into one PS."""
    state, _ = store.load_state(checkpoint)
    assert state.tables is not None
    specs = {spec.name: spec for spec in table_specs(job.Model(dynamic=True))}
    found = {}
    for name, chain in state.tables.chains.items():
        table = ShardTable(specs[name], sf.nn.lazy_adam(0.05, per_row_steps=specs[name].dynamic), 0, 1)
        replay([(checkpoint / path, None) for path in chain], specs[name], table.load_rows)
        found[name] = table.rows_state(changed_only=False)
    return found


def test_a_checkpoint_of_2_ps_with_increments_restored_onto_3_ps_trains_on_exactly(run_job, tmp_path):
    """Checkpoints every 2 steps: a full file per PS, then increments. Restored onto 3 PS (rows re-partitioned, the
    dynamic table's too), training goes on to the same rows and optimizer slots as a run that never stopped."""
    common = {"mode": "sync", "num_workers": 2, "num_batches": 16, "optimizer": "Adam", "lr": 0.05, "dynamic": True}
    common["save_checkpoints_steps"] = 2
    run_job("tables.py", num_ps=2, max_steps=8, model_dir=str(tmp_path / "whole"), **common)
    first = run_job("tables.py", num_ps=2, max_steps=5, model_dir=str(tmp_path / "part"), **common)[1]
    proc, second = run_job("tables.py", num_ps=3, max_steps=8, model_dir=str(tmp_path / "part"), **common)
    assert proc.returncode == 0, proc.stdout
    assert (first["global_step"], second["start_step"], second["global_step"]) == (5, 5, 8)
    whole, part = (store.latest(tmp_path / name) for name in ("whole", "part"))
    assert whole is not None and part is not None
    chains = store.load_state(store.named(tmp_path / "part", "ckpt-000000004") or part)[0].tables
    assert chains is not None and any("increment" in path for path in chains.chains["ids"]), chains
    expected, got = _table_states(whole), _table_states(part)
    assert set(expected) == set(got) == {"ids", "tags", "users"}
    for name in expected:
        assert torch.equal(got[name]["ids"], expected[name]["ids"]), name
        for key in expected[name]:
            torch.testing.assert_close(got[name][key], expected[name][key], atol=1e-6, rtol=0, msg=f"{name} {key}")


@pytest.mark.parametrize(
    "setting",
    [
        {"mode": "ssp", "clip_grad_norm": 0.5},
        {"mode": "sync", "clip_grad_norm": 0.5, "accumulation": 2},
        {"mode": "async", "accumulation": 2},
    ],
    ids=["ssp-clipped", "sync-clipped-accumulated", "async-accumulated"],
)
def test_sf_nn_tables_train_in_every_mode_with_clipping_and_accumulation(run_job, setting):
    steps_per_worker = 6
    batches = 2 * steps_per_worker * setting.get("accumulation", 1)
    proc, result = run_job("tables.py", optimizer="Adagrad", num_batches=batches, **setting)
    assert proc.returncode == 0, proc.stdout
    replicas = 2 if setting["mode"] == "sync" else 1
    assert result["global_step"] == 2 * steps_per_worker // replicas
    _, rows = trained_tables(Path(result["checkpoint"]).parents[1])
    ids = rows["ids"]
    assert torch.isfinite(ids.values).all() and len(ids) > 0


def test_a_nan_in_the_rows_gradient_of_one_batch_is_never_applied(run_job, tmp_path):
    """The loss is finite but the batch's rows get NaN gradients: the step is refused on every PS and counted, the
    rows stay finite, training goes on."""
    proc, result = run_job(
        "tables.py", mode="async", num_batches=12, nan_rows_at=5 * 8, max_nonfinite_updates=2, optimizer="SGD"
    )
    assert proc.returncode == 0, proc.stdout
    assert "NaN or inf" in proc.stdout
    assert result["global_step"] == 11
    assert all(stats["nonfinite"] == 1 for stats in result["ps_stats"].values()), result["ps_stats"]
    _, rows = trained_tables(tmp_path / "model")
    assert all(torch.isfinite(table.values).all() for table in rows.values())


def test_checkpoints_go_from_hybrid_to_the_ps_strategy_and_back_and_train_on_exactly(run_job, tmp_path):
    """HybridStrategy (2 PS) to step 2, ParameterServerStrategy (1 PS, everything on it) to 4, HybridStrategy again
    (2 PS) to 6, all sync with Adam: the dense head's Adam slots travel through the workers' hand-over, the tables'
    through the PS's files, and the result equals one process trained on every batch once."""
    steps, batch, lr = 6, 8, 0.1
    common = {"optimizer": "Adam", "lr": lr, "mode": "sync", "num_workers": 2, "num_batches": 2 * steps}
    results = [
        run_job("tables.py", strategy=strategy, num_ps=num_ps, max_steps=max_steps, **common)
        for strategy, num_ps, max_steps in (("hybrid", 2, 2), ("ps", 1, 4), ("hybrid", 2, 6))
    ]
    for proc, _ in results:
        assert proc.returncode == 0, proc.stdout
    assert [(r["start_step"], r["global_step"]) for _, r in results] == [(0, 2), (2, 4), (4, 6)]
    assert_equals_one_process(tmp_path / "model", one_process("Adam", lr, steps, batch))


def test_hybrid_sync_with_uneven_shards_equals_one_process(run_job, tmp_path):
    """11 batches over 2 workers: the last global step has worker:0's batch alone; worker:1, done, tells the PS,
    which apply that step's rows as the mean over the one worker with a batch, as one process does."""
    steps, batch, lr = 6, 8, 0.1
    proc, result = run_job(
        "tables.py", strategy="hybrid", optimizer="Adagrad", lr=lr, mode="sync", num_workers=2, num_batches=11
    )
    assert proc.returncode == 0, proc.stdout
    assert result["global_step"] == steps
    assert_equals_one_process(tmp_path / "model", one_process("Adagrad", lr, steps, batch, num_batches=11))


def test_hybrid_trains_in_ssp_mode(run_job):
    proc, result = run_job("tables.py", strategy="hybrid", optimizer="Adagrad", mode="ssp", num_batches=12)
    assert proc.returncode == 0, proc.stdout
    assert result["global_step"] == 6 and result["final_loss"] < result["first_loss"]


def test_time_based_evaluation_of_tables_on_two_async_ps_reads_one_step_of_every_ps(run_job):
    """EvalSpec(every_n_secs) on an async job with tables on 2 PS at full speed: the PS are a few pushes apart at
    any moment, so each evaluation reads a snapshot every PS takes at one step (its tables' files of that step)."""
    proc, result = run_job(
        "tables.py", timeout_s=120, mode="async", num_batches=1200, batch=4, eval_every_secs=0.25, optimizer="SGD"
    )
    assert proc.returncode == 0, proc.stdout
    during = [e for e in result["eval_history"] if e["global_step"] < result["global_step"]]
    assert len(during) >= 2, result["eval_history"]
    assert all(e["metrics"]["loss"] > 0 for e in result["eval_history"]), result["eval_history"]


def test_async_overlapped_training_of_one_worker_equals_one_process_one_step_stale(run_job, tmp_path):
    """Async with `overlap` (the default): step t is computed on the parameters of global step t - 2 (its push goes
    out before the reply to the one before is read), its rows too: from step 3 on they come with the reply to step
    t - 2's push, on which their lookup rode. The first step reads the initial rows, the second the rows after step
    1 (looked up when its forward asks, after step 1's push). One worker, 2 PS, SGD: one process doing the same
    equals the job to 1e-5, and every lookup after the first two rode on a push."""
    steps, batch, lr = 8, 8, 0.1
    proc, result = run_job(
        "tables.py", optimizer="SGD", lr=lr, mode="async", num_workers=1, num_ps=2, num_batches=steps, batch=batch
    )
    assert proc.returncode == 0, proc.stdout
    assert result["global_step"] == steps
    assert sum(stats["lookups_on_pushes"] for stats in result["ps_stats"].values()) == 2 * (steps - 2)
    assert_equals_one_process(tmp_path / "model", _one_stale_process(lr, steps, batch))


def _grad(param: torch.Tensor) -> torch.Tensor:
    assert param.grad is not None
    return param.grad


def _one_stale_process(lr: float, steps: int, batch: int) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """SGD on the job's model where step t's gradient is taken at the parameters after step t - 2 (the rows of step
    2 after step 1), as an overlapped async worker computes it."""
    data = job.make_data(steps, batch)
    torch.manual_seed(0)
    model = job.Model()
    specs = {spec.name: spec for spec in table_specs(model)}
    head: torch.nn.Module = model.head
    history = [
        (
            [p.detach().clone() for p in head.parameters()],
            initial_rows(specs["ids"], torch.arange(job.NUM_IDS)),
            initial_rows(specs["tags"], torch.arange(job.NUM_TAGS)),
        )
    ]
    for t in range(1, steps + 1):
        dense = history[max(t - 2, 0)][0]
        rows = history[1 if t == 2 else max(t - 2, 0)][1:]
        b = {key: value[(t - 1) * batch : t * batch] for key, value in data.items()}
        with torch.no_grad():
            for param, value in zip(head.parameters(), dense, strict=True):
                param.copy_(value)
        ids, tags = (r.clone().requires_grad_(True) for r in rows)
        head.zero_grad()
        features = [torch.nn.functional.embedding(b["ids"], ids).mean(dim=1)]
        features.append(torch.nn.functional.embedding_bag(b["tags"], tags, mode="mean"))
        torch.nn.functional.mse_loss(head(torch.cat(features, dim=1)), b["targets"]).backward()
        params, ids_now, tags_now = history[-1]
        assert ids.grad is not None and tags.grad is not None
        history.append(
            (
                [value - lr * _grad(param) for value, param in zip(params, head.parameters(), strict=True)],
                ids_now - lr * ids.grad,
                tags_now - lr * tags.grad,
            )
        )
    final, ids_rows, tags_rows = history[-1]
    with torch.no_grad():
        for param, value in zip(head.parameters(), final, strict=True):
            param.copy_(value)
    return model, {"ids": ids_rows, "tags": tags_rows}
