"""Where a PS on loopback serves this machine's roles: a UNIX socket in the launcher's runtime directory, or in a
private directory of its own without a launcher, unless the PS is advertised off loopback or SHARDFLOW_LOCAL_SOCKETS
is off."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from shardflow.cluster.spec import TaskSpec
from shardflow.train.ps_role import local_endpoint

PS_1 = TaskSpec("ps", 1)


def test_a_local_cluster_ps_serves_its_roles_in_the_runtime_directory(monkeypatch, tmp_path):
    monkeypatch.setenv("SHARDFLOW_RUNTIME_DIR", str(tmp_path))
    monkeypatch.delenv("SHARDFLOW_LOCAL_SOCKETS", raising=False)
    with local_endpoint(PS_1, "tcp://127.0.0.1:0") as endpoint:
        assert endpoint == f"ipc://{tmp_path}/ps-1"
    monkeypatch.setenv("SHARDFLOW_LOCAL_SOCKETS", "on")
    with local_endpoint(PS_1, "tcp://localhost:2222") as endpoint:
        assert endpoint == f"ipc://{tmp_path}/ps-1"
    assert tmp_path.is_dir()  # the launcher's: it removes it


def test_a_ps_on_loopback_without_a_launcher_serves_in_a_private_directory_of_its_own(monkeypatch):
    # TF_CONFIG or torchrun on one machine: over TCP every role would speak CURVE.
    monkeypatch.delenv("SHARDFLOW_RUNTIME_DIR", raising=False)
    monkeypatch.delenv("SHARDFLOW_LOCAL_SOCKETS", raising=False)
    with local_endpoint(PS_1, "tcp://127.0.0.1:2222") as endpoint:
        assert endpoint is not None and endpoint.startswith("ipc://") and endpoint.endswith("/ps-1")
        directory = Path(endpoint.removeprefix("ipc://")).parent
        mode = directory.stat()
        assert mode.st_uid == os.getuid() and stat.S_IMODE(mode.st_mode) == 0o700
    assert not directory.exists()


def test_tcp_alone_off_loopback_or_when_turned_off(monkeypatch, tmp_path):
    monkeypatch.setenv("SHARDFLOW_RUNTIME_DIR", str(tmp_path))
    with local_endpoint(PS_1, "tcp://10.0.0.7:2222") as endpoint:
        assert endpoint is None  # peers on other machines
    monkeypatch.setenv("SHARDFLOW_LOCAL_SOCKETS", "off")
    with local_endpoint(PS_1, "tcp://127.0.0.1:0") as endpoint:
        assert endpoint is None


def test_a_bad_setting_names_the_variable(monkeypatch, tmp_path):
    monkeypatch.setenv("SHARDFLOW_RUNTIME_DIR", str(tmp_path))
    monkeypatch.setenv("SHARDFLOW_LOCAL_SOCKETS", "yes")
    with pytest.raises(ValueError, match="SHARDFLOW_LOCAL_SOCKETS='yes'"), local_endpoint(PS_1, "tcp://127.0.0.1:0"):
        pass
