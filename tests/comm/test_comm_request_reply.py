"""Client and Server over real sockets on 127.0.0.1: replies, pipelining, deadlines, retries."""

from __future__ import annotations

import pickle
import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import torch
import zmq

from shardflow.comm import Client, CommError, DeadlineExceeded, Request, Server, decode, encode

Serve = Callable[[Callable[[Server, Request], None]], Server]


@pytest.fixture
def client() -> Iterator[Client]:
    with Client("worker:0") as client:
        yield client


def echo(server: Server, request: Request) -> None:
    server.reply(request, {"op": request.op, "echo": request.header}, request.tensors)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_echo_round_trip_returns_identical_tensors(client: Client, serve: Serve) -> None:
    client.connect("ps:0", serve(echo).address)
    tensors = [torch.randn(256, 64), torch.arange(5), torch.tensor(2.5, dtype=torch.bfloat16)]
    header, received = client.request("ps:0", {"op": "push", "step": 3}, tensors, timeout_s=2)
    assert header["echo"]["step"] == 3
    assert header["echo"]["s"] == client.sender_id
    assert all(torch.equal(a, b) for a, b in zip(received, tensors, strict=True))


def test_sender_id_is_the_role_with_a_random_suffix() -> None:
    first, second = Client("worker:0"), Client("worker:0")
    assert first.sender_id.startswith("worker:0#")
    assert first.sender_id != second.sender_id


def test_pipelined_requests_can_be_received_in_any_order(client: Client, serve: Serve) -> None:
    client.connect("ps:0", serve(echo).address)
    seqs = [client.send("ps:0", {"op": "pull", "i": i}, [torch.full((3,), i)]) for i in range(3)]
    assert seqs == sorted(seqs)
    for i in (2, 0, 1):
        header, (tensor,) = client.recv("ps:0", seqs[i], timeout_s=2)
        assert header["echo"]["i"] == i
        assert torch.equal(tensor, torch.full((3,), i))


def test_server_can_answer_a_later_request_first(client: Client, serve: Serve) -> None:
    held: list[Request] = []

    def answer_second_then_first(server: Server, request: Request) -> None:
        if not held:
            held.append(request)
            return
        server.reply(request, {"answer": 2})
        server.reply(held.pop(), {"answer": 1})

    client.connect("ps:0", serve(answer_second_then_first).address)
    first = client.send("ps:0", {"op": "barrier"})
    second = client.send("ps:0", {"op": "barrier"})
    assert client.recv("ps:0", first, timeout_s=2)[0]["answer"] == 1
    assert client.recv("ps:0", second, timeout_s=2)[0]["answer"] == 2


def test_request_to_silent_address_raises_deadline_exceeded(client: Client) -> None:
    address = f"tcp://127.0.0.1:{free_port()}"
    client.connect("ps:1", address)
    started = time.monotonic()
    with pytest.raises(DeadlineExceeded) as raised:
        client.request("ps:1", {"op": "push"}, timeout_s=0.5)
    assert 0.5 <= time.monotonic() - started < 1.5
    assert raised.value.peer == "ps:1"
    assert raised.value.address == address
    message = str(raised.value)
    assert "ps:1" in message and address in message and "'push'" in message and "0.5s" in message


def test_exhausted_retries_report_every_attempt(client: Client) -> None:
    client.connect("ps:1", f"tcp://127.0.0.1:{free_port()}")
    started = time.monotonic()
    with pytest.raises(DeadlineExceeded, match=r"'pull' \(seq \d+, 2 attempts\)"):
        client.request("ps:1", {"op": "pull"}, timeout_s=0.2, retries=1)
    assert time.monotonic() - started >= 0.4


def test_deadline_exceeded_is_a_timeout_error_that_pickles() -> None:
    error = DeadlineExceeded("ps:0", "tcp://127.0.0.1:1", "'pull' (seq 4)", 2.0)
    assert isinstance(error, TimeoutError)
    assert str(pickle.loads(pickle.dumps(error))) == str(error)


