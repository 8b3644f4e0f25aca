"""Requests sent again on a new connection (Client._resend): the server delivers each (sender, seq) once, whatever
the order, answers a resent one it answered already from the reply it kept until the client acknowledged it, and
drops resent requests of a sender it never heard from (it is a new process at the address)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
import zmq

from shardflow.comm import Client, Server, decode, encode

from .test_comm_request_reply import free_port


@pytest.fixture
def server() -> Iterator[Server]:
    with Server("tcp://127.0.0.1:0") as server:
        yield server


@pytest.fixture
def raw(server: Server) -> Iterator[zmq.Socket[bytes]]:
    socket: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    socket.linger = 0
    socket.connect(server.address)
    yield socket
    socket.close()


def _send(raw: zmq.Socket[bytes], seq: int, acknowledged: int, resent: bool = False) -> None:
    header: dict[str, Any] = {"op": "pull", "s": "worker:0#abcd", "q": seq, "a": acknowledged, "t": []}
    if resent:
        header["r"] = True
    raw.send_multipart([msgpack.packb(header)])


def _delivered(server: Server, count: int) -> list[int]:
    """The sequence numbers of the next `count` requests delivered, answered; then none for a while."""
    seqs: list[int] = []
    while len(seqs) < count and (request := server.recv(timeout_s=5)) is not None:
        seqs.append(request.seq)
        server.reply(request, {"answer": request.seq})
    assert server.recv(timeout_s=0.3) is None, "a duplicate was delivered"
    return seqs


def _duplicates(server: Server, expected: int) -> int:
    """The server's count of duplicates once it is `expected` or 5 s passed (it counts them as it reads them)."""
    deadline = time.monotonic() + 5
    while server.duplicates < expected and time.monotonic() < deadline:
        assert server.recv(timeout_s=0.1) is None
    return server.duplicates


def _replies(raw: zmq.Socket[bytes], count: int) -> list[int]:
    answers: list[int] = []
    while len(answers) < count and raw.poll(5000):
        answers.append(decode(raw.recv_multipart())[0]["answer"])
    assert not raw.poll(300), "an answer to a request not delivered"
    return answers


def test_a_resent_request_that_comes_after_a_later_one_is_delivered_once(server, raw):
    _send(raw, 5, acknowledged=3)
    _send(raw, 3, acknowledged=3, resent=True)  # lost on the old connection, sent again after 5 was
    _send(raw, 5, acknowledged=3, resent=True)
    assert _delivered(server, 2) == [5, 3]
    assert _duplicates(server, 1) == 1


def test_every_reply_the_client_still_awaits_is_kept_for_its_resent_request(server, raw):
    _send(raw, 3, acknowledged=3)
    _send(raw, 5, acknowledged=3)
    assert _delivered(server, 2) == [3, 5]
    assert sorted(_replies(raw, 2)) == [3, 5]
    # Both replies were lost with the connection: the client sends both again.
    _send(raw, 3, acknowledged=3, resent=True)
    _send(raw, 5, acknowledged=3, resent=True)
    assert _delivered(server, 0) == []
    assert _replies(raw, 2) == [3, 5]
    # A request acknowledging both: their replies are no longer kept, and a copy of either is never delivered.
    _send(raw, 7, acknowledged=7)
    _send(raw, 3, acknowledged=3, resent=True)
    assert _delivered(server, 1) == [7]
    assert _replies(raw, 1) == [7]


def test_a_resent_request_of_a_sender_the_server_never_heard_from_is_dropped(server, raw):
    # The PS was restarted: the request was meant for the process before, which may have applied it.
    _send(raw, 4, acknowledged=4, resent=True)
    assert _delivered(server, 0) == []
    assert _duplicates(server, 1) == 1
    _send(raw, 6, acknowledged=6)
    assert _delivered(server, 1) == [6]


def test_a_client_sends_its_requests_in_flight_again_once_the_connection_is_made_again():
    address = f"tcp://127.0.0.1:{free_port()}"
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    first: zmq.Socket[bytes] = context.socket(zmq.ROUTER)
    first.linger = 0
    first.bind(address)
    with Client("worker:0") as client:
        client.connect("ps:0", address)
        seq = client.send("ps:0", {"op": "push"})
        assert first.poll(5000)
        first.recv_multipart()
        first.close()  # the connection drops with the request on it, unanswered
        second: zmq.Socket[bytes] = context.socket(zmq.ROUTER)
        second.linger = 0
        deadline = time.monotonic() + 5
        while True:  # ZeroMQ closes the first listener in the background
            try:
                second.bind(address)
                break
            except zmq.ZMQError:
                assert time.monotonic() < deadline
                time.sleep(0.05)
        got: list[dict[str, Any]] = []

        def answer() -> None:
            if second.poll(10_000):
                identity, *frames = second.recv_multipart()
                got.append(decode(frames)[0])
                second.send_multipart([identity, *encode({"q": got[0]["q"], "ok": True})])

        thread = threading.Thread(target=answer)
        thread.start()
        try:
            header, _ = client.recv("ps:0", seq, timeout_s=10)
        finally:
            thread.join()
            second.close()
    assert header["ok"] and got[0]["q"] == seq and got[0]["r"] is True
