"""A server's wire limits: a message over them is dropped unread, answered and counted; a frame far over the frame
limit never reaches the server (ZeroMQ refuses it before allocating); a frame of exactly the limit is delivered
under every mechanism, CURVE's overhead included; the server keeps serving after each. Also what no header can make
decode() raise, and the rate limit on warnings about malformed requests."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import pytest
import torch
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from shardflow.comm import Client, CommError, DeadlineExceeded, ProtocolError, Server, decode
from shardflow.comm.framing import WireLimits, encode
from shardflow.comm.security import Credentials
from shardflow.comm.server import LogLimiter

LIMITS = WireLimits(max_header_bytes=256, max_frames=4, max_frame_bytes=1024, max_message_bytes=2048)


@pytest.fixture
def limited_server() -> Iterator[Callable[..., Server]]:
    """Starts a server with the given limits (at an address, with credentials) that answers every request it is
    handed with {"ok": True} and its frames' sizes."""
    stop = threading.Event()
    started: list[tuple[Server, threading.Thread]] = []

    def start(limits: WireLimits, address: str = "tcp://127.0.0.1:0", credentials: Credentials | None = None) -> Server:
        server = Server(address, credentials=credentials, limits=limits)

        def loop() -> None:
            while not stop.is_set():
                request = server.recv(timeout_s=0.02)
                if request is not None:
                    sizes = [tensor.numel() for tensor in request.tensors]
                    server.reply(request, {"ok": True, "frames": len(sizes), "frame_bytes": sizes})

        thread = threading.Thread(target=loop, daemon=True)
        thread.start()
        started.append((server, thread))
        return server

    yield start
    stop.set()
    for server, thread in started:
        thread.join(timeout=5)
        server.close()


def _request(server: Server, tensors: list[torch.Tensor], header: dict[str, Any] | None = None) -> dict[str, Any]:
    with Client("worker:0") as client:
        client.connect("ps:0", server.address)
        return client.request("ps:0", header or {"op": "pull"}, tensors, timeout_s=5)[0]


def test_a_message_within_every_limit_is_delivered(limited_server: Callable[[WireLimits], Server]) -> None:
    server = limited_server(LIMITS)
    reply = _request(server, [torch.zeros(256, dtype=torch.uint8)] * 3)
    assert (reply["ok"], reply["frames"], server.malformed) == (True, 3, 0)


@pytest.mark.parametrize(
    ("tensors", "header", "problem"),
    [
        ([torch.zeros(1)] * 4, None, "more than 4 frames"),
        ([torch.zeros(1000, dtype=torch.uint8)] * 3, None, "more than the 2048 bytes"),
        ([], {"op": "pull", "padding": "x" * 300}, "header frame has 3"),
        ([torch.zeros(1025, dtype=torch.uint8)], None, "frame 1 has 1025 bytes, more than the 1024"),
    ],
    ids=["frames", "total-size", "header-size", "frame-size"],
)
def test_a_message_over_a_limit_is_answered_with_the_limit_counted_and_never_delivered(
    limited_server: Callable[[WireLimits], Server],
    tensors: list[torch.Tensor],
    header: dict[str, Any] | None,
    problem: str,
) -> None:
    server = limited_server(LIMITS)
    raw: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    raw.connect(server.address)
    try:
        raw.send_multipart(encode({"s": "worker:1#00", "q": 7, **(header or {"op": "pull"})}, tensors))
        assert raw.poll(5000), "no answer to a message over the limits"
        reply, _ = decode(raw.recv_multipart())
    finally:
        raw.close(linger=0)
    assert problem in reply["error"] and "over the server's limits" in reply["error"]
    # The header was read only when it was within its own limit: then the reply names the request.
    assert reply.get("q") == (None if problem.startswith("header") else 7)
    assert server.malformed == 1
    assert _request(server, [])["ok"]  # and only the good one was delivered


