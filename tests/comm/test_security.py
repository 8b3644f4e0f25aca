"""Only holders of the job secret talk to a job's servers: PLAIN on a private UNIX socket, CURVE on TCP (loopback
included, where any local process may bind a port first), refusals logged."""

import hashlib
import hmac
import logging
import os
import selectors
import socket
import stat
import threading
import time

import pytest
import torch
import zmq
from zmq.utils import z85

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
def test_which_addresses_stay_on_this_machine(address, loopback):
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
    assert server.mechanism == "curve"
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


@pytest.mark.parametrize("transport", ["tcp", "ipc"])
def test_a_client_without_the_secret_is_refused_and_its_address_logged_once(tmp_path, caplog, transport):
    tmp_path.chmod(0o700)
    server = Server("tcp://127.0.0.1:0", credentials=Credentials("s3cret"), local=f"ipc://{tmp_path}/ps-0")
    assert server.local_address is not None
    address = server.address if transport == "tcp" else server.local_address
    thread = _echo_once(server)
    # Over TCP the handshake fails at CURVE's hello, where a loopback listener's peer is on loopback; over a UNIX
    # socket, PLAIN's ZAP request names the peer's uid, gid and pid.
    peer = "127.0.0.1" if transport == "tcp" else f"localhost:{os.getuid()}:{os.getgid()}:{os.getpid()}"
    before = refused_peers().get(peer, 0)
    with caplog.at_level(logging.WARNING, logger="shardflow.comm.security"):
        for attempt in range(3):
            with Client(f"intruder-{attempt}", credentials=Credentials("guess")) as client:
                client.connect("ps:0", address)
                # Refused either way: no reply by the deadline, or (when ZeroMQ has already dropped the refused
                # connection) the request cannot even be queued; both name the peer.
                with pytest.raises(CommError, match="ps:0"):
                    client.request("ps:0", {"op": "echo"}, timeout_s=1.0)
    thread.join()
    server.close()
    assert refused_peers()[peer] >= before + 3
    if before == 0:  # logged once per peer address in this process
        lines = [r.getMessage() for r in caplog.records if f"refused a connection from {peer}" in r.getMessage()]
        assert len(lines) == 1, lines


def test_a_client_that_knows_the_server_key_but_not_the_secret_is_refused():
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


