"""Checkpoints of real local clusters: exact resume, re-sharding onto more PS, epochs across worker counts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from shardflow.train.checkpoints import store

JOB = Path(__file__).parent / "jobs" / "resumable.py"
NUM_RECORDS = 240


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("ids")
    for part in range(6):
        ids = range(part, NUM_RECORDS, 6)
        (directory / f"part-{part}.txt").write_text("".join(f"{i}\n" for i in ids))
    return directory


def start(
    tmp_path: Path, data_dir: Path, name: str, model_dir: Path | None = None, **config
) -> subprocess.CompletedProcess:
    config = {
        "data_dir": str(data_dir),
        "num_records": NUM_RECORDS,
        "model_dir": str(model_dir or tmp_path / name),
        "result": str(tmp_path / f"{name}.json"),
        **config,
    }
    path = tmp_path / f"{name}.config.json"
    path.write_text(json.dumps(config))
    return subprocess.run([sys.executable, str(JOB), str(path)], capture_output=True, text=True, timeout=240)


def run(tmp_path: Path, data_dir: Path, name: str, model_dir: Path | None = None, **config) -> dict:
    proc = start(tmp_path, data_dir, name, model_dir, **config)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (tmp_path / f"{name}.log").write_text(proc.stdout + proc.stderr)
    return json.loads((tmp_path / f"{name}.json").read_text())


def batches(log: Path, worker: int) -> list[list[int]]:
    return [json.loads(line) for line in Path(f"{log}.{worker}").read_text().splitlines()]


def final_state(model_dir: Path) -> tuple[dict[str, torch.Tensor], dict]:
    latest = store.latest(model_dir)
    assert latest is not None, f"no checkpoint in {model_dir}"
    state, manifest = store.load_state(latest)
    return {**state.params, **{f"{k}/{n}": t for k, d in state.slots.items() for n, t in d.items()}}, manifest


def test_resume_after_a_stop_at_a_checkpoint_is_exact_even_onto_more_ps(tmp_path, data_dir):
    # Uninterrupted: 2 PS, sync, 20 steps. Interrupted: stop at step 10, then resume on 3 PS to step 20.
    # Small slices, so variables are cut differently on 2 and 3 PS and the Adam slots must be re-sharded.
    common: dict[str, Any] = {"mode": "sync", "num_workers": 2, "min_slice_bytes": 256, "epochs": 10}
    run(tmp_path, data_dir, "whole", num_ps=2, max_steps=20, batch_log=str(tmp_path / "whole"), **common)
    first = run(tmp_path, data_dir, "part1", num_ps=2, max_steps=10, batch_log=str(tmp_path / "part"), **common)
    second = run(
        tmp_path,
        data_dir,
        "part2",
        model_dir=tmp_path / "part1",
        num_ps=3,
        max_steps=20,
        batch_log=str(tmp_path / "part"),
        **common,
    )
    assert (first["global_step"], second["start_step"], second["global_step"]) == (10, 10, 20)

    # The same batches follow the restore, on every worker.
    for worker in (0, 1):
        assert batches(tmp_path / "part", worker) == batches(tmp_path / "whole", worker)

    whole, _ = final_state(tmp_path / "whole")
    resumed, manifest = final_state(tmp_path / "part1")
    assert manifest["num_ps"] == 3
    assert {k for k in whole if k.startswith("exp_avg")} and set(whole) == set(resumed)
    for name, tensor in whole.items():
        torch.testing.assert_close(resumed[name], tensor, atol=1e-5, rtol=1e-5, msg=name)


def test_periodic_checkpoints_are_taken_at_exact_steps_and_only_the_newest_kept(tmp_path, data_dir):
    run(tmp_path, data_dir, "periodic", num_ps=2, max_steps=25, save_checkpoints_steps=5, keep_checkpoint_max=3)
    names = sorted(p.name for p in (tmp_path / "periodic" / "checkpoints").glob("ckpt-*"))
    assert names == ["ckpt-000000015", "ckpt-000000020", "ckpt-000000025"]
    state, _ = store.load_state(tmp_path / "periodic" / "checkpoints" / "ckpt-000000015")
    # Each worker's input position belongs to the same step: 15 batches of each worker were trained on.
    assert {w: s["consumed"] for w, s in state.iterators.items()} == {"worker:0": 15, "worker:1": 15}


def test_a_flipped_digit_in_the_newest_manifest_resumes_from_the_checkpoint_before_and_names_it(tmp_path, data_dir):
    run(tmp_path, data_dir, "flipped", num_ps=2, max_steps=10, save_checkpoints_steps=5)
    damaged = tmp_path / "flipped" / "checkpoints" / "ckpt-000000010"
    text = (damaged / "manifest.json").read_text()
    assert '"consumed": 10' in text  # a worker's input position
    (damaged / "manifest.json").write_text(text.replace('"consumed": 10', '"consumed": 11', 1))
    result = run(tmp_path, data_dir, "rerun", model_dir=tmp_path / "flipped", num_ps=2, max_steps=15)
    assert (result["start_step"], result["global_step"]) == (5, 15)
    assert f"skipping damaged checkpoint {damaged}: manifest.json has CRC-32C" in (tmp_path / "rerun.log").read_text()


@pytest.mark.parametrize("num_workers", [1, 2, 4])
def test_epochs_mean_every_record_is_seen_k_times_across_the_cluster(tmp_path, data_dir, num_workers):
    log = tmp_path / "seen"
    result = run(
        tmp_path,
        data_dir,
        f"epochs{num_workers}",
        mode="async",
        num_ps=1,
        num_workers=num_workers,
        epochs=2,
        batch_log=str(log),
    )
    seen = Counter(i for w in range(num_workers) for batch in batches(log, w) for i in batch)
    assert seen == Counter({i: 2 for i in range(NUM_RECORDS)})
    assert result["global_step"] == 2 * NUM_RECORDS // 4


@pytest.mark.parametrize("new_workers", [3, 1])
def test_a_restore_onto_another_worker_count_keeps_epochs_exact(tmp_path, data_dir, new_workers):
    # 2 workers stop in the middle of the first epoch; the job resumes with another count and runs out its 2 epochs.
    log = tmp_path / "seen"
    common: dict[str, Any] = {"mode": "sync", "num_ps": 1, "epochs": 2, "batch_log": str(log)}
    first = run(tmp_path, data_dir, "before", num_workers=2, max_steps=10, **common)
    second = run(tmp_path, data_dir, "after", model_dir=tmp_path / "before", num_workers=new_workers, **common)
    assert (first["global_step"], second["start_step"]) == (10, 10)
    seen = Counter(i for w in range(max(2, new_workers)) for batch in batches(log, w) for i in batch)
    assert seen == Counter({i: 2 for i in range(NUM_RECORDS)})


def test_evaluation_during_training_and_early_stopping(tmp_path, data_dir):
    # An improvement of 100 never happens, so training stops after 1 + patience evaluations.
    result = run(
        tmp_path,
        data_dir,
        "early",
        num_ps=1,
        max_steps=1000,
        epochs=100,
        eval_every_n_steps=5,
        early_stopping={"metric": "loss", "patience": 2, "min_delta": 100.0},
    )
    assert result["stopped_early"]
    assert [e["global_step"] for e in result["eval_history"]][:3] == [5, 10, 15]
    # Training stops soon after the third evaluation (the chief evaluates while workers go on).
    assert result["global_step"] < 200
    assert result["metrics"]["loss"] >= 0


def test_early_stopping_counts_the_evaluations_of_the_run_before_a_resume(tmp_path, data_dir):
    # Patience 3, an improvement of 100 never happens: the first run is stopped by a tight max_steps after 2
    # evaluations; run again to more steps, the chief reads them back (eval/history.jsonl) and stops at its 2nd.
    stopping = {"metric": "loss", "patience": 3, "min_delta": 100.0}
    common: dict[str, Any] = {"num_ps": 1, "epochs": 100, "eval_every_n_steps": 5, "early_stopping": stopping}
    first = run(tmp_path, data_dir, "first", max_steps=10, **common)
    assert [e["global_step"] for e in first["eval_history"]] == [5, 10] and not first["stopped_early"]
    second = run(tmp_path, data_dir, "second", model_dir=tmp_path / "first", max_steps=1000, **common)
    assert second["stopped_early"], second
    assert second["eval_history"][:2] == first["eval_history"]
    own = [e["global_step"] for e in second["eval_history"][2:]]
    # Stopped at its second evaluation (15, 20); the final one of the step it stopped at may follow.
    assert own[:2] == [15, 20] and len(own) <= 3, own
    assert all(e["elapsed_s"] >= first["eval_history"][-1]["elapsed_s"] for e in second["eval_history"][2:])


def test_early_stopping_on_the_side_car_evaluators_evaluations(tmp_path, data_dir):
    # The evaluator evaluates checkpoints (every 5 steps); an improvement of 100 never happens, so the chief ends
    # training once it reads 1 + patience of them from eval/history.jsonl, long before max_steps.
    stopping = {"metric": "loss", "patience": 2, "min_delta": 100.0}
    result = run(
        tmp_path,
        data_dir,
        "sidestop",
        num_ps=1,
        max_steps=100_000,
        epochs=1000,
        save_checkpoints_steps=5,
        evaluator=True,
        eval_every_n_steps=5,
        early_stopping=stopping,
    )
    history = [json.loads(line) for line in (tmp_path / "sidestop" / "eval" / "history.jsonl").read_text().splitlines()]
    assert result["stopped_early"], result
    assert len(history) >= 3 and result["global_step"] < 100_000
    chief_log = (tmp_path / "sidestop" / "logs" / "chief.log").read_text()
    assert "early stopping: the evaluator's loss stopped improving" in chief_log


def test_side_car_evaluator_follows_checkpoints_and_reports_the_final_metrics(tmp_path, data_dir):
    result = run(tmp_path, data_dir, "sidecar", num_ps=1, max_steps=20, save_checkpoints_steps=5, evaluator=True)
    history = [json.loads(line) for line in (tmp_path / "sidecar" / "eval" / "history.jsonl").read_text().splitlines()]
    assert history[-1]["global_step"] == 20
    assert result["metrics"] == history[-1]["metrics"]
    assert (tmp_path / "sidecar" / "logs" / "evaluator.log").exists()


def test_tensorboard_events_are_readable_by_tensorboards_own_reader(tmp_path, data_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run(tmp_path, data_dir, "tb", num_ps=1, max_steps=400, epochs=100, eval_every_n_steps=100)
    train = EventAccumulator(str(tmp_path / "tb" / "tensorboard"))
    train.Reload()
    assert {"loss", "input_wait_share", "steps_per_sec/worker:0"} <= set(train.Tags()["scalars"])
    evaluation = EventAccumulator(str(tmp_path / "tb" / "tensorboard" / "eval"))
    evaluation.Reload()
    assert [e.step for e in evaluation.Scalars("loss")][:4] == [100, 200, 300, 400]


def test_a_kill_during_a_save_leaves_the_previous_checkpoint_loadable(tmp_path):
    script = tmp_path / "saver.py"
    script.write_text(
        "import sys, torch\n"
        "from shardflow.train.checkpoints import store\n"
        "step = 0\n"
        "while True:\n"
        "    step += 1\n"
        "    store.save(sys.argv[1], step, {'w': torch.full((1_000_000,), float(step))}, {}, keep=2)\n"
        "    print(step, flush=True)\n"
    )
    for delay in (0.9, 1.3, 1.7):
        proc = subprocess.Popen([sys.executable, str(script), str(tmp_path / "m")], stdout=subprocess.PIPE, text=True)
        try:
            assert proc.stdout is not None
            proc.stdout.readline()  # at least one checkpoint is complete
            import time

            time.sleep(delay)
        finally:
            os.kill(proc.pid, 9)
            proc.wait()
        latest = store.latest(tmp_path / "m")
        assert latest is not None
        tensors, manifest = store.load(latest)
        assert torch.all(tensors["w"] == manifest["global_step"])


def test_a_checkpoint_that_cannot_be_saved_is_logged_and_training_goes_on_exactly(tmp_path, data_dir):
    # The disk is full while step 10 is saved, the second of the checkpoints every 5 steps.
    common: dict[str, Any] = {"num_ps": 2, "max_steps": 20, "save_checkpoints_steps": 5, "keep_checkpoint_max": 10}
    proc = start(tmp_path, data_dir, "full", full_disk_at=[10], **common)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads((tmp_path / "full.json").read_text())
    assert (result["global_step"], result["failed_checkpoint_saves"]) == (20, 1)
    root = store.directory(tmp_path / "full")
    (line,) = [line for line in proc.stderr.splitlines() if "not saved" in line]
    assert (
        f"checkpoint at global step 10 not saved in {root}: No space left on device (ENOSPC); training goes on" in line
    )
    assert "Traceback" not in proc.stderr
    assert sorted(p.name for p in root.iterdir()) == ["ckpt-000000005", "ckpt-000000015", "ckpt-000000020", "latest"]
    state, _ = store.load_state(root / "ckpt-000000015")
    assert {w: s["consumed"] for w, s in state.iterators.items()} == {"worker:0": 15, "worker:1": 15}


def test_a_final_checkpoint_that_cannot_be_saved_fails_the_job_with_one_clear_error(tmp_path, data_dir):
    proc = start(tmp_path, data_dir, "final", num_ps=1, max_steps=12, save_checkpoints_steps=5, full_disk_at=[12])
    assert proc.returncode != 0
    root = store.directory(tmp_path / "final")
    assert proc.stderr.splitlines()[-1] == (
        f"shardflow.train.checkpoints.manager.CheckpointSaveError: checkpoint at global step 12 could not be saved in "
        f"{root}: No space left on device (ENOSPC); it is the final checkpoint: a re-run resumes from "
        f"{root / 'ckpt-000000010'}"
    )
    assert proc.stderr.count("Traceback") == 1 and "job.json" not in proc.stderr
    assert sorted(p.name for p in root.iterdir()) == ["ckpt-000000005", "ckpt-000000010", "latest"]
    assert not (tmp_path / "final" / "job.json").exists()
