"""Where a PS of a local cluster serves this machine's roles: a UNIX socket in the launcher's runtime directory,
unless the PS is advertised off loopback or SHARDFLOW_LOCAL_SOCKETS is off."""

from __future__ import annotations

import pytest

from shardflow.cluster.spec import TaskSpec
from shardflow.train.ps_role import local_endpoint

PS_1 = TaskSpec("ps", 1)


def test_a_local_cluster_ps_serves_its_roles_in_the_runtime_directory(monkeypatch, tmp_path):
    monkeypatch.setenv("SHARDFLOW_RUNTIME_DIR", str(tmp_path))
    monkeypatch.delenv("SHARDFLOW_LOCAL_SOCKETS", raising=False)
    assert local_endpoint(PS_1, "tcp://127.0.0.1:0") == f"ipc://{tmp_path}/ps-1"
    monkeypatch.setenv("SHARDFLOW_LOCAL_SOCKETS", "on")
    assert local_endpoint(PS_1, "tcp://localhost:2222") == f"ipc://{tmp_path}/ps-1"


def test_tcp_alone_off_loopback_without_a_launcher_or_when_turned_off(monkeypatch, tmp_path):
    monkeypatch.setenv("SHARDFLOW_RUNTIME_DIR", str(tmp_path))
    assert local_endpoint(PS_1, "tcp://10.0.0.7:2222") is None  # peers on other machines
    monkeypatch.setenv("SHARDFLOW_LOCAL_SOCKETS", "off")
    assert local_endpoint(PS_1, "tcp://127.0.0.1:0") is None
    monkeypatch.delenv("SHARDFLOW_LOCAL_SOCKETS")
    monkeypatch.delenv("SHARDFLOW_RUNTIME_DIR")
    assert local_endpoint(PS_1, "tcp://127.0.0.1:0") is None  # started by hand, not by a launcher


def test_a_bad_setting_names_the_variable(monkeypatch, tmp_path):
    monkeypatch.setenv("SHARDFLOW_RUNTIME_DIR", str(tmp_path))
    monkeypatch.setenv("SHARDFLOW_LOCAL_SOCKETS", "yes")
    with pytest.raises(ValueError, match="SHARDFLOW_LOCAL_SOCKETS='yes'"):
        local_endpoint(PS_1, "tcp://127.0.0.1:0")
