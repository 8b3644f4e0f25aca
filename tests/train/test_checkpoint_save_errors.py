"""A checkpoint save that fails (a full or read-only disk) leaves no checkpoint of it behind and `latest` as it was;
one whose only failure is tidying up after `latest` moved is saved."""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import SafetensorError

from shardflow.train.checkpoints import store

# What safetensors raises when the disk fills while it writes (the I/O error is not an OSError).
DISK_FULL = "Error while serializing: I/O error: No space left on device (os error 28)"


def save(model_dir: Path, step: int, **kwargs: Any) -> Path:
    return store.save(model_dir, step, {"w": torch.full((64,), float(step))}, {}, **kwargs)


def names(model_dir: Path) -> list[str]:
    return sorted(p.name for p in store.directory(model_dir).iterdir())


def test_a_disk_full_while_writing_the_tensors_raises_enospc_and_leaves_the_previous_latest(tmp_path, monkeypatch):
    previous = save(tmp_path, 10)

    def full_disk(tensors: dict[str, torch.Tensor], filename: str) -> None:
        Path(filename).write_bytes(b"half a checkpoint")
        raise SafetensorError(DISK_FULL)

    monkeypatch.setattr(store, "save_file", full_disk)
    with pytest.raises(OSError, match="No space left on device") as raised:
        save(tmp_path, 20)
    assert raised.value.errno == errno.ENOSPC
    assert names(tmp_path) == ["ckpt-000000010", "latest"]  # no partial checkpoint, no temporary directory
    assert store.latest(tmp_path) == previous
    assert (store.directory(tmp_path) / "latest").read_text() == previous.name


def test_a_safetensors_error_that_is_not_an_io_error_is_raised_as_it_is(tmp_path, monkeypatch):
    def refuses(tensors: dict[str, torch.Tensor], filename: str) -> None:
        raise SafetensorError("some tensors share memory")

    monkeypatch.setattr(store, "save_file", refuses)
    with pytest.raises(SafetensorError, match="share memory"):
        save(tmp_path, 20)
    assert names(tmp_path) == []


def test_a_disk_full_while_switching_latest_removes_the_new_checkpoint(tmp_path, monkeypatch):
    previous = save(tmp_path, 10)

    def full_disk(source: Any, destination: Any) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(source))

    monkeypatch.setattr(os, "replace", full_disk)  # store.py replaces only `latest`
    with pytest.raises(OSError) as raised:
        save(tmp_path, 20)
    assert raised.value.errno == errno.ENOSPC
    monkeypatch.undo()
    assert names(tmp_path) == ["ckpt-000000010", "latest"]
    assert store.latest(tmp_path) == previous


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only directory")
def test_a_read_only_checkpoint_directory_raises_and_keeps_the_previous_latest(tmp_path):
    previous = save(tmp_path, 10)
    store.directory(tmp_path).chmod(0o500)
    try:
        with pytest.raises(PermissionError):
            save(tmp_path, 20)
    finally:
        store.directory(tmp_path).chmod(0o700)
    assert names(tmp_path) == ["ckpt-000000010", "latest"]
    assert store.latest(tmp_path) == previous


def test_a_save_whose_only_failure_is_removing_old_checkpoints_is_saved_and_logged(tmp_path, monkeypatch, caplog):
    save(tmp_path, 10)

    def read_only(path: Path) -> None:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))

    monkeypatch.setattr(store, "_retire", read_only)
    with caplog.at_level(logging.WARNING, logger="shardflow.train.checkpoints.store"):
        path = save(tmp_path, 20, keep=1)
    assert store.latest(tmp_path) == path and path.name == "ckpt-000000020"
    assert names(tmp_path) == ["ckpt-000000010", "ckpt-000000020", "latest"]  # more than `keep`, never fewer
    (warning,) = [r.getMessage() for r in caplog.records]
    assert "is saved, but tidying" in warning and "Read-only file system" in warning
