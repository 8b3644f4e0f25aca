"""Parallel map in worker processes, for Python-heavy functions that hold the GIL.

Workers are forked (Linux) on the first `next()`, so they inherit `map_func` and everything it refers to without
pickling; a fork-unsafe parent (threads holding locks that map_func needs, an initialised CUDA context) is the
usual caveat of fork, as with torch's DataLoader. Elements travel both ways in chunks through POSIX shared
memory, encoded by codec.py; the pipe carries only a small msgpack header (segment name, dtypes, shapes). The
consumer's thread reads the input and keeps two chunks in flight per worker; chunks grow until one takes ~5 ms.
"""

from __future__ import annotations

import collections
import contextlib
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import time
import weakref
from collections.abc import Callable
from multiprocessing import resource_tracker, shared_memory
from typing import Any

import msgpack

from shardflow.data import codec
from shardflow.data.dataset import DatasetIterator, State, UnaryIterator
from shardflow.data.mapping import apply_map
from shardflow.data.parallel import OrderLedger

_CHUNKS_IN_FLIGHT_PER_WORKER = 2
_TARGET_CHUNK_S = 0.005
_MAX_CHUNK_ELEMENTS = 64
_POLL_S = 0.1


class _Chunk:
    __slots__ = ("error", "input_name", "numbers", "worker")

    def __init__(self, worker: int | None, numbers: list[int], input_name: str | None, error: Exception | None):
        self.worker = worker
        self.numbers = numbers
        self.input_name = input_name
        self.error = error


class _Worker:
    def __init__(self, context: Any, map_func: Callable[..., Any], index: int) -> None:
        self.connection, child_connection = context.Pipe(duplex=True)
        self.process = context.Process(
            target=_worker_main,
            args=(map_func, child_connection, os.getpid()),
            name=f"shardflow-map-{index}",
            daemon=True,
        )
        self.process.start()
        child_connection.close()
        self.in_flight = 0

    def send(self, message: bytes) -> None:
        try:
            self.connection.send_bytes(message)
        except OSError:
            raise self._died() from None
        self.in_flight += 1

    def receive(self) -> bytes:
        try:
            while not self.connection.poll(_POLL_S):
                if not self.process.is_alive() and not self.connection.poll(0):
                    break
            else:
                message: bytes = self.connection.recv_bytes()
                self.in_flight -= 1
                return message
        except (EOFError, OSError):
            pass
        raise self._died()

    def _died(self) -> RuntimeError:
        self.process.join(1.0)
        return RuntimeError(
            f"map worker process {self.process.pid} exited with code {self.process.exitcode} while mapping an "
            "element (a crash in native code, a kill, or running out of memory); run the map without "
            "use_processes to see the error in this process"
        )


def _write_segment(encoded: list[codec.Encoded]) -> tuple[str, list[int]]:
    offsets, total = [], 0
    for item in encoded:
        offsets.append(total)
        total += item.nbytes
    segment = shared_memory.SharedMemory(create=True, size=max(total, 1))
    try:
        assert segment.buf is not None
        for item, offset in zip(encoded, offsets, strict=True):
            codec.write(item, segment.buf, offset)
    finally:
        segment.close()
    return segment.name, offsets


def _read_segment(name: str, specs: list[Any], offsets: list[int]) -> list[Any]:
    segment = shared_memory.SharedMemory(name=name)
    try:
        assert segment.buf is not None
        return [codec.decode(spec, segment.buf, offset) for spec, offset in zip(specs, offsets, strict=True)]
    finally:
        segment.close()
        segment.unlink()