def _recording_relay(target: str) -> tuple[str, list[bytes], threading.Thread]:
    """A loopback TCP relay to `target` that keeps what its first client sends, as a squatter in between would."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(5)
    received: list[bytes] = []

    def relay() -> None:
        with listener:
            client, _ = listener.accept()
        host, port = target.removeprefix("tcp://").rsplit(":", 1)
        with client, socket.create_connection((host, int(port))) as upstream, selectors.DefaultSelector() as sel:
            sel.register(client, selectors.EVENT_READ, upstream)
            sel.register(upstream, selectors.EVENT_READ, client)
            deadline = time.monotonic() + 3
            while time.monotonic() < deadline:
                for key, _ in sel.select(timeout=0.1):
                    data = key.fileobj.recv(65536)  # type: ignore[union-attr]
                    if not data:
                        return
                    if key.fileobj is client:
                        received.append(data)
                    key.data.sendall(data)

    thread = threading.Thread(target=relay, daemon=True)
    thread.start()
    return f"tcp://127.0.0.1:{listener.getsockname()[1]}", received, thread


def test_a_server_of_another_secret_fails_the_handshake_and_learns_nothing_to_replay():
    """A squatter on a loopback port, even one running our server with a guessed secret, cannot answer the client's
    CURVE hello: the handshake fails before the client sends its long-term key, and no password ever goes out."""
    job = Credentials("s3cret")
    squatter = Server("tcp://127.0.0.1:0", credentials=Credentials("a guess"))
    address, received, relay = _recording_relay(squatter.address)
    with Client("worker:0", credentials=job) as client:
        client.connect("ps:0", address)
        with pytest.raises(CommError, match="ps:0"):
            client.request("ps:0", {"op": "stop"}, timeout_s=1.0)
    assert squatter.recv(timeout_s=0.5) is None, "nothing the client sent reached the squatter as a request"
    relay.join()
    squatter.close()
    sent = b"".join(received)
    assert b"CURVE" in sent and b"HELLO" in sent, "the client spoke CURVE, not PLAIN"
    public, secret_key = job.client_keys()
    for replayable in (job.plain_password(), b"s3cret", secret_key, z85.decode(secret_key), z85.decode(public)):
        assert replayable not in sent
    assert b"INITIATE" not in sent, "the client never vouched for itself to a server that could not prove its key"


def test_a_plain_squatter_on_a_loopback_port_is_never_sent_a_password():
    """What harvested the password before: a ROUTER that offers PLAIN and a ZAP handler that records what it gets."""
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    zap = context.socket(zmq.REP)
    zap.bind("inproc://zeromq.zap.01")
    squatter = context.socket(zmq.ROUTER)
    squatter.plain_server = True
    squatter.zap_domain = b"squatter"
    port = squatter.bind_to_random_port("tcp://127.0.0.1")
    with Client("worker:0", credentials=Credentials("s3cret")) as client:
        client.connect("chief", f"tcp://127.0.0.1:{port}")
        client.send("chief", {"op": "get"})
        assert zap.poll(1000) == 0, "the client offered the squatter credentials to check"
    assert squatter.poll(0) == 0
    context.destroy(linger=0)


def test_a_client_gets_through_once_a_squatter_of_another_mechanism_has_left_the_port():
    """libzmq gives a connection up for good when its handshake breaks the protocol; the client opens a new one."""
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    squatter = context.socket(zmq.ROUTER)  # NULL: not what the client speaks
    port = squatter.bind_to_random_port("tcp://127.0.0.1")
    job = Credentials("s3cret")
    with Client("worker:0", credentials=job) as client:
        client.connect("chief", f"tcp://127.0.0.1:{port}")
        with pytest.raises(CommError):
            client.request("chief", {"op": "echo"}, timeout_s=0.5)
        context.destroy(linger=0)
        server = Server(f"tcp://127.0.0.1:{port}", credentials=job)
        done = threading.Event()

        def serve() -> None:  # every request: the first may come too, when its connection had not broken yet
            while not done.is_set():
                request = server.recv(timeout_s=0.1)
                if request is not None:
                    server.reply(request, {"ok": True})

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        header, _ = client.request("chief", {"op": "echo"}, timeout_s=1.0, retries=4)
    done.set()
    thread.join()
    server.close()
    assert header["ok"]


@pytest.mark.parametrize(("mode", "mechanism"), [(0o700, "plain"), (0o750, "curve"), (0o755, "curve")])
def test_plain_only_on_a_unix_socket_that_no_other_user_may_reach(tmp_path, mode, mechanism):
    tmp_path.chmod(mode)
    job = Credentials("s3cret")
    assert job.mechanism(f"ipc://{tmp_path}/ps-0") == mechanism
    assert job.mechanism("ipc://@shardflow-ps-0") == "curve", "the abstract namespace is open to every user"
    assert job.mechanism(f"ipc://{tmp_path}/missing/ps-0") == "curve"
    assert job.mechanism("tcp://127.0.0.1:5555") == "curve", "any local process may bind a loopback port first"


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


def test_a_typed_secret_is_stretched_with_scrypt_and_a_made_one_is_not():
    made = security.new_secret()
    assert security.RANDOM_SECRET.fullmatch(made) and made != security.new_secret()
    scrypt = hashlib.scrypt(b"alpha", salt=b"shardflow cluster secret", n=2**14, r=8, p=1, dklen=32)
    assert security._master_key("alpha") == scrypt
    assert security._master_key(made) == hmac.new(b"shardflow cluster secret", made.encode(), "sha256").digest()
    # Only the whole form is taken at its word: a typed secret that merely starts like one is stretched.
    short = "sfk1.short"
    assert security._master_key(short) == hashlib.scrypt(
        short.encode(), salt=b"shardflow cluster secret", n=2**14, r=8, p=1, dklen=32
    )
    assert Credentials(made).client_keys() != Credentials(security.new_secret()).client_keys()


def test_without_any_secret_loopback_uses_a_per_user_secret_file(monkeypatch, tmp_path):
    monkeypatch.setattr(security, "_LOCAL_SECRET", tmp_path / "home" / "cluster-secret")
    first = Credentials(None).plain_password()
    assert Credentials(None).plain_password() == first
    mode = stat.S_IMODE(os.stat(tmp_path / "home" / "cluster-secret").st_mode)
    assert mode == 0o600
    assert len((tmp_path / "home" / "cluster-secret").read_text()) >= 40
