"""Only holders of the job secret talk to a job's servers: PLAIN on loopback, CURVE elsewhere, refusals logged."""

import logging
import os
import stat
import threading

import pytest
import torch
import zmq

from shardflow.comm import security
from shardflow.comm.client import Client
from shardflow.comm.errors import CommError
from shardflow.comm.security import Credentials, SecurityError, is_loopback, job_credentials, refused_peers
from shardflow.comm.server import Server, secure_server


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
        ("ipc:///run/sf-x/ps-0", True),
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


@pytest.mark.parametrize("encrypt", [None, "always"])
def test_a_round_trip_with_the_job_secret(monkeypatch, encrypt):
    if encrypt:
        monkeypatch.setenv("SHARDFLOW_ENCRYPT", encrypt)
    job = Credentials("s3cret")
    server = Server("tcp://127.0.0.1:0", credentials=job)
    assert server.mechanism == ("curve" if encrypt else "plain")
    thread = _echo_once(server)
    with Client("worker:0", credentials=job) as client:
        client.connect("ps:0", server.address)
        header, tensors = client.request("ps:0", {"op": "echo"}, [torch.arange(5.0)], timeout_s=5)
    thread.join()
    server.close()
    assert header["ok"] and torch.equal(tensors[0], torch.arange(5.0))


@pytest.mark.parametrize("encrypt", [None, "always"])
def test_a_server_also_listens_on_a_unix_socket_with_the_same_authentication(monkeypatch, tmp_path, encrypt):
    if encrypt:
        monkeypatch.setenv("SHARDFLOW_ENCRYPT", encrypt)
    job = Credentials("s3cret")
    local = f"ipc://{tmp_path}/ps-0"
    server = Server("tcp://127.0.0.1:0", credentials=job, local=local)
    assert server.local_address == local and server.address.startswith("tcp://127.0.0.1:")
    thread = _echo_once(server)
    with Client("intruder", credentials=Credentials("guess")) as client:
        client.connect("ps:0", local)
        with pytest.raises(CommError, match="ps:0"):
            client.request("ps:0", {"op": "echo"}, timeout_s=1.0)
    with Client("worker:0", credentials=job) as client:
        client.connect("ps:0", local)
        header, tensors = client.request("ps:0", {"op": "echo"}, [torch.arange(5.0)], timeout_s=5)
    thread.join()
    server.close()
    assert header["ok"] and torch.equal(tensors[0], torch.arange(5.0))


def test_a_unix_socket_that_cannot_be_made_leaves_tcp_alone(tmp_path, caplog):
    too_long = f"ipc://{tmp_path}/{'x' * 200}"
    with caplog.at_level(logging.WARNING, logger="shardflow.comm.server"):
        server = Server("tcp://127.0.0.1:0", credentials=Credentials("s3cret"), local=too_long)
    assert server.local_address is None and server.address.startswith("tcp://127.0.0.1:")
    assert f"cannot listen on {too_long}" in caplog.text and server.address in caplog.text
    thread = _echo_once(server)
    with Client("worker:0", credentials=Credentials("s3cret")) as client:
        client.connect("ps:0", server.address)
        header, _ = client.request("ps:0", {"op": "echo"}, timeout_s=5)
    thread.join()
    server.close()
    assert header["ok"]


def test_a_client_without_the_secret_is_refused_and_its_address_logged_once(caplog):
    server = Server("tcp://127.0.0.1:0", credentials=Credentials("s3cret"))
    thread = _echo_once(server)
    before = refused_peers().get("127.0.0.1", 0)
    with caplog.at_level(logging.WARNING, logger="shardflow.comm.security"):
        for attempt in range(3):
            with Client(f"intruder-{attempt}", credentials=Credentials("guess")) as client:
                client.connect("ps:0", server.address)
                # Refused either way: no reply by the deadline, or (when ZeroMQ has already dropped the refused
                # connection) the request cannot even be queued; both name the peer.
                with pytest.raises(CommError, match="ps:0"):
                    client.request("ps:0", {"op": "echo"}, timeout_s=1.0)
    thread.join()
    server.close()
    assert refused_peers()["127.0.0.1"] >= before + 3
    if before == 0:  # logged once per peer address in this process
        lines = [r.getMessage() for r in caplog.records if "refused a connection from 127.0.0.1" in r.getMessage()]
        assert len(lines) == 1, lines


def test_encrypted_a_client_that_knows_the_server_key_but_not_the_secret_is_refused(monkeypatch):
    monkeypatch.setenv("SHARDFLOW_ENCRYPT", "always")
    job = Credentials("s3cret")
    server = Server("tcp://127.0.0.1:0", credentials=job)
    thread = _echo_once(server)
    before = refused_peers().get("127.0.0.1", 0)
    # The server's public key is no secret; a key pair of the stranger's own does not get it in.
    socket: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    socket.linger = 0
    socket.curve_serverkey = job.server_keys()[0]
    socket.curve_publickey, socket.curve_secretkey = zmq.curve_keypair()
    socket.rcvtimeo = 1000
    socket.connect(server.address)
    with pytest.raises(zmq.Again):
        socket.send_multipart([b"\x80"], flags=zmq.NOBLOCK)
        socket.recv_multipart()
    socket.close()
    thread.join()
    server.close()
    assert refused_peers()["127.0.0.1"] > before


