"""`model_dir/job.json`, where a tool of the same user (`shardflow profile capture`) finds the running job: private
to that user, naming the strategy whose global step the tool reads, and a clean-up that cannot remove it never
hides why the job ended."""

from __future__ import annotations

import json
import logging
import os
import stat
from pathlib import Path
from types import SimpleNamespace

import pytest

from shardflow import env
from shardflow.train import profiling
from shardflow.train.strategy import AllReduceStrategy, ParameterServerStrategy


def _write(model_dir: Path, strategy: object) -> Path:
    job = SimpleNamespace(model_dir=model_dir, strategy=strategy)
    role = SimpleNamespace(control=SimpleNamespace(address="127.0.0.1:5000"))
    return profiling.write_job_file(job, role)  # type: ignore[arg-type]


@pytest.fixture
def no_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (env.CLUSTER_SECRET, env.CLUSTER_SECRET_FILE):
        monkeypatch.delenv(name, raising=False)


def test_job_json_is_readable_by_its_user_only(tmp_path, no_secret):
    old_umask = os.umask(0)  # the mode does not depend on the umask
    try:
        path = _write(tmp_path, ParameterServerStrategy(num_ps=1, num_workers=1))
    finally:
        os.umask(old_umask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job.json"]


def test_job_json_names_the_control_address_the_chief_and_the_strategy(tmp_path, no_secret):
    path = _write(tmp_path, AllReduceStrategy(num_workers=2))
    assert json.loads(path.read_text()) == {
        "control": "127.0.0.1:5000",
        "pid": os.getpid(),
        "strategy": "AllReduceStrategy",
    }


def test_a_job_file_that_cannot_be_removed_is_logged_not_raised(tmp_path, monkeypatch, caplog):
    path = tmp_path / "job.json"
    path.write_text("{}")

    def read_only(self: Path, missing_ok: bool = False) -> None:
        raise OSError(30, "Read-only file system", str(self))

    monkeypatch.setattr(Path, "unlink", read_only)
    with caplog.at_level(logging.WARNING, logger="shardflow.train.profiling"):
        profiling.remove_job_file(tmp_path)
    warning = next(r.getMessage() for r in caplog.records if str(path) in r.getMessage())
    assert "Read-only file system" in warning
