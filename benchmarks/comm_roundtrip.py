"""Data plane against a raw TCP socket on loopback: 4 MB push+pull bandwidth and 1 KB latency.

Each peer serves from its own process. Bare pyzmq (DEALER/ROUTER echo, no header) is shown too,
as the floor under shardflow's own cost. Repeats alternate between peers; the best is kept.
"""

from __future__ import annotations

import argparse
import multiprocessing
import socket
import statistics
import struct
import time
from collections.abc import Callable
from multiprocessing.connection import Connection

import torch
import zmq
from result_line import print_result, row

from shardflow.comm import Client, Server

LARGE_BYTES = 4 * 1024 * 1024
SMALL_BYTES = 1024
PREFIX = struct.Struct("!Q")


def recv_message(sock: socket.socket, buffer: memoryview) -> int:
    """Read one length-prefixed message into `buffer`; returns its total size."""
    received = 0
    size = PREFIX.size
    while received < size:
        count = sock.recv_into(buffer[received:])
        if count == 0:
            raise EOFError("peer closed the connection")
        received += count
        if size == PREFIX.size and received >= PREFIX.size:
            size += PREFIX.unpack_from(buffer)[0]
    return size


def serve_raw_tcp(ready: Connection) -> None:
    """Echo every length-prefixed message back, from one preallocated buffer."""
    torch.set_num_threads(1)
    with socket.create_server(("127.0.0.1", 0)) as listener:
        ready.send(listener.getsockname()[1])
        sock, _ = listener.accept()
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buffer = memoryview(bytearray(PREFIX.size + LARGE_BYTES))
    with sock:
        while True:
            try:
                size = recv_message(sock, buffer)
            except EOFError:
                return
            sock.sendall(buffer[:size])


