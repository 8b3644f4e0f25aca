"""torch.distributed's rendezvous through the control plane: real processes form a gloo group through the chief's
control service and all-reduce; one without the job secret cannot join; a wait for a rank that never comes names it."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable

import psutil
import pytest

from shardflow.cluster.control_plane import ControlPlane
from shardflow.cluster.dist_store import ControlPlaneStore, DistStoreError, gloo_group

MEMBER = """
import sys
import time
import torch
from shardflow.cluster.control_plane import ControlPlane
from shardflow.cluster.dist_store import ControlPlaneStore, gloo_group

def main():
    address, rank = sys.argv[1], int(sys.argv[2])
    control = ControlPlane(address, timeout_s=float(sys.argv[3]))
    store = ControlPlaneStore(control, "workers", 0, ["worker:0", "worker:1"], timeout_s=20)
    group = gloo_group(store, rank, 2, "127.0.0.1", timeout_s=20)
    tensor = torch.tensor([1.0, 2.0]) * (rank + 1)
    group.allreduce([tensor]).wait()
    print("sum", tensor.tolist(), flush=True)
    control.close()


# In a function, as a worker's run is: the group is destroyed when it returns, not by the interpreter's exit, where
# gloo's threads may be torn down out of order ("terminate called without an active exception").
main()
"""


def _free_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture
def chief(monkeypatch):
    monkeypatch.setenv("SHARDFLOW_CLUSTER_SECRET", "dist-store-test")
    plane = ControlPlane.serve(_free_address(), timeout_s=5)
    yield plane
    plane.close()


def _member(tmp_path, address: str, rank: int, secret: str, timeout_s: float = 20) -> subprocess.Popen[str]:
    script = tmp_path / "member.py"
    script.write_text(MEMBER)
    environ = {**os.environ, "SHARDFLOW_CLUSTER_SECRET": secret}
    command = [sys.executable, str(script), address, str(rank), str(timeout_s)]
    return subprocess.Popen(command, env=environ, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_two_processes_form_a_gloo_group_through_the_control_plane_and_all_reduce(chief, tmp_path):
    members = [_member(tmp_path, chief.address, rank, "dist-store-test") for rank in range(2)]
    try:
        outputs = [member.communicate(timeout=90)[0] for member in members]
    finally:
        for member in members:
            member.kill()
    for member, output in zip(members, outputs, strict=True):
        assert member.returncode == 0, output
        assert "sum [3.0, 6.0]" in output


def test_a_process_without_the_job_secret_cannot_join_and_is_told_the_chiefs_address(chief, tmp_path):
    stranger = _member(tmp_path, chief.address, 0, "another-secret", timeout_s=3)
    try:
        output = stranger.communicate(timeout=60)[0]
    finally:
        stranger.kill()
    assert stranger.returncode != 0
    assert f"the chief's control service at {chief.address}" in output
    assert "the job's secret" in output
    assert not chief.is_set("dist/workers/0/rank_0")


def test_a_wait_for_a_rank_that_never_comes_names_the_key_and_the_group(chief):
    store = ControlPlaneStore(chief, "workers", 3, ["worker:0", "worker:1"], timeout_s=1)
    with pytest.raises(DistStoreError, match=r"'dist/workers/3/rank_1'.*\(worker:0, worker:1\) to write rank_1"):
        store.get("rank_1")


def test_keys_of_a_group_generation_live_under_its_prefix(chief):
    store = ControlPlaneStore(chief, "workers", 2, ["worker:0"], timeout_s=1)
    store.set("a", b"1")
    assert store.add("n", 2) == 2
    assert chief.get_if_set("dist/workers/2/a") == b"1"
    assert store.get("a") == b"1" and store.check(["a", "n"]) and not store.check(["b"])
    assert store.delete_key("a") and not store.check(["a"])


def test_gloos_connections_listen_on_the_given_host_only(chief):
    def listening() -> set[tuple[str, int]]:
        return {(c.laddr.ip, c.laddr.port) for c in psutil.Process().net_connections("tcp") if c.status == "LISTEN"}

    before = listening()
    group = gloo_group(ControlPlaneStore(chief, "bound", 0, ["worker:0"], timeout_s=5), 0, 1, "127.0.0.1", timeout_s=5)
    new = listening() - before
    del group
    assert new and all(ip == "127.0.0.1" for ip, _ in new)


class _GoneBack(Exception):
    """What an interrupt raises in these tests (HybridStrategy's: a PS was lost, the workers go back first)."""


def _interrupt_after(calls: int) -> tuple[list[float], Callable[[], None]]:
    seen: list[float] = []

    def interrupt() -> None:
        seen.append(time.monotonic())
        if len(seen) >= calls:
            raise _GoneBack("ps:1 was lost")

    return seen, interrupt


def test_an_interrupt_gives_a_wait_for_a_rank_up_and_is_kept(chief):
    seen, interrupt = _interrupt_after(2)
    store = ControlPlaneStore(chief, "workers", 4, ["worker:0", "worker:1"], timeout_s=60, interrupt=interrupt)
    started = time.monotonic()
    with pytest.raises(DistStoreError, match=r"'dist/workers/4/rank_1'.*ps:1 was lost"):
        store.get("rank_1")
    # Called about once a second, not only when the 60 s wait expires.
    assert len(seen) == 2 and time.monotonic() - started < 10
    assert isinstance(store.interrupted, _GoneBack)
    with pytest.raises(DistStoreError, match="ps:1 was lost"):
        store.wait(["rank_1"])


def test_a_gloo_rendezvous_given_up_by_the_interrupt_raises_what_it_raised(chief):
    """Rank 0 of 2 waits in gloo's rendezvous for a rank 1 that never comes (it announced the generation, then went
    back): the interrupt ends the wait, and forming the group raises the interrupt's error, not gloo's."""
    _, interrupt = _interrupt_after(3)
    store = ControlPlaneStore(chief, "workers", 5, ["worker:0", "worker:1"], timeout_s=60, interrupt=interrupt)
    started = time.monotonic()
    with pytest.raises(RuntimeError):
        gloo_group(store, 0, 2, "127.0.0.1", timeout_s=60)
    assert time.monotonic() - started < 20
    assert isinstance(store.interrupted, _GoneBack)