def test_a_client_with_no_credentials_cannot_talk_to_a_job_server():
    server = Server("tcp://127.0.0.1:0", credentials=Credentials("s3cret"))
    thread = _echo_once(server)
    with Client("plain") as client:
        client.connect("ps:0", server.address)
        with pytest.raises(CommError):
            client.request("ps:0", {"op": "echo"}, timeout_s=1.0)
    thread.join()
    server.close()


def test_off_loopback_without_a_secret_a_role_refuses_and_says_how_to_give_one(monkeypatch):
    monkeypatch.delenv("SHARDFLOW_CLUSTER_SECRET", raising=False)
    monkeypatch.delenv("SHARDFLOW_CLUSTER_SECRET_FILE", raising=False)
    with pytest.raises(SecurityError, match=r"SHARDFLOW_CLUSTER_SECRET.*SHARDFLOW_CLUSTER_SECRET_FILE.*INSECURE=1"):
        secure_server("tcp://10.1.2.3:0")
    with Client("worker:0", credentials=job_credentials()) as client, pytest.raises(SecurityError):
        client.connect("ps:0", "tcp://10.1.2.3:5555")


def test_the_explicit_opt_out_serves_without_authentication_and_says_so_loudly(monkeypatch, caplog):
    monkeypatch.delenv("SHARDFLOW_CLUSTER_SECRET", raising=False)
    monkeypatch.setenv("SHARDFLOW_INSECURE", "1")
    with caplog.at_level(logging.WARNING, logger="shardflow.comm.security"):
        server = secure_server("tcp://10.1.2.4:0")
    server.close()
    assert server.mechanism == "null"
    assert any("WITHOUT authentication" in r.getMessage() and "10.1.2.4" in r.getMessage() for r in caplog.records)


def test_off_loopback_a_server_listens_everywhere_and_advertises_the_spec_address(monkeypatch):
    monkeypatch.setenv("SHARDFLOW_CLUSTER_SECRET", "s3cret")
    server = secure_server("tcp://ps-0.example.test:0")
    bound = server._socket.getsockopt_string(zmq.LAST_ENDPOINT)
    server.close()
    assert bound.startswith("tcp://0.0.0.0:")
    assert server.address == f"tcp://ps-0.example.test:{bound.rpartition(':')[2]}"
    assert server.mechanism == "curve"
    monkeypatch.setenv("SHARDFLOW_BIND_ADDRESS", "127.0.0.1")
    server = secure_server("tcp://ps-0.example.test:0")
    assert server._socket.getsockopt_string(zmq.LAST_ENDPOINT).startswith("tcp://127.0.0.1:")
    server.close()


def test_the_secret_comes_from_the_environment_or_a_file(monkeypatch, tmp_path):
    monkeypatch.setenv("SHARDFLOW_CLUSTER_SECRET", "from-env")
    assert job_credentials().secret == "from-env"
    monkeypatch.delenv("SHARDFLOW_CLUSTER_SECRET")
    path = tmp_path / "secret"
    path.write_text("from-file\n")
    monkeypatch.setenv("SHARDFLOW_CLUSTER_SECRET_FILE", str(path))
    assert job_credentials().secret == "from-file"
    path.write_text("  \n")
    with pytest.raises(SecurityError, match=f"SHARDFLOW_CLUSTER_SECRET_FILE={path}: the file is empty"):
        job_credentials()
    monkeypatch.setenv("SHARDFLOW_CLUSTER_SECRET_FILE", str(tmp_path / "missing"))
    with pytest.raises(SecurityError, match="missing: cannot read"):
        job_credentials()


def test_keys_are_derived_per_purpose_and_differ_between_secrets():
    one, other = Credentials("alpha"), Credentials("beta")
    assert one.server_keys() == Credentials("alpha").server_keys()
    assert one.server_keys() != one.client_keys() != other.client_keys()
    assert one.plain_password() != other.plain_password()
    public, secret_key = one.server_keys()
    assert zmq.curve_public(secret_key) == public


def test_without_any_secret_loopback_uses_a_per_user_secret_file(monkeypatch, tmp_path):
    monkeypatch.setattr(security, "_LOCAL_SECRET", tmp_path / "home" / "cluster-secret")
    first = Credentials(None).plain_password()
    assert Credentials(None).plain_password() == first
    mode = stat.S_IMODE(os.stat(tmp_path / "home" / "cluster-secret").st_mode)
    assert mode == 0o600
    assert len((tmp_path / "home" / "cluster-secret").read_text()) >= 40
