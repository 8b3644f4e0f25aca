"""Fixtures shared by the tests of train/."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from shardflow.cluster.control_plane import ControlPlane


@pytest.fixture
def plane(monkeypatch) -> Iterator[ControlPlane]:
    """A control service of this process on a free loopback port, and the chief's connection to it."""
    monkeypatch.setenv("SHARDFLOW_CLUSTER_SECRET", "train-tests")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    control = ControlPlane.serve(address, timeout_s=5)
    yield control
    control.close()
