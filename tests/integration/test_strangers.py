"""A local job is authenticated by default: a process of the same machine that knows every address but not the
job's secret cannot push, pull, stop or write a control key, and no socket of the job listens off loopback."""

from __future__ import annotations

import json
import math
import re
import time
from pathlib import Path

import psutil
import pytest
import torch
import zmq
from safetensors.torch import load_file

from shardflow.cluster.control_plane import ControlPlane, ControlPlaneError
from shardflow.comm.client import Client
from shardflow.comm.errors import CommError
from shardflow.comm.security import Credentials, job_credentials
from shardflow.ps import protocol

NUM_RECORDS, BATCH = 1024, 8


def _listening(pids: list[int]) -> list[str]:
    """The local addresses of the TCP sockets these processes listen on, from /proc."""
    inodes = set()
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                target = fd.readlink().name
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    found = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                found.append(_address(fields[1]))
    return found


def _address(hex_address: str) -> str:
    host, port = hex_address.split(":")
    raw = bytes.fromhex(host)
    if len(raw) == 4:
        return f"{'.'.join(str(b) for b in reversed(raw))}:{int(port, 16)}"
    words = [raw[i : i + 4][::-1].hex() for i in range(0, 16, 4)]  # /proc prints each 32-bit word little-endian
    return f"[{':'.join(w[j : j + 4] for w in words for j in (0, 4))}]:{int(port, 16)}"


def _is_loopback(address: str) -> bool:
    host = address.rpartition(":")[0]
    return host.startswith("127.") or host in ("[0000:0000:0000:0000:0000:0000:0000:0001]",)


def test_a_stranger_without_the_secret_can_do_nothing_and_the_job_ends_exact(start_job, tmp_path, monkeypatch):
    monkeypatch.delenv("SHARDFLOW_CLUSTER_SECRET", raising=False)
    job = start_job("audit.py", mode="async", num_ps=2, num_workers=2, epochs=1, step_delay_s=0.02)
    model_dir = tmp_path / "model"
    job.wait_for_file(model_dir / "job.json")
    chief = json.loads((model_dir / "job.json").read_text())["control"]
    assert (model_dir / "job.json").stat().st_mode & 0o077 == 0, "job.json is readable by this user only"
    logs = model_dir / "logs"
    ps_addresses, local_addresses = [], []
    for k in range(2):
        job.wait_for_file(logs / f"ps_{k}.log")
        deadline = time.monotonic() + 30
        serving = r"serving at (tcp://\S+) .*, and at (ipc://\S+) for this machine's roles"
        while not (found := re.search(serving, (logs / f"ps_{k}.log").read_text())):
            assert time.monotonic() < deadline, "ps never said where it serves"
            time.sleep(0.1)
        ps_addresses.append(found[1])
        local_addresses.append(found[2])
    # The roles reach each PS over a UNIX socket in the launcher's runtime directory, which only this user enters.
    runtime_dir = Path(local_addresses[0].removeprefix("ipc://")).parent
    assert runtime_dir.stat().st_mode & 0o777 == 0o700
    assert all(Path(address.removeprefix("ipc://")).is_socket() for address in local_addresses)

    # Every socket the job listens on is on loopback: the control service, the chief's clock, each PS.
    roles = job.roles()
    listening = _listening([job.proc.pid, *(process.pid for process in roles.values())])
    assert len(listening) >= 4, listening
    assert all(_is_loopback(address) for address in listening), listening

    # The control plane: neither this process's own credentials nor a guess get in.
    for credentials in (job_credentials(), Credentials("a guess")):
        with pytest.raises(ControlPlaneError, match="job's secret"):
            ControlPlane(chief, timeout_s=3, credentials=credentials)

    # Each PS: a stop, a pull and a push of NaN, with credentials and with none.
    nan_push = protocol.Push(worker_index=0, local_step=10_000, base_step=0, frame_counts=(1,)).header()
    member_or_none: tuple[Credentials | None, ...] = (job_credentials(), None)
    for maybe in member_or_none:
        with Client("stranger", credentials=maybe) as client:
            for k, address in enumerate(ps_addresses + local_addresses):
                client.connect(f"ps:{k}", address)
                for header, frames in (
                    (protocol.Stop().header(), []),
                    (protocol.Pull(min_step=0).header(), []),
                    (dict(nan_push), [torch.full((4,), math.nan)]),
                ):
                    # Refused in silence or with an error: on loopback any answer would come in milliseconds.
                    with pytest.raises(CommError):
                        client.request(f"ps:{k}", header, frames, timeout_s=0.3)
    # A raw socket with no security at all: nothing comes back.
    raw: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    raw.linger, raw.rcvtimeo = 0, 300
    raw.connect(ps_addresses[0])
    raw.send_multipart([b"\x83\xa2op\xa4stop\xa1s\xa1x\xa1q\x01"])
    with pytest.raises(zmq.Again):
        raw.recv_multipart()
    raw.close()

    returncode, out = job.finish(timeout_s=150)
    assert returncode == 0, out
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["global_step"] == NUM_RECORDS // BATCH
    seen = load_file(str(Path(result["checkpoint"]) / "model.safetensors"))
    assert all(torch.isfinite(value).all() for value in seen.values())
    assert torch.equal(seen["seen"], torch.ones(NUM_RECORDS)), "every record applied exactly once"
    assert "refused a connection from 127.0.0.1" in out
    assert not (model_dir / "job.secret").exists(), "the job is over: its secret is removed with it"
    assert not runtime_dir.exists(), "the job is over: its sockets' directory is removed with it"
    time.sleep(0.5)
    assert [pid for pid in job.leftovers() if psutil.pid_exists(pid)] == []