def test_a_client_over_the_limits_gets_an_error_naming_the_server_and_the_limit(
    limited_server: Callable[[WireLimits], Server],
) -> None:
    server = limited_server(LIMITS)
    with pytest.raises(CommError, match=rf"ps:0 at {server.address}: malformed request: .*more than 4 frames"):
        _request(server, [torch.zeros(1)] * 5)


def test_a_frame_over_the_frame_limit_never_reaches_the_server_which_keeps_serving(
    limited_server: Callable[[WireLimits], Server],
) -> None:
    server = limited_server(LIMITS)
    with Client("worker:0") as client:
        client.connect("ps:0", server.address)
        # ZeroMQ closes the connection before it allocates the frame: no reply, so the deadline names the server.
        with pytest.raises(DeadlineExceeded, match=f"no reply from ps:0 at {server.address}"):
            client.request("ps:0", {"op": "push"}, [torch.zeros(2048, dtype=torch.uint8)], timeout_s=1)
        assert server.malformed == 0  # it never saw the message
        # The client's socket reconnects by itself and is served again.
        assert client.request("ps:0", {"op": "pull"}, timeout_s=5)[0]["ok"]


@pytest.mark.parametrize("mechanism", ["null", "plain", "curve"])
def test_a_frame_of_exactly_the_limit_is_delivered_and_one_byte_more_never_is(
    limited_server: Callable[..., Server], tmp_path, mechanism: str
) -> None:
    """ZMQ_MAXMSGSIZE counts the frame on the wire, which CURVE makes 33 bytes longer: the limit is the same
    whatever the mechanism, and an encrypted connection is not dropped for a frame within it."""
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    address = f"ipc://{private}/server" if mechanism == "plain" else "tcp://127.0.0.1:0"
    credentials = None if mechanism == "null" else Credentials("the secret")
    server = limited_server(LIMITS, address, credentials)
    assert server.mechanism == mechanism
    with Client("worker:0", credentials=credentials) as client:
        client.connect("ps:0", server.address)
        reply = client.request("ps:0", {"op": "push"}, [torch.zeros(1024, dtype=torch.uint8)], timeout_s=5)[0]
        assert reply["frame_bytes"] == [1024]
        # One byte more: answered with the limit (null, plain), or the connection closed unread (curve).
        with pytest.raises(CommError, match=f"ps:0 at {server.address}"):
            client.request("ps:0", {"op": "push"}, [torch.zeros(1025, dtype=torch.uint8)], timeout_s=1)


def test_the_frame_limit_comes_from_the_environment_and_sets_the_message_limit(monkeypatch) -> None:
    monkeypatch.setenv("SHARDFLOW_MAX_FRAME_MB", "3")
    limits = WireLimits()
    assert (limits.max_frame_bytes, limits.max_message_bytes) == (3 << 20, 12 << 20)
    assert (limits.max_header_bytes, limits.max_frames) == (64 << 10, 65_537)
    monkeypatch.setenv("SHARDFLOW_MAX_FRAME_MB", "0")
    with pytest.raises(ValueError, match="SHARDFLOW_MAX_FRAME_MB=0"):
        WireLimits()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_frames": 0}, "max_frames must be an int >= 1"),
        ({"max_header_bytes": 1.5}, "max_header_bytes must be an int >= 1"),
        ({"max_frame_bytes": 100, "max_message_bytes": 10}, "max_message_bytes .10. must be at least max_frame_bytes"),
    ],
)
def test_invalid_limits_are_refused_naming_the_field(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=f"WireLimits.{message}"):
        WireLimits(**kwargs)


