"""When the chief checkpoints: exact multiples of the step count from the PS's snapshots, oldest first; a time-based
checkpoint at a step asked for ahead of every PS; the final one; and what a restore or a chief restart changes."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from shardflow.profile.recorder_setting import NoRecorder
from shardflow.train.checkpoints import manager, store
from shardflow.train.checkpoints.manager import CheckpointManager, CheckpointSaveError
from shardflow.train.checkpoints.model_state import ModelState
from shardflow.train.strategy import ParameterServerStrategy


@dataclass
class FakeServers:
    """The PS as the manager sees them: their snapshot requests and releases, recorded; `furthest`, the step the
    furthest PS holds at when asked."""

    asked_at: list[int] = field(default_factory=list)
    released_through: list[int] = field(default_factory=list)
    furthest: int = 0

    def snapshot_at_furthest(self) -> int:
        self.asked_at.append(self.furthest)
        return self.furthest

    def release_snapshots(self, through_step: int) -> None:
        self.released_through.append(through_step)


def _status(step: int, *snapshots: int, holding: bool = False) -> Any:
    return SimpleNamespace(step=step, snapshots=snapshots, holding=holding)


def _manager(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch, mode: str = "async", fail_on_save_error: bool = False, **job: Any
) -> tuple[CheckpointManager, FakeServers]:
    def fetch_state(client: FakeServers, snapshot_step: int | None = None) -> ModelState:
        step = 99 if snapshot_step is None else snapshot_step
        return ModelState(step=step, params={"w": torch.full((2,), float(step))}, stats={"ps:0": {"applied": step}})

    monkeypatch.setattr(manager, "fetch_state", fetch_state)
    config = SimpleNamespace(
        model_dir=model_dir,
        strategy=SimpleNamespace(mode=mode, fail_on_save_error=fail_on_save_error),
        optimizer=SimpleNamespace(to_json=lambda: {"name": "sgd"}),
        **{"keep_checkpoint_max": None, "save_checkpoints_steps": None, "save_checkpoints_secs": 600.0, **job},
    )
    role = SimpleNamespace(num_workers=2, num_ps=2)
    placement = SimpleNamespace(to_json=lambda: {"pieces": []})
    servers = FakeServers()
    checkpoints = CheckpointManager(config, role, servers, placement, NoRecorder("chief"), start_step=0)  # type: ignore[arg-type]
    return checkpoints, servers


def _saved_steps(model_dir: Path) -> list[int]:
    return sorted(store.global_step(path) for path in store.directory(model_dir).glob("ckpt-*"))


def test_snapshots_every_ps_holds_are_checkpointed_at_multiples_oldest_first_then_released(tmp_path, monkeypatch):
    checkpoints, servers = _manager(tmp_path, monkeypatch, save_checkpoints_steps=10)
    evaluated: list[int] = []
    # ps:1 has not reached step 30 yet: its snapshot waits for the next poll.
    replies = [_status(31, 10, 15, 20, 30), _status(29, 10, 15, 20)]
    assert checkpoints.save_snapshots(replies, lambda state: evaluated.append(state.step))
    assert evaluated == [10, 15, 20]  # each snapshot is handed on; 15 is an evaluation step only
    assert _saved_steps(tmp_path) == [10, 20]
    assert servers.released_through == [20]
    assert not checkpoints.save_snapshots(replies, lambda state: evaluated.append(state.step))


def test_a_time_based_checkpoint_asks_every_ps_for_the_furthest_step_and_saves_it(tmp_path, monkeypatch):
    checkpoints, servers = _manager(tmp_path, monkeypatch, save_checkpoints_secs=60.0)
    servers.furthest = 42
    checkpoints.poll([_status(40), _status(42)], lambda state: None)
    assert servers.asked_at == []  # not due yet
    checkpoints.last_checkpoint_time -= 61
    checkpoints.poll([_status(40), _status(42)], lambda state: None)
    assert servers.asked_at == [42]
    checkpoints.poll([_status(46, 42), _status(45, 42)], lambda state: None)
    assert _saved_steps(tmp_path) == [42]


def test_a_snapshot_asked_for_an_evaluation_is_handed_on_not_saved_and_shared_while_pending(tmp_path, monkeypatch):
    checkpoints, servers = _manager(tmp_path, monkeypatch)
    servers.furthest = 43
    assert checkpoints.request_snapshot(checkpoint=False) == 43
    servers.furthest = 44
    assert checkpoints.request_snapshot() == 43  # a PS waits for one step to snapshot: the checkpoint shares it
    assert servers.asked_at == [43]
    evaluated: list[int] = []
    checkpoints.save_snapshots([_status(44, 43), _status(43, 43)], lambda state: evaluated.append(state.step))
    assert (evaluated, _saved_steps(tmp_path)) == ([43], [43])
    servers.furthest = 53
    assert checkpoints.request_snapshot(checkpoint=False) == 53  # taken: the next one is asked for anew
    checkpoints.save_snapshots([_status(53, 53), _status(54, 53)], lambda state: evaluated.append(state.step))
    assert (evaluated, _saved_steps(tmp_path), servers.asked_at) == ([43, 53], [43], [43, 53])


def test_a_step_count_turns_time_based_checkpoints_off(tmp_path, monkeypatch):
    checkpoints, servers = _manager(tmp_path, monkeypatch, save_checkpoints_steps=100, save_checkpoints_secs=1.0)
    checkpoints.last_checkpoint_time -= 3600
    checkpoints.poll([_status(40)], lambda state: None)
    assert servers.asked_at == []


def test_after_every_ps_was_restored_a_requested_snapshot_is_no_longer_saved(tmp_path, monkeypatch):
    checkpoints, servers = _manager(tmp_path, monkeypatch)
    servers.furthest = 10
    checkpoints.request_snapshot()
    checkpoints.restored(5)
    assert not checkpoints.save_snapshots([_status(5, 5)], lambda state: None)  # not newer than the restore
    checkpoints.save_snapshots([_status(13, 13)], lambda state: None)
    assert _saved_steps(tmp_path) == []


def test_a_restarted_chief_saves_the_snapshots_newer_than_the_latest_checkpoint(tmp_path, monkeypatch):
    store.save(tmp_path, 20, {"w": torch.zeros(2)}, {})
    checkpoints, servers = _manager(tmp_path, monkeypatch, save_checkpoints_steps=10)
    checkpoints.adopt([_status(35, 20, 30)])
    assert servers.asked_at == []  # the PS hold snapshots: those come first
    checkpoints.save_snapshots([_status(35, 20, 30)], lambda state: None)
    assert _saved_steps(tmp_path) == [20, 30]
    latest = store.latest(tmp_path)
    assert latest is not None
    assert store.read_manifest(latest)["mode"] == "async"


def test_a_restarted_chief_over_ps_without_snapshots_asks_for_one_at_once(tmp_path, monkeypatch):
    checkpoints, servers = _manager(tmp_path, monkeypatch)
    servers.furthest = 36
    checkpoints.adopt([_status(35), _status(36)])
    assert servers.asked_at == [36]


def test_a_restarted_chief_ends_a_hold_its_predecessor_left_with_a_snapshot(tmp_path, monkeypatch):
    checkpoints, servers = _manager(tmp_path, monkeypatch)
    servers.furthest = 36
    checkpoints.adopt([_status(35, 30, holding=True), _status(36, 30, holding=True)])
    assert servers.asked_at == [36]


def test_the_final_checkpoint_holds_the_ps_counters(tmp_path, monkeypatch):
    checkpoints, _ = _manager(tmp_path, monkeypatch)
    state, path = checkpoints.save_final(preempted=False)
    assert path == store.latest(tmp_path)
    manifest = store.read_manifest(path)
    assert (manifest["global_step"], manifest["ps_stats"], manifest["num_workers"]) == (99, state.stats, 2)


def _disk_full_at(monkeypatch: pytest.MonkeyPatch, *steps: int) -> None:
    """The disk is full while these steps are saved: safetensors raises what it raises then."""

    def full_disk(tensors: dict[str, torch.Tensor], filename: str) -> None:
        if any(f"ckpt-{step:09d}" in filename for step in steps):
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        save_file(tensors, filename)

    monkeypatch.setattr(store, "save_file", full_disk)


def test_a_save_that_fails_is_logged_and_counted_and_the_next_interval_saves(tmp_path, monkeypatch, caplog):
    checkpoints, servers = _manager(tmp_path, monkeypatch, save_checkpoints_steps=10)
    _disk_full_at(monkeypatch, 20)
    evaluated: list[int] = []
    with caplog.at_level("WARNING", logger="shardflow.train.checkpoints.manager"):
        checkpoints.save_snapshots([_status(31, 10, 20, 30)], lambda state: evaluated.append(state.step))
    assert _saved_steps(tmp_path) == [10, 30]
    assert (evaluated, servers.released_through, checkpoints.num_failed_saves) == ([10, 20, 30], [30], 1)
    (warning,) = [r.getMessage() for r in caplog.records]
    assert warning == (
        f"checkpoint at global step 20 not saved in {store.directory(tmp_path)}: No space left on device (ENOSPC); "
        "training goes on, retrying at the next interval (1 failed so far; the latest saved is ckpt-000000010)"
    )


def test_with_fail_on_save_error_a_save_that_fails_ends_the_job_naming_the_directory(tmp_path, monkeypatch):
    checkpoints, _ = _manager(tmp_path, monkeypatch, fail_on_save_error=True, save_checkpoints_steps=10)
    _disk_full_at(monkeypatch, 20)
    with pytest.raises(CheckpointSaveError) as raised:
        checkpoints.save_snapshots([_status(21, 10, 20)], lambda state: None)
    assert str(raised.value) == (
        f"checkpoint at global step 20 could not be saved in {store.directory(tmp_path)}: No space left on device "
        "(ENOSPC); fail_on_save_error=True ends the job"
    )
    assert _saved_steps(tmp_path) == [10]


def test_a_final_save_that_fails_ends_the_job_naming_the_checkpoint_a_rerun_resumes_from(tmp_path, monkeypatch):
    checkpoints, _ = _manager(tmp_path, monkeypatch, save_checkpoints_steps=10)
    checkpoints.save_snapshots([_status(11, 10)], lambda state: None)
    _disk_full_at(monkeypatch, 99)
    with pytest.raises(CheckpointSaveError) as raised:
        checkpoints.save_final(preempted=False)
    previous = store.directory(tmp_path) / "ckpt-000000010"
    assert str(raised.value) == (
        f"checkpoint at global step 99 could not be saved in {store.directory(tmp_path)}: No space left on device "
        f"(ENOSPC); it is the final checkpoint: a re-run resumes from {previous}"
    )
    assert store.latest(tmp_path) == previous


def test_fail_on_save_error_must_be_a_bool():
    with pytest.raises(ValueError, match=r"ParameterServerStrategy\.fail_on_save_error must be True or False"):
        ParameterServerStrategy(fail_on_save_error="yes")  # type: ignore[arg-type]