def _worker_main(map_func: Callable[..., Any], connection: Any, parent_pid: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it stops the workers.
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(1)  # N workers each with all cores' threads would oversubscribe.
    while True:
        while not connection.poll(1.0):
            if os.getppid() != parent_pid:
                return
        try:
            message = connection.recv_bytes()
        except EOFError:
            return
        if not message:
            return
        name, specs, offsets = msgpack.unpackb(message)
        inputs = _read_segment(name, specs, offsets)
        started = time.perf_counter()
        results: list[Any] = []
        encoded: list[codec.Encoded] = []
        for element in inputs:
            try:
                encoded.append(codec.encode(apply_map(map_func, element)))
                results.append(None)
            except Exception as error:
                results.append([type(error).__module__, type(error).__qualname__, str(error)])
        seconds = time.perf_counter() - started
        output_name, output_offsets = _write_segment(encoded)
        header = [output_name, [item.spec for item in encoded], output_offsets, results, seconds]
        connection.send_bytes(msgpack.packb(header))


def _rebuild_error(module: str, qualname: str, message: str, pid: int) -> Exception:
    found: Any = sys.modules.get(module)
    for part in qualname.split("."):
        found = getattr(found, part, None)
    error: Exception | None = None
    if isinstance(found, type) and issubclass(found, Exception):
        try:
            error = found(message)
        except Exception:
            error = None
    if error is None:
        error = RuntimeError(f"{qualname}: {message}")
    error.add_note(f"raised by map_func in worker process {pid}")
    return error


class ProcessMapIterator(UnaryIterator[Any]):
    def __init__(
        self, input_iterator: DatasetIterator[Any], map_func: Callable[..., Any], num_workers: int, deterministic: bool
    ) -> None:
        super().__init__(input_iterator)
        if "fork" not in multiprocessing.get_all_start_methods():
            raise ValueError("map(use_processes=True) needs the fork start method (Linux); use threads instead")
        self._map_func = map_func
        self._num_workers = num_workers
        self._deterministic = deterministic
        self._workers: list[_Worker] = []
        self._pending: collections.deque[_Chunk] = collections.deque()
        self._ready: collections.deque[tuple[int, Any, Exception | None]] = collections.deque()
        self._ledger = OrderLedger(input_iterator.get_state())
        self._chunk_size = 1
        self._input_done = False

    def __next__(self) -> Any:
        while not self._ready:
            self._dispatch()
            if not self._pending:
                raise StopIteration
            chunk = self._pending.popleft() if self._deterministic else self._first_finished()
            self._ready.extend(self._receive(chunk))
        number, value, error = self._ready.popleft()
        self._ledger.returned(number)
        if error is not None:
            raise error
        return value

    def _start(self) -> None:
        # Workers share the parent's resource tracker, which removes leaked segments if the whole job dies.
        resource_tracker.ensure_running()
        context = multiprocessing.get_context("fork")
        self._workers = [_Worker(context, self._map_func, index) for index in range(self._num_workers)]
        weakref.finalize(self, _shutdown, self._workers, self._pending)

    def _dispatch(self) -> None:
        if not self._workers:
            self._start()
        while not self._input_done:
            worker = min(range(len(self._workers)), key=lambda index: self._workers[index].in_flight)
            if self._workers[worker].in_flight >= _CHUNKS_IN_FLIGHT_PER_WORKER:
                return
            self._send_chunk(worker)

    def _send_chunk(self, worker: int) -> None:
        elements: list[Any] = []
        numbers: list[int] = []
        failed: _Chunk | None = None
        while len(elements) < self._chunk_size and failed is None:
            error: Exception | None = None
            try:
                element = next(self._input)
            except StopIteration:
                self._input_done = True
                break
            except Exception as raised:
                error = raised
            number = self._ledger.produced(self._input.get_state())
            if number is None:
                continue
            if error is not None:
                # An input error keeps its place: the chunk so far goes first, then the error.
                failed = _Chunk(None, [number], None, error)
            else:
                elements.append(element)
                numbers.append(number)
        if elements:
            encoded = [codec.encode(element) for element in elements]
            name, offsets = _write_segment(encoded)
            self._workers[worker].send(msgpack.packb([name, [item.spec for item in encoded], offsets]))
            self._pending.append(_Chunk(worker, numbers, name, None))
        if failed is not None:
            self._pending.append(failed)

    def _first_finished(self) -> _Chunk:
        for index, chunk in enumerate(self._pending):
            if chunk.worker is None:
                del self._pending[index]
                return chunk
        busy = {chunk.worker for chunk in self._pending}
        connections = [self._workers[worker].connection for worker in busy if worker is not None]
        ready = multiprocessing.connection.wait(connections, _POLL_S) or connections[:1]
        worker = next(index for index, item in enumerate(self._workers) if item.connection is ready[0])
        # A worker answers its chunks in the order it got them.
        index = next(index for index, chunk in enumerate(self._pending) if chunk.worker == worker)
        chunk = self._pending[index]
        del self._pending[index]
        return chunk

    def _receive(self, chunk: _Chunk) -> list[tuple[int, Any, Exception | None]]:
        if chunk.worker is None:
            return [(chunk.numbers[0], None, chunk.error)]
        worker = self._workers[chunk.worker]
        name, specs, offsets, results, seconds = msgpack.unpackb(worker.receive())
        values = iter(_read_segment(name, specs, offsets))
        self._chunk_size = max(1, min(_MAX_CHUNK_ELEMENTS, int(_TARGET_CHUNK_S * len(results) / max(seconds, 1e-6))))
        pid = worker.process.pid or 0
        return [
            (number, None, _rebuild_error(result[0], result[1], result[2], pid))
            if result is not None
            else (number, next(values), None)
            for number, result in zip(chunk.numbers, results, strict=True)
        ]

    def get_state(self) -> State:
        return self._ledger.state()

    def set_state(self, state: State) -> None:
        # In-flight chunks are received and dropped, which keeps the workers and their order intact.
        while self._pending:
            self._receive(self._pending.popleft())
        self._ready.clear()
        self._input.set_state(state["input"])
        self._ledger = OrderLedger.from_state(state)
        self._input_done = False

    def close(self) -> None:
        _shutdown(self._workers, self._pending)
        self._workers = []
        super().close()


def _shutdown(workers: list[_Worker], pending: collections.deque[_Chunk]) -> None:
    for worker in workers:
        with contextlib.suppress(OSError):
            worker.connection.send_bytes(b"")
    for worker in workers:
        worker.process.join(1.0)
        if worker.process.is_alive():
            worker.process.terminate()
            worker.process.join()
        # Answers nobody read still own their output segments.
        while worker.connection.poll(0):
            try:
                _unlink(msgpack.unpackb(worker.connection.recv_bytes())[0])
            except (EOFError, OSError):
                break
        worker.connection.close()
    for chunk in pending:
        if chunk.input_name is not None:
            _unlink(chunk.input_name)
    pending.clear()
    workers.clear()


def _unlink(name: str) -> None:
    try:
        segment = shared_memory.SharedMemory(name=name)
    except FileNotFoundError:
        return
    segment.close()
    segment.unlink()
