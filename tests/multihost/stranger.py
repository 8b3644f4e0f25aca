"""A stranger on the cluster's network: it knows every address and the servers' public CURVE key, not the secret.

It says on stdout when it is ready; once the file argv[2] exists (the job is training) it tries at once to push huge
gradients to ps:0, pull from it and stop it, over CURVE with a key pair of its own, and to fail the job by writing a
`failed` key to the chief's control plane, both without authentication (run it with SHARDFLOW_INSECURE=1) and with a
guessed secret. It writes what became of each try to the JSON file argv[3]: "refused: ..." or "accepted: ...".
argv[1] is a JSON file with `chief`, `ps` (host:port), `server_key` (z85) and `numel` (how many elements ps:0's
parameters have).
"""

import json
import socket
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import zmq

from shardflow.cluster import control_keys
from shardflow.cluster.control_plane import ControlPlane
from shardflow.comm.framing import NOBLOCK, decode, encode, send_frames
from shardflow.comm.security import Credentials
from shardflow.ps import protocol

with open(sys.argv[1]) as f:
    config = json.load(f)
REPLY_WAIT_S = 1.5
"""A member's request is answered in milliseconds here; the stranger's wait for an answer."""


def wait_for_training(path: Path) -> None:
    # Said once the imports are done: the test starts the chief only then, so every try lands in the training.
    print(f"the stranger waits for {path}", flush=True)
    deadline = time.monotonic() + 60
    while not path.exists():
        if time.monotonic() > deadline:
            sys.exit(f"the stranger waited 60s for the chief to write {path}")
        time.sleep(0.05)


def reachable(address: str) -> str:
    """Whether a TCP connection to `address` opens: so a refusal below is the server's, not the network's."""
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=3).close()
    except OSError as error:
        return f"no: {error}"
    return "yes"


def try_ps() -> dict[str, str]:
    """push, pull and stop, pipelined to ps:0 on one DEALER socket, as a worker sends them."""
    requests = {
        "push": (
            protocol.Push(worker_index=0, local_step=10**6, base_step=0, frame_counts=(1,)).header(),
            [torch.full((config["numel"],), 1e30)],
        ),
        "pull": (protocol.Pull(min_step=0).header(), []),
        "stop": (protocol.Stop().header(), []),
    }
    dealer: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    dealer.linger = 0
    public, secret = zmq.curve_keypair()
    dealer.curve_serverkey = config["server_key"].encode()
    dealer.curve_publickey, dealer.curve_secretkey = public, secret
    dealer.connect(f"tcp://{config['ps']}")
    outcomes: dict[str, str] = {}
    ops: dict[Any, str] = {}
    for seq, (op, (header, tensors)) in enumerate(requests.items(), start=1):
        try:
            send_frames(dealer, encode({**header, "s": "worker:0#stranger", "q": seq}, tensors), NOBLOCK)
            ops[seq] = op
            outcomes[op] = f"refused: no reply from ps:0 within {REPLY_WAIT_S}s"
        except zmq.Again:
            outcomes[op] = "refused: not even queued (ZeroMQ dropped the refused connection)"
    deadline = time.monotonic() + REPLY_WAIT_S
    while (left_ms := int(1000 * (deadline - time.monotonic()))) > 0:
        if dealer.poll(left_ms):
            header, _ = decode(dealer.recv_multipart(copy=False))
            outcomes[ops.get(header.get("q"), f"reply {header.get('q')}")] = f"accepted: ps:0 replied {header}"
    dealer.close(linger=0)
    return outcomes


def try_control_plane(credentials: Credentials | None) -> str:
    """Fail the job by saying worker:0 failed: the chief ends a job once a worker's `failed` key appears."""
    key = control_keys.failed("worker:0")
    try:
        control = ControlPlane(config["chief"], timeout_s=3, credentials=credentials)
        control.set(key, "RuntimeError: written by a stranger")
    except RuntimeError as error:  # ControlPlaneError (and CommError) are RuntimeErrors
        return f"refused: {type(error).__name__}: {error}"
    return f"accepted: wrote {key!r} on the control plane at {config['chief']}"


wait_for_training(Path(sys.argv[2]))
with ThreadPoolExecutor() as pool:
    ps = pool.submit(try_ps)
    unauthenticated = pool.submit(try_control_plane, None)
    guessed = pool.submit(try_control_plane, Credentials("a guessed secret"))
    outcomes = {
        "ps reachable": reachable(config["ps"]),
        "chief reachable": reachable(config["chief"]),
        **ps.result(),
        "control key, unauthenticated": unauthenticated.result(),
        "control key, a guessed secret": guessed.result(),
    }
Path(sys.argv[3]).write_text(json.dumps(outcomes, indent=1))