def test_retried_request_is_applied_once(client: Client, serve: Serve) -> None:
    applied: list[int] = []

    def slow_apply(server: Server, request: Request) -> None:
        applied.append(request.seq)
        time.sleep(0.45)  # past the client's deadline, so it retries
        server.reply(request, {"applied": len(applied)})

    server = serve(slow_apply)
    client.connect("ps:0", server.address)
    header, _ = client.request("ps:0", {"op": "push"}, [torch.ones(4)], timeout_s=0.3, retries=2)
    deadline = time.monotonic() + 2
    while server.duplicates == 0 and time.monotonic() < deadline:  # the retry may still be in flight
        time.sleep(0.01)
    assert header["applied"] == 1
    assert len(applied) == 1
    assert server.duplicates >= 1


def test_retry_of_an_answered_request_gets_the_cached_reply(client: Client, serve: Serve) -> None:
    applied: list[int] = []

    def count(server: Server, request: Request) -> None:
        applied.append(request.seq)
        server.reply(request, {"applied": len(applied)}, [torch.arange(3)])

    server = serve(count)
    client.connect("ps:0", server.address)
    header = {"op": "push"}
    seq = client.send("ps:0", header)
    client.recv("ps:0", seq, timeout_s=2)
    # Re-send the same (sender, seq) by hand, as a retry whose first reply was lost would.
    raw: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    raw.routing_id = b"retrier"
    raw.connect(server.address)
    try:
        raw.send_multipart(encode(header))
        assert raw.poll(2000)
        reply, tensors = decode(raw.recv_multipart())
    finally:
        raw.close(linger=0)
    assert reply["applied"] == 1 and reply["q"] == seq
    assert torch.equal(tensors[0], torch.arange(3))
    assert applied == [seq]


def test_restarted_client_is_not_taken_for_a_duplicate(serve: Serve) -> None:
    server = serve(echo)
    for _ in range(2):
        with Client("worker:0") as incarnation:
            incarnation.connect("ps:0", server.address)
            incarnation.request("ps:0", {"op": "push"}, timeout_s=2)
    assert server.duplicates == 0


def test_error_reply_raises_comm_error_naming_the_peer(client: Client, serve: Serve) -> None:
    def refuse(server: Server, request: Request) -> None:
        server.reply_error(request, f"unknown variable {request.header['name']!r}")

    server = serve(refuse)
    client.connect("ps:2", server.address)
    with pytest.raises(CommError, match=f"ps:2 at {server.address}: unknown variable 'w'"):
        client.request("ps:2", {"op": "pull", "name": "w"}, timeout_s=2)


def test_recv_of_a_request_not_in_flight_raises(client: Client, serve: Serve) -> None:
    client.connect("ps:0", serve(echo).address)
    seq = client.send("ps:0", {"op": "pull"})
    client.recv("ps:0", seq, timeout_s=2)
    with pytest.raises(ValueError, match="not in flight"):
        client.recv("ps:0", seq, timeout_s=2)


def test_request_to_unknown_peer_names_the_connected_ones(client: Client) -> None:
    client.connect("ps:0", f"tcp://127.0.0.1:{free_port()}")
    with pytest.raises(ValueError, match=r"not connected to ps:7 \(connected: ps:0\)"):
        client.send("ps:7", {"op": "pull"})


def test_bind_to_a_port_in_use_names_the_address() -> None:
    with Server("tcp://127.0.0.1:0") as first, pytest.raises(CommError, match=first.address):
        Server(first.address)


def test_wildcard_bind_publishes_a_connectable_address() -> None:
    with Server("tcp://0.0.0.0:0") as server:
        assert "0.0.0.0" not in server.address
        assert server.address.rsplit(":", 1)[1].isdigit()


def test_server_recv_returns_none_on_timeout() -> None:
    with Server("tcp://127.0.0.1:0") as server:
        started = time.monotonic()
        assert server.recv(timeout_s=0.1) is None
        assert time.monotonic() - started < 1.0


def test_close_does_not_hang_with_requests_queued() -> None:
    client = Client("worker:0")
    client.connect("ps:0", f"tcp://127.0.0.1:{free_port()}")
    client.send("ps:0", {"op": "push"}, [torch.ones(1_000_000)])
    closer = threading.Thread(target=client.close)
    closer.start()
    closer.join(timeout=1)
    assert not closer.is_alive()