def test_a_sender_heard_from_recently_is_remembered_when_a_thousand_others_came_since(
    limited_server: Callable[[WireLimits], Server],
) -> None:
    """Duplicate detection forgets the least recently heard from sender, not the first: a busy worker keeps it
    however many others (or made-up senders) come and go."""
    server = limited_server(WireLimits())
    raw: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    raw.connect(server.address)

    def send(sender: str, seq: int) -> None:
        raw.send_multipart([msgpack.packb({"op": "pull", "s": sender, "q": seq, "t": []})])

    try:
        send("worker:0#busy", 1)
        for index in range(1023):
            send(f"stranger#{index}", 1)
        send("worker:0#busy", 2)  # now the most recently heard from
        send("stranger#last", 1)  # the 1025th sender: one is forgotten
        send("worker:0#busy", 2)  # a retry: must be recognised as a duplicate, answered from the cache
        replies: list[dict[str, Any]] = []
        while len(replies) < 1027 and raw.poll(5000):
            replies.append(decode(raw.recv_multipart())[0])
    finally:
        raw.close(linger=0)
    assert len(replies) == 1027
    assert server.duplicates == 1


_INTS = st.integers(-(2**63), 2**64 - 1)  # what msgpack carries
_SPECS = st.lists(
    st.lists(st.sampled_from(["float32", "int64", "bool", "cfloat"]) | _INTS | st.none(), max_size=3)
    | st.fixed_dictionaries({"a": st.just("float32"), "b": st.lists(_INTS)})
    | st.tuples(st.just("float32"), st.lists(_INTS | st.floats() | st.text(max_size=2))).map(list)
    | st.binary(max_size=4),
    max_size=3,
)


@settings(max_examples=300, deadline=None)
@given(
    header=st.fixed_dictionaries({"t": _SPECS}, optional={"op": st.text(max_size=3) | _INTS}),
    frames=st.lists(st.binary(max_size=16), max_size=3),
)
def test_decode_only_ever_returns_a_message_or_raises_its_protocol_error(header, frames) -> None:
    with contextlib.suppress(ProtocolError):
        decode([msgpack.packb(header), *frames])


@pytest.mark.parametrize("shape", [[2**63, ""], [10**9, "x"], ["x", 10**9], [3, None], [-1, 4], [2.0]])
def test_a_shape_with_a_size_that_is_no_int_is_refused_before_any_arithmetic(shape) -> None:
    # [10**9, "x"] would make a gigabyte string were the sizes multiplied first (found by the test above).
    with pytest.raises(ProtocolError, match="a shape is a list of ints >= 0"):
        decode([msgpack.packb({"t": [["float32", shape]]}), b""])


def test_warnings_about_one_peer_are_rate_limited_and_counted(
    limited_server: Callable[[WireLimits], Server], caplog: pytest.LogCaptureFixture
) -> None:
    server = limited_server(LIMITS)
    raw: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    raw.connect(server.address)
    try:
        with caplog.at_level(logging.WARNING, logger="shardflow.comm.server"):
            for seq in range(50):
                raw.send_multipart([msgpack.packb({"op": "pull", "s": "worker:7#bad", "q": seq, "t": 5})])
            for _ in range(50):
                assert raw.poll(5000)
                raw.recv_multipart()
    finally:
        raw.close(linger=0)
    lines = [r.getMessage() for r in caplog.records if "worker:7#bad" in r.getMessage()]
    assert server.malformed == 50
    assert len(lines) <= 1  # none at all if another test's lines used up this process's budget
    assert _request(server, [])["ok"]


def test_the_log_limiter_lets_one_line_per_peer_and_a_bounded_number_in_all() -> None:
    limiter = LogLimiter(every_s=60.0, max_lines=3)
    assert limiter.allow("worker:0", "push") == 0
    assert limiter.allow("worker:0", "push") is None  # the same peer doing the same again: held back
    assert limiter.allow("worker:0", "pull") == 1  # something else: let through, saying one was held back
    assert limiter.allow("worker:1", "push") == 0
    assert limiter.allow("worker:2", "push") is None  # 3 lines this minute already, whoever the peer
    assert limiter.held_back == 1


def test_the_log_limiter_lets_a_peer_through_again_after_its_interval() -> None:
    limiter = LogLimiter(every_s=0.05, max_lines=10)
    assert limiter.allow("worker:0", "push") == 0
    assert limiter.allow("worker:0", "push") is None
    time.sleep(0.06)
    assert limiter.allow("worker:0", "push") == 1