def serve_shardflow(ready: Connection) -> None:
    """Answer each push with a tensor of the same size, as a pull of the parameters would."""
    torch.set_num_threads(1)
    server = Server("tcp://127.0.0.1:0")
    ready.send(server.address)
    parameters = {n: torch.zeros(n // 4, dtype=torch.float32) for n in (LARGE_BYTES, SMALL_BYTES)}
    while True:
        request = server.recv(timeout_s=None)
        assert request is not None
        if request.op == "stop":
            server.reply(request, {})
            server.close()
            return
        server.reply(request, {"op": "pull"}, [parameters[request.tensors[0].nbytes]])


def serve_bare_zmq(ready: Connection) -> None:
    """Answer each message with a preallocated payload of the same size."""
    torch.set_num_threads(1)
    socket = zmq.Context.instance().socket(zmq.ROUTER)
    ready.send(f"tcp://127.0.0.1:{socket.bind_to_random_port('tcp://127.0.0.1')}")
    payloads = {n: bytes(n) for n in (LARGE_BYTES, SMALL_BYTES)}
    while True:
        identity, payload = socket.recv_multipart(copy=False)
        if len(payload) == 0:
            return
        socket.send_multipart([identity, payloads[len(payload)]], copy=False)


def start(target: Callable[[Connection], None]) -> tuple[multiprocessing.Process, object]:
    context = multiprocessing.get_context("spawn")
    parent, child = context.Pipe()
    process = context.Process(target=target, args=(child,), daemon=True)
    process.start()
    return process, parent.recv()


def timed_round_trips(round_trip: Callable[[], None], count: int) -> list[float]:
    times = []
    for _ in range(count):
        started = time.perf_counter()
        round_trip()
        times.append(time.perf_counter() - started)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer repeats, for a smoke run")
    args = parser.parse_args()
    repeats, large_count, small_count = (2, 10, 300) if args.quick else (5, 40, 3000)
    torch.set_num_threads(1)

    raw_process, port = start(serve_raw_tcp)
    raw = socket.create_connection(("127.0.0.1", port))
    raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    raw_reply = memoryview(bytearray(PREFIX.size + LARGE_BYTES))
    raw_messages = {n: PREFIX.pack(n) + bytes(n) for n in (LARGE_BYTES, SMALL_BYTES)}

    def raw_round_trip(size: int) -> Callable[[], None]:
        message = raw_messages[size]

        def round_trip() -> None:
            raw.sendall(message)
            recv_message(raw, raw_reply)

        return round_trip

    shardflow_process, address = start(serve_shardflow)
    client = Client("bench")
    client.connect("ps:0", str(address))
    gradients = {n: torch.ones(n // 4, dtype=torch.float32) for n in (LARGE_BYTES, SMALL_BYTES)}

    def shardflow_round_trip(size: int) -> Callable[[], None]:
        gradient = [gradients[size]]

        def round_trip() -> None:
            client.request("ps:0", {"op": "push"}, gradient, timeout_s=30)

        return round_trip

    bare_process, bare_address = start(serve_bare_zmq)
    bare = zmq.Context.instance().socket(zmq.DEALER)
    bare.connect(str(bare_address))
    bare_payloads = {n: bytes(n) for n in (LARGE_BYTES, SMALL_BYTES)}

    def bare_round_trip(size: int) -> Callable[[], None]:
        payload = bare_payloads[size]

        def round_trip() -> None:
            bare.send(payload, copy=False)
            bare.recv(copy=False)

        return round_trip

    peers = {
        "raw TCP": raw_round_trip,
        "bare pyzmq": bare_round_trip,
        "shardflow": shardflow_round_trip,
    }
    bandwidth = dict.fromkeys(peers, 0.0)
    latency = dict.fromkeys(peers, float("inf"))
    for make in peers.values():  # warm up connections and allocators
        timed_round_trips(make(LARGE_BYTES), 3)
        timed_round_trips(make(SMALL_BYTES), 100)
    for _ in range(repeats):
        for name, make in peers.items():
            elapsed = sum(timed_round_trips(make(LARGE_BYTES), large_count))
            bandwidth[name] = max(bandwidth[name], 2 * LARGE_BYTES * large_count / elapsed / 1e9)
            median = statistics.median(timed_round_trips(make(SMALL_BYTES), small_count))
            latency[name] = min(latency[name], median * 1e6)

    client.request("ps:0", {"op": "stop"}, timeout_s=30)
    client.close()
    bare.send(b"")
    bare.close(linger=1000)
    raw.close()
    for process in (raw_process, bare_process, shardflow_process):
        process.join(timeout=10)

    report(bandwidth, latency, repeats, quick=args.quick)


def report(bandwidth: dict[str, float], latency: dict[str, float], repeats: int, *, quick: bool) -> None:
    """The table of both measures, then the RESULT line."""
    bandwidth_ratio = bandwidth["shardflow"] / bandwidth["raw TCP"]
    latency_ratio = latency["shardflow"] / latency["raw TCP"]
    print(f"{'loopback, best of ' + str(repeats):<30}" + "".join(f"{name:>12}" for name in bandwidth) + f"{'ratio':>8}")
    for label, figures, ratio, target, digits in (
        ("4 MB push+pull, GB/s", bandwidth, bandwidth_ratio, ">= 0.80", 2),
        ("1 KB round trip, median us", latency, latency_ratio, "<= 2.00", 1),
    ):
        print(
            f"{label:<30}"
            + "".join(f"{figures[name]:>12.{digits}f}" for name in figures)
            + f"{ratio:>8.2f}   target {target}"
        )
    figures = {
        "quick": quick,
        "raw_tcp_gbps": round(bandwidth["raw TCP"], 3),
        "bare_pyzmq_gbps": round(bandwidth["bare pyzmq"], 3),
        "shardflow_gbps": round(bandwidth["shardflow"], 3),
        "bandwidth_ratio": round(bandwidth_ratio, 3),
        "raw_tcp_rtt_1kb_us": round(latency["raw TCP"], 1),
        "bare_pyzmq_rtt_1kb_us": round(latency["bare pyzmq"], 1),
        "shardflow_rtt_1kb_us": round(latency["shardflow"], 1),
        "rtt_ratio": round(latency_ratio, 3),
    }
    rows = [
        row("4 MB push+pull, GB/s", bandwidth["shardflow"], "raw TCP socket", bandwidth["raw TCP"], target=">= 0.8"),
        row("1 KB round trip, median us", latency["shardflow"], "raw TCP socket", latency["raw TCP"], target="<= 2"),
    ]
    print_result("comm_roundtrip", figures, rows)


if __name__ == "__main__":
    main()
