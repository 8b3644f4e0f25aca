"""A signal handler may raise between the frames of a message (the launcher interrupts the chief's main thread with
SIGINT when a role fails, and the chief then goes on using its clients): the next message read or sent is whole."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import zmq

from shardflow.comm import Client, Request, Server
from shardflow.comm.framing import Receiver, decode, encode, send_frames

Serve = Callable[[Callable[[Server, Request], None]], Server]


class InterruptedAt:
    """A real ZeroMQ socket whose `method` raises KeyboardInterrupt on its `call`-th call (1-based), as a Python
    signal handler does when the signal lands between two frames."""

    def __init__(self, socket: zmq.Socket[Any], method: str, call: int) -> None:
        self._socket = socket
        self._method = method
        self._call = call
        self.calls = 0

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._socket, name)
        if name != self._method:
            return attribute

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            if self.calls == self._call:
                raise KeyboardInterrupt
            return attribute(*args, **kwargs)

        return counted


@pytest.fixture
def pair() -> Iterator[tuple[zmq.Socket[Any], zmq.Socket[Any]]]:
    context: zmq.Context[Any] = zmq.Context.instance()
    sender, receiver = context.socket(zmq.PAIR), context.socket(zmq.PAIR)
    port = receiver.bind_to_random_port("tcp://127.0.0.1")
    sender.connect(f"tcp://127.0.0.1:{port}")
    yield sender, receiver
    sender.close(linger=0)
    receiver.close(linger=0)


def test_a_receive_cut_off_inside_a_message_drops_its_rest_before_the_next(pair) -> None:
    sender, socket = pair
    send_frames(sender, encode({"op": "first"}, [torch.arange(4), torch.ones(3)]))
    send_frames(sender, encode({"op": "second"}, [torch.full((2,), 7.0)]))
    receiver = Receiver(InterruptedAt(socket, "recv", call=2))  # type: ignore[arg-type]
    with pytest.raises(KeyboardInterrupt):  # the header frame was read, then the signal landed
        receiver.recv(2000)
    header, tensors = decode(receiver.recv(2000) or [])
    assert header["op"] == "second"
    assert torch.equal(tensors[0], torch.full((2,), 7.0))


def echo(server: Server, request: Request) -> None:
    server.reply(request, {"op": request.op, "echo": request.header}, request.tensors)


def test_a_client_whose_send_was_cut_off_inside_a_message_sends_the_next_request_whole(serve: Serve) -> None:
    with Client("chief") as client:
        client.connect("ps:0", serve(echo).address)
        client.request("ps:0", {"op": "ping"}, timeout_s=5)  # connected
        connection = client._peers["ps:0"]
        connection.socket = InterruptedAt(connection.socket, "send", call=2)  # type: ignore[assignment]
        with pytest.raises(KeyboardInterrupt):  # the header frame went, the tensor frame did not
            client.request("ps:0", {"op": "push", "step": 1}, [torch.ones(8)], timeout_s=5)
        header, tensors = client.request("ps:0", {"op": "push", "step": 2}, [torch.arange(3)], timeout_s=5)
        assert header["echo"]["step"] == 2
        assert torch.equal(tensors[0], torch.arange(3))


def test_a_client_whose_receive_was_cut_off_inside_a_reply_reads_the_next_reply_whole(serve: Serve) -> None:
    with Client("chief") as client:
        client.connect("ps:0", serve(echo).address)
        client.request("ps:0", {"op": "ping"}, timeout_s=5)
        connection = client._peers["ps:0"]
        connection.receiver.socket = InterruptedAt(connection.socket, "recv", call=2)  # type: ignore[assignment]
        with pytest.raises(KeyboardInterrupt):
            client.request("ps:0", {"op": "pull", "step": 1}, [torch.ones(8), torch.zeros(2)], timeout_s=5)
        header, tensors = client.request("ps:0", {"op": "pull", "step": 2}, [torch.arange(3)], timeout_s=5)
        assert header["echo"]["step"] == 2
        assert torch.equal(tensors[0], torch.arange(3))
        assert not connection.pending
