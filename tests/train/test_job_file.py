"""`model_dir/job.json`, where a tool of the same user finds the running job: private to that user, and a clean-up
that cannot remove it never hides why the job ended."""

from __future__ import annotations

import json
import logging
import os
import stat
from pathlib import Path
from types import SimpleNamespace

from shardflow import env
from shardflow.train import chief


def _write(model_dir: Path) -> Path:
    job = SimpleNamespace(model_dir=model_dir)
    role = SimpleNamespace(control=SimpleNamespace(address="127.0.0.1:5000"))
    return chief._write_job_file(job, role)  # type: ignore[arg-type]


def test_job_json_is_readable_by_its_user_only(tmp_path, monkeypatch):
    for name in (env.CLUSTER_SECRET, env.CLUSTER_SECRET_FILE):
        monkeypatch.delenv(name, raising=False)
    old_umask = os.umask(0)  # the mode does not depend on the umask
    try:
        path = _write(tmp_path)
    finally:
        os.umask(old_umask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert json.loads(path.read_text()) == {"control": "127.0.0.1:5000", "pid": os.getpid()}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job.json"]


def test_a_job_file_that_cannot_be_removed_is_logged_not_raised(tmp_path, monkeypatch, caplog):
    path = tmp_path / "job.json"
    path.write_text("{}")

    def read_only(self: Path, missing_ok: bool = False) -> None:
        raise OSError(30, "Read-only file system", str(self))

    monkeypatch.setattr(Path, "unlink", read_only)
    with caplog.at_level(logging.WARNING, logger="shardflow.train.chief"):
        chief._remove(path)
    (warning,) = [r.getMessage() for r in caplog.records]
    assert str(path) in warning and "Read-only file system" in warning
