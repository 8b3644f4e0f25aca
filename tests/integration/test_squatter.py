"""A squatted port: while the chief of a TF_CONFIG job is down, a local process binds its control port first. Every
role's control connection reconnects to it; it must learn nothing it could replay to the job's servers, get nothing
it sends accepted by a PS, and the job must end at its exact global step once the real chief is back (a handshake
that broke on the squatter's other mechanism made libzmq give those connections up: the roles open new ones)."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch
import zmq
from safetensors.torch import load_file
from zmq.utils.monitor import recv_monitor_message

from shardflow.comm.client import Client
from shardflow.comm.errors import CommError
from shardflow.comm.security import Credentials
from shardflow.comm.server import Server
from shardflow.ps import protocol

from .conftest import TFConfigJob

NUM_RECORDS, BATCH = 512, 8
SECRET = "squatted-port"


def _harvest(address: str, seconds: float) -> list[list[bytes]]:
    """Serve `address` as what harvested the password before: a ROUTER offering PLAIN, whose ZAP handler keeps the
    credentials every client offers; returns them. Asserts that no request got through."""
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        zap = context.socket(zmq.REP)
        zap.bind("inproc://zeromq.zap.01")
        squatter = context.socket(zmq.ROUTER)
        squatter.plain_server = True
        squatter.zap_domain = b"squatter"
        squatter.bind(f"tcp://{address}")
        offered = []
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            if zap.poll(int(left * 1000)):
                request = zap.recv_multipart()
                offered.append(request)
                zap.send_multipart([b"1.0", request[1], b"200", b"OK", b"", b""])
        assert squatter.poll(0) == 0, "a role's request reached the squatter"
        return offered
    finally:
        context.destroy(linger=0)


def _squat(address: str, seconds: float) -> list[int]:
    """Serve `address` with a guessed secret for `seconds`; returns the handshake events its socket saw. Asserts
    that no request got through."""
    squatter = Server(f"tcp://{address}", credentials=Credentials("a guess"))
    monitor = squatter._socket.get_monitor_socket()
    try:
        assert squatter.recv(timeout_s=seconds) is None, "a role's request reached the squatter"
        events = []
        while monitor.poll(0):
            events.append(recv_monitor_message(monitor)["event"])
        return events
    finally:
        squatter._socket.disable_monitor()
        monitor.close(linger=0)
        squatter.close()


def test_a_squatter_on_the_restarted_chiefs_port_learns_nothing_and_the_job_ends_exact(tmp_path):
    model_dir = tmp_path / "model"
    config = tmp_path / "config.json"
    job = {"model_dir": str(model_dir), "result": str(tmp_path / "result.json"), "mode": "async"}
    config.write_text(
        json.dumps({**job, "num_records": NUM_RECORDS, "save_checkpoints_steps": 16, "step_delay_s": 0.01})
    )
    fault = {"role": "chief", "point": "checkpoint", "step": 32, "marker": str(tmp_path / "fault.fired")}
    env = {**os.environ, "SHARDFLOW_FAULT": json.dumps(fault), "SHARDFLOW_CLUSTER_SECRET": SECRET}
    roles = TFConfigJob("audit.py", config, env)
    try:
        first_out, _ = roles.procs["chief", 0].communicate(timeout=120)
        assert roles.procs["chief", 0].returncode == -signal.SIGKILL, first_out
        chief = roles.cluster["chief"][0]
        assert _harvest(chief, seconds=2.0) == [], "a role offered its credentials to the squatter"
        events = _squat(chief, seconds=2.0)
        # The roles came (their reconnects reached the squatter), and not one handshake completed.
        assert zmq.EVENT_ACCEPTED in events, events
        assert zmq.EVENT_HANDSHAKE_SUCCEEDED not in events, events
        # What the squatter would send next, with the only credentials it has, gets nothing accepted by a PS.
        with Client("squatter", credentials=Credentials("a guess")) as client:
            for k, address in enumerate(roles.cluster["ps"]):
                client.connect(f"ps:{k}", f"tcp://{address}")
                with pytest.raises(CommError):
                    client.request(f"ps:{k}", protocol.Stop().header(), timeout_s=1.0)
        roles.start("chief", 0)
        outputs = roles.finish()
    finally:
        roles.kill()
    assert [p.returncode for p in roles.procs.values()] == [0] * 5, roles.describe(outputs)
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["global_step"] == NUM_RECORDS // BATCH
    applied = load_file(str(Path(result["checkpoint"]) / "model.safetensors"))["seen"]
    assert torch.equal(applied, torch.ones_like(applied)), "every record applied exactly once"
