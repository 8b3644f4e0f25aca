"""Checkpoints that cannot be lost: each file's size and CRC-32C in the manifest, a damaged newest checkpoint skipped
for the one before, an intact copy at every instant of a save even when it crashes, and a finished job that a
re-run leaves alone."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import google_crc32c
import psutil
import pytest
import torch

from shardflow.train.checkpoints import store

HERE = Path(__file__).parent
REGRESSION_JOB = HERE.parent / "integration" / "jobs" / "regression.py"


def save(model_dir: Path, step: int, value: float, **manifest: Any) -> Path:
    return store.save(model_dir, step, {"w": torch.full((64,), value)}, manifest)


def names(model_dir: Path) -> list[str]:
    return sorted(p.name for p in (model_dir / "checkpoints").iterdir())


def test_manifest_lists_each_file_with_its_size_and_crc32c(tmp_path):
    path = save(tmp_path, 3, 1.5, mode="sync")
    data = (path / "model.safetensors").read_bytes()
    manifest = store.read_manifest(path)
    assert manifest["files"] == {
        "model.safetensors": {"bytes": len(data), "crc32c": f"{google_crc32c.value(data):08x}"}
    }
    assert store.latest(tmp_path) == path
    tensors, loaded = store.load(path)
    assert torch.equal(tensors["w"], torch.full((64,), 1.5))
    assert (loaded["global_step"], loaded["mode"]) == (3, "sync")
    assert names(tmp_path) == ["ckpt-000000003", "latest"]


def truncate(path: Path) -> None:
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])


def flip_last_byte(path: Path) -> None:
    data = bytearray((path / "model.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (path / "model.safetensors").write_bytes(bytes(data))


def flip_global_step_digit(path: Path) -> None:
    text = (path / "manifest.json").read_text()
    (path / "manifest.json").write_text(text.replace('"global_step": 2,', '"global_step": 3,'))


@pytest.mark.parametrize(
    ("damage", "problem"),
    [
        (truncate, "bytes, the manifest says"),
        (flip_last_byte, "CRC-32C"),
        (lambda path: (path / "manifest.json").unlink(), "manifest.json is missing"),
        (lambda path: (path / "manifest.json").write_text('{"global_step": 2,'), "not valid JSON"),
        (lambda path: (path / "model.safetensors").unlink(), "model.safetensors is missing"),
        (flip_global_step_digit, "manifest.json has CRC-32C"),
    ],
)
def test_a_damaged_newest_checkpoint_is_skipped_with_a_warning_for_the_one_before(tmp_path, caplog, damage, problem):
    intact = save(tmp_path, 1, 1.0)
    damaged = save(tmp_path, 2, 2.0)
    damage(damaged)
    with caplog.at_level(logging.WARNING, logger="shardflow.train.checkpoints.store"):
        assert store.latest(tmp_path) == intact
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert str(damaged) in warning and problem in warning
    # The evaluator asks every 0.5 s: the same damage is reported once.
    caplog.clear()
    assert store.latest(tmp_path) == intact
    assert not caplog.records


def test_a_checkpoint_written_before_the_manifest_listed_files_still_loads(tmp_path, caplog):
    path = save(tmp_path, 4, 1.0)
    manifest = store.read_manifest(path)
    del manifest["files"], manifest["manifest_crc32c"]
    (path / "manifest.json").write_text(json.dumps(manifest))
    with caplog.at_level(logging.WARNING):
        assert store.latest(tmp_path) == path
    assert store.load_state(path)[0].step == 4


def flip_input_position_digit(path: Path) -> None:
    text = (path / "manifest.json").read_text()
    assert text.count('"offset": 94') == 1
    (path / "manifest.json").write_text(text.replace('"offset": 94', '"offset": 84'))


def test_a_flipped_digit_in_the_manifest_input_positions_skips_that_checkpoint_naming_it(tmp_path, caplog):
    iterators = {"worker:0": {"file_index": 0, "offset": 94, "record_index": 3}}
    intact = save(tmp_path, 1, 1.0, iterators=iterators)
    damaged = save(tmp_path, 2, 2.0, iterators=iterators)
    flip_input_position_digit(damaged)
    with caplog.at_level(logging.WARNING, logger="shardflow.train.checkpoints.store"):
        assert store.latest(tmp_path) == intact
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert f"skipping damaged checkpoint {damaged}: manifest.json has CRC-32C" in warning
    state, _ = store.load_state(intact)  # what restore_latest loads after store.latest
    assert (state.step, state.iterators) == (1, iterators)


def test_the_manifest_checksum_holds_however_the_manifest_is_indented(tmp_path):
    path = save(tmp_path, 3, 1.0, iterators={"worker:0": {"offset": 94}}, loss=0.1 + 0.2)
    (path / "manifest.json").write_text(json.dumps(store.read_manifest(path), indent=4, sort_keys=True))
    assert store.latest(tmp_path) == path


def test_a_checkpoint_without_a_manifest_checksum_is_used_with_a_warning(tmp_path, caplog):
    path = save(tmp_path, 4, 1.0)
    manifest = store.read_manifest(path)
    del manifest["manifest_crc32c"]
    (path / "manifest.json").write_text(json.dumps(manifest))
    with caplog.at_level(logging.WARNING, logger="shardflow.train.checkpoints.store"):
        assert store.latest(tmp_path) == path
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert str(path) in warning and "without manifest_crc32c" in warning


def test_resaving_a_step_replaces_the_first_copy_only_after_latest_moved_to_the_second(tmp_path):
    first = save(tmp_path, 5, 1.0)
    inode = first.stat().st_ino
    second = save(tmp_path, 5, 2.0)
    # The new copy was written beside the first as ckpt-000000005.1, and took the plain name once the first was gone.
    assert second.name == "ckpt-000000005" and second.stat().st_ino != inode
    assert store.latest(tmp_path) == second
    assert (tmp_path / "checkpoints" / "latest").read_text() == second.name
    assert names(tmp_path) == ["ckpt-000000005", "latest"]
    assert torch.equal(store.load(second)[0]["w"], torch.full((64,), 2.0))


def test_resaving_an_identical_checkpoint_keeps_the_one_there(tmp_path):
    first = save(tmp_path, 5, 1.0, mode="async")
    inode = (first / "model.safetensors").stat().st_ino
    assert save(tmp_path, 5, 1.0, mode="async") == first
    assert (first / "model.safetensors").stat().st_ino == inode
    assert names(tmp_path) == ["ckpt-000000005", "latest"]


def test_resaving_over_a_damaged_copy_of_the_step_replaces_it(tmp_path):
    damaged = save(tmp_path, 5, 1.0)
    flip_last_byte(damaged)
    inode = (damaged / "model.safetensors").stat().st_ino
    # Not identical to the damaged copy, so the new one is written and replaces it.
    path = save(tmp_path, 5, 1.0)
    assert store.latest(tmp_path) == path
    assert (path / "model.safetensors").stat().st_ino != inode
    assert names(tmp_path) == ["ckpt-000000005", "latest"]


def test_keep_retires_the_oldest_checkpoints(tmp_path):
    for step in range(1, 6):
        store.save(tmp_path, step, {"w": torch.zeros(2)}, {}, keep=2)
    assert names(tmp_path) == ["ckpt-000000004", "ckpt-000000005", "latest"]


@pytest.mark.parametrize("mode", ["new-step", "same-step"])
def test_a_crash_at_any_point_of_a_save_leaves_the_newest_complete_checkpoint(tmp_path, caplog, mode):
    # The helper saves step 1 and then crashes the next save (of step 2, or of step 1 again with other values) on
    # either side of its k-th filesystem operation, for every k until the save completes.
    out = subprocess.run(
        [sys.executable, str(HERE / "crash_during_save.py"), mode, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    runs = [json.loads(line) for line in out.stdout.splitlines()]
    assert len(runs) > 20 and runs[-1]["crashed_at"] is None
    expected = {"first": (1, 1.0), "second": (2, 2.0) if mode == "new-step" else (1, 3.0)}
    second_seen = False
    for k, run in enumerate(runs):
        model_dir = Path(run["model_dir"])
        where = f"after a crash {run['crashed_at']} (point {k})"
        with caplog.at_level(logging.WARNING):
            path = store.latest(model_dir)
        assert path is not None, where
        tensors, manifest = store.load(path)
        written = manifest["written"]
        assert (manifest["global_step"], tensors["w"][0].item()) == expected[written], where
        assert torch.equal(tensors["w"], torch.full((64,), expected[written][1])), where
        # Once the new checkpoint was found, a crash later in the save never brings back the older one.
        assert written == "second" or not second_seen, where
        second_seen = written == "second"

        # A new start removes what the crash left, and finds the same checkpoint.
        store.clean(model_dir)
        assert not [name for name in names(model_dir) if name.startswith(".")], where
        assert store.latest(model_dir) == path, where
    assert second_seen
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_save_after_a_crash_and_clean_completes(tmp_path):
    out = subprocess.run(
        [sys.executable, str(HERE / "crash_during_save.py"), "new-step", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    for line in out.stdout.splitlines():
        model_dir = Path(json.loads(line)["model_dir"])
        store.clean(model_dir)
        path = save(model_dir, 2, 4.0)
        assert store.latest(model_dir) == path
        assert names(model_dir) == [path.name, "latest"] or names(model_dir) == ["ckpt-000000001", path.name, "latest"]


def run_regression(tmp_path: Path, name: str, model_dir: Path, **config: Any) -> tuple[int, str, dict[str, Any], float]:
    """Run tests/integration/jobs/regression.py to its end: exit status, output, result, seconds."""
    config = {"model_dir": str(model_dir), "result": str(tmp_path / f"{name}.json"), "num_workers": 2, **config}
    config_path = tmp_path / f"{name}.config.json"
    config_path.write_text(json.dumps(config))
    started = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, str(REGRESSION_JOB), str(config_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        out, _ = proc.communicate(timeout=180)
    finally:
        for child in psutil.Process(proc.pid).children(recursive=True) if proc.poll() is None else []:
            child.kill()
        proc.kill()
    seconds = time.monotonic() - started
    result_path = tmp_path / f"{name}.json"
    return proc.returncode, out, json.loads(result_path.read_text()) if result_path.exists() else {}, seconds


def test_rerunning_a_finished_job_starts_no_cluster_and_a_higher_max_steps_continues(tmp_path):
    model_dir = tmp_path / "model"
    status, out, first, _ = run_regression(tmp_path, "first", model_dir, max_steps=20)
    assert status == 0, out
    assert first["global_step"] == 20
    worker_log = model_dir / "logs" / "worker_0.log"
    logged = worker_log.stat().st_mtime_ns, worker_log.stat().st_size

    status, out, again, seconds = run_regression(tmp_path, "again", model_dir, max_steps=20)
    assert status == 0, out
    message = "at global step 20: training is already done (max_steps=20 reached); nothing to train. Raise max_steps"
    assert out.count(message) == 1, out
    assert (again["global_step"], again["worker_steps"], again["est_global_step"]) == (20, {}, 20)
    # No role was started: the worker's log is untouched and no cluster start-up was paid for.
    assert (worker_log.stat().st_mtime_ns, worker_log.stat().st_size) == logged
    assert seconds < 30

    status, out, more, _ = run_regression(tmp_path, "more", model_dir, max_steps=30)
    assert status == 0, out
    assert more["global_step"] == 30 and more["est_global_step"] == 30
    # Continued from 20: 10 more updates (a worker may compute a step or two that is not applied), not 30.
    assert sum(more["worker_steps"].values()) < 20, more
    assert message not in out
