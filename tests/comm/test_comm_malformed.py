"""A server survives messages that break the wire format and keeps serving."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import msgpack
import pytest
import torch
import zmq

from shardflow.comm import Client, Request, Server, decode

Serve = Callable[[Callable[[Server, Request], None]], Server]


@pytest.fixture
def raw_dealer() -> Iterator[zmq.Socket[bytes]]:
    socket: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    yield socket
    socket.close(linger=0)


def answer(server: Server, request: Request) -> None:
    server.reply(request, {"ok": True})


def served_after(server: Server) -> bool:
    with Client("worker:9") as client:
        client.connect("ps:0", server.address)
        return bool(client.request("ps:0", {"op": "pull"}, timeout_s=2)[0]["ok"])


@pytest.mark.parametrize(
    "frames",
    [
        [b"\xc1"],
        [msgpack.packb(["not", "a", "map"])],
        [msgpack.packb({"op": "push", "s": "worker:1#00", "q": 1, "t": [["float32", [4]]]})],
        [
            msgpack.packb({"op": "push", "s": "worker:1#00", "q": 1, "t": [["float32", [4]]]}),
            b"123",
        ],
        [
            msgpack.packb({"op": "push", "s": "worker:1#00", "q": 1, "t": [["cfloat", [1]]]}),
            b"1234",
        ],
    ],
    ids=["not-msgpack", "not-a-map", "missing-frame", "short-frame", "unknown-dtype"],
)
def test_undecodable_message_is_counted_and_server_keeps_serving(
    serve: Serve, raw_dealer: zmq.Socket[bytes], frames: list[bytes]
) -> None:
    server = serve(answer)
    raw_dealer.connect(server.address)
    raw_dealer.send_multipart(frames)
    deadline = time.monotonic() + 2
    while server.malformed == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.malformed == 1
    assert served_after(server)


def test_header_without_op_gets_an_error_reply_with_its_seq(serve: Serve, raw_dealer: zmq.Socket) -> None:
    server = serve(answer)
    raw_dealer.connect(server.address)
    raw_dealer.send_multipart([msgpack.packb({"s": "worker:1#00", "q": 7, "t": []})])
    assert raw_dealer.poll(2000)
    header, _ = decode(raw_dealer.recv_multipart())
    assert header["q"] == 7
    assert "'op'" in header["error"]
    assert served_after(server)


def test_tensor_frame_of_wrong_size_is_answered_with_the_problem(serve: Serve, raw_dealer: zmq.Socket) -> None:
    server = serve(answer)
    raw_dealer.connect(server.address)
    header = {"op": "push", "s": "worker:1#00", "q": 3, "t": [["float32", [4]]]}
    raw_dealer.send_multipart([msgpack.packb(header), torch.ones(3).numpy().tobytes()])
    assert raw_dealer.poll(2000)
    reply, _ = decode(raw_dealer.recv_multipart())
    assert reply["q"] == 3
    assert "tensor 0" in reply["error"]
