"""CURVE on the data plane: encrypted traffic, and with a cluster secret only its holders get in."""

import threading

import pytest
import torch

from shardflow.comm.client import Client
from shardflow.comm.errors import CommError, DeadlineExceeded
from shardflow.comm.security import client_keys, is_loopback, server_keys
from shardflow.comm.server import Server


@pytest.mark.parametrize(
    ("address", "loopback"),
    [
        ("tcp://127.0.0.1:5555", True),
        ("tcp://127.3.2.1:1", True),
        ("tcp://localhost:80", True),
        ("tcp://[::1]:7000", True),
        ("tcp://10.0.0.7:5555", False),
        ("tcp://ps-0.cluster.local:5555", False),
        ("tcp://0.0.0.0:5555", False),
    ],
)
def test_only_loopback_addresses_go_unencrypted(address, loopback):
    assert is_loopback(address) is loopback


def _echo_once(server: Server) -> threading.Thread:
    def serve() -> None:
        request = server.recv(timeout_s=5)
        if request is not None:
            server.reply(request, {"ok": True}, request.tensors)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return thread


def test_an_encrypted_round_trip_with_the_cluster_secret():
    server = Server("tcp://127.0.0.1:0", curve=server_keys("s3cret"), allowed_client=client_keys("s3cret").public)
    thread = _echo_once(server)
    with Client("worker:0") as client:
        client.connect("ps:0", server.address, server_key=server.public_key, keys=client_keys("s3cret"))
        header, tensors = client.request("ps:0", {"op": "echo"}, [torch.arange(5.0)], timeout_s=5)
    thread.join()
    server.close()
    assert header["ok"] and torch.equal(tensors[0], torch.arange(5.0))


def test_a_client_without_the_secret_is_refused():
    server = Server("tcp://127.0.0.1:0", curve=server_keys("s3cret"), allowed_client=client_keys("s3cret").public)
    thread = _echo_once(server)
    with Client("intruder") as client:
        client.connect("ps:0", server.address, server_key=server.public_key, keys=client_keys("guess"))
        # Refused either way: no reply by the deadline, or (when ZeroMQ has already dropped the refused
        # connection) the request cannot even be queued; both name the peer.
        with pytest.raises(CommError, match="ps:0"):
            client.request("ps:0", {"op": "echo"}, timeout_s=1.0)
    thread.join()
    server.close()


def test_a_plaintext_client_cannot_talk_to_an_encrypted_server():
    server = Server("tcp://127.0.0.1:0", curve=server_keys("s3cret"))
    thread = _echo_once(server)
    with Client("plain") as client:
        client.connect("ps:0", server.address)
        with pytest.raises(DeadlineExceeded):
            client.request("ps:0", {"op": "echo"}, timeout_s=1.0)
    thread.join()
    server.close()
