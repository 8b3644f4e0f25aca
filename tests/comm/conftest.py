"""A server loop in a thread, answering with a handler, for request/reply tests."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import pytest

from shardflow.comm import Request, Server

Handler = Callable[[Server, Request], None]


class ServerThread:
    def __init__(self, handle: Handler) -> None:
        self.server = Server("tcp://127.0.0.1:0")
        self._handle = handle
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            request = self.server.recv(timeout_s=0.02)
            if request is not None:
                self._handle(self.server, request)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.server.close()


@pytest.fixture
def serve() -> Iterator[Callable[[Handler], Server]]:
    """Start a server thread with a handler; returns its Server (for .address and counters)."""
    threads: list[ServerThread] = []

    def start(handle: Handler) -> Server:
        threads.append(ServerThread(handle))
        return threads[-1].server

    yield start
    for thread in threads:
        thread.stop()
