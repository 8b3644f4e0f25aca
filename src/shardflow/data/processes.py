"""Parallel map in forked worker processes for Python-heavy functions, elements passing through shared memory."""

from __future__ import annotations

import contextlib
import glob
import itertools
import multiprocessing
import multiprocessing.connection
import os
import secrets
import signal
import sys
import weakref
from collections.abc import Callable
from typing import Any

import msgpack

from shardflow.data import codec
from shardflow.data.dataset import DatasetIterator
from shardflow.data.parallel import ChunkedMapIterator, Outcome, map_chunk

_CHUNKS_IN_FLIGHT_PER_WORKER = 2
_SHM_DIRECTORY = "/dev/shm"
_SEGMENT_PREFIX = "shardflow-map-"
_ZEROS = bytes(codec.aligned(1))
_POLL_S = 0.1
_IOV_MAX = os.sysconf("SC_IOV_MAX") if "SC_IOV_MAX" in os.sysconf_names else 1024
"""The most buffers one writev takes (1024 on Linux)."""


class _Worker:
    def __init__(self, context: Any, map_func: Callable[..., Any], index: int, segments: _Segments) -> None:
        self.connection, child_connection = context.Pipe(duplex=True)
        self.process = context.Process(
            target=_worker_main,
            args=(map_func, child_connection, os.getpid(), segments),
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


def write_all(descriptor: int, pieces: list[Any]) -> None:
    """Write the buffers `pieces` in order with as few writev calls as may be: at most IOV_MAX buffers each (more
    is EINVAL), and on from where one stopped early (writev may, on very large chunks)."""
    views = [view for view in (memoryview(piece).cast("B") for piece in pieces) if view.nbytes]
    first = 0
    while first < len(views):
        written = os.writev(descriptor, views[first : first + _IOV_MAX])
        while written:
            if written >= views[first].nbytes:
                written -= views[first].nbytes
                first += 1
            else:
                views[first], written = views[first][written:], 0


class _Segments:
    """Shared-memory segments of one map: files in the POSIX shared-memory directory named after the map.

    Plain files there (rather than multiprocessing.shared_memory) need no resource-tracker round trip per segment,
    which cost more than the copy itself; the writer writes all buffers with one writev and the reader reads them
    into memory of its own with one read and unlinks the file. Segments of maps whose process died are removed
    when the next map starts."""

    def __init__(self, owner_pid: int, token: str) -> None:
        self.prefix = f"{_SEGMENT_PREFIX}{owner_pid}-{token}-"
        self._count = itertools.count()

    def write(self, encoded: list[codec.Encoded]) -> tuple[str, list[int]]:
        name = f"{self.prefix}{os.getpid()}-{next(self._count)}"
        offsets: list[int] = []
        pieces: list[Any] = []
        total = 0
        for item in encoded:
            offsets.append(total)
            for buffer in item.buffers:
                pieces.append(buffer)
                padding = codec.aligned(buffer.nbytes) - buffer.nbytes
                if padding:
                    pieces.append(_ZEROS[:padding])
            total += item.nbytes
        descriptor = os.open(os.path.join(_SHM_DIRECTORY, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            write_all(descriptor, pieces)
        finally:
            os.close(descriptor)
        return name, offsets

    @staticmethod
    def read(name: str, specs: list[Any], offsets: list[int]) -> list[Any]:
        path = os.path.join(_SHM_DIRECTORY, name)
        with open(path, "rb", buffering=0) as segment:
            data = bytearray(os.fstat(segment.fileno()).st_size)
            view = memoryview(data)
            done = 0
            while done < len(data):
                done += segment.readinto(view[done:]) or 0
        os.unlink(path)
        # The elements are views of this private copy, so no second copy is needed.
        return [codec.decode(spec, view, offset, copy=False) for spec, offset in zip(specs, offsets, strict=True)]

    def remove_all(self) -> None:
        for path in glob.glob(os.path.join(_SHM_DIRECTORY, glob.escape(self.prefix) + "*")):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


def _remove_segments_of_dead_owners() -> None:
    for path in glob.glob(os.path.join(_SHM_DIRECTORY, _SEGMENT_PREFIX + "*")):
        owner = os.path.basename(path)[len(_SEGMENT_PREFIX) :].split("-", 1)[0]
        if owner.isdigit() and not _is_alive(int(owner)):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


def _is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _worker_main(map_func: Callable[..., Any], connection: Any, parent_pid: int, segments: _Segments) -> None:
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
        name, specs, offsets, stacked = msgpack.unpackb(message)
        outcomes, seconds = map_chunk(map_func, _read_elements(segments, name, specs, offsets, stacked))
        connection.send_bytes(_answer(outcomes, seconds, segments))


def _answer(outcomes: list[Outcome], seconds: float, segments: _Segments) -> bytes:
    """The header a worker sends back for a chunk's outcomes, which it writes to a segment: stacked into one element
    when all succeeded and can be, else each value or the error in its place."""
    if all(error is None for _, error in outcomes):
        encoded, stacked = _encode_chunk([value for value, _ in outcomes], stacked_only=True)
        if stacked:
            name, offsets = segments.write(encoded)
            return msgpack.packb([name, [encoded[0].spec], offsets, stacked, [], seconds])  # type: ignore[no-any-return]
    encoded = []
    errors: list[list[str] | None] = []
    for value, error in outcomes:
        if error is None:
            try:
                encoded.append(codec.encode(value))
            except TypeError as unsendable:
                error = unsendable
        errors.append(None if error is None else [type(error).__module__, type(error).__qualname__, str(error)])
    name, offsets = segments.write(encoded)
    return msgpack.packb([name, [item.spec for item in encoded], offsets, 0, errors, seconds])  # type: ignore[no-any-return]


def _read_elements(segments: _Segments, name: str, specs: list[Any], offsets: list[int], stacked: int) -> list[Any]:
    """The elements of a segment; `stacked` > 0 when it holds them as one element of stacked leaves."""
    elements = segments.read(name, specs, offsets)
    return codec.unstack(elements[0], stacked) if stacked else elements


def _encode_chunk(elements: list[Any], stacked_only: bool = False) -> tuple[list[codec.Encoded], int]:
    """The elements encoded for a segment: stacked into one when they can be, and how many that one holds; else
    each on its own (nothing with `stacked_only`) and 0."""
    together = codec.stack(elements) if len(elements) > 1 else None
    if together is not None:
        return [codec.encode(together)], len(elements)
    return ([] if stacked_only else [codec.encode(element) for element in elements]), 0


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


class ProcessMapIterator(ChunkedMapIterator):
    """Workers are forked (Linux) on the first `next()`, so they inherit `map_func` and everything it refers to without
    pickling; a fork-unsafe parent (threads holding locks that map_func needs, an initialised CUDA context) is the
    usual caveat of fork, as with torch's DataLoader. Elements travel both ways in chunks through POSIX shared
    memory, encoded by codec.py; the pipe carries only a small msgpack header (segment name, dtypes, shapes). A chunk
    whose elements share structure, dtypes and shapes crosses as one element of stacked leaves, so its cost does not
    grow with its length. The consumer's thread reads the input and keeps two chunks in flight per worker; chunks
    grow until one takes ~5 ms.
    """

    _target_chunk_s = 0.005
    _max_chunk_elements = 1024

    def __init__(
        self, input_iterator: DatasetIterator[Any], map_func: Callable[..., Any], num_workers: int, deterministic: bool
    ) -> None:
        if "fork" not in multiprocessing.get_all_start_methods() or not os.path.isdir(_SHM_DIRECTORY):
            raise ValueError(
                "map(use_processes=True) needs fork and POSIX shared memory (Linux); use num_parallel_calls alone "
                "for threads"
            )
        super().__init__(input_iterator, map_func, num_workers, deterministic)
        self._workers: list[_Worker] = []
        self._segments = _Segments(os.getpid(), secrets.token_hex(4))

    def _start(self) -> None:
        _remove_segments_of_dead_owners()
        context = multiprocessing.get_context("fork")
        self._workers = [_Worker(context, self._map_func, index, self._segments) for index in range(self._parallelism)]
        weakref.finalize(self, _shutdown, self._workers, self._segments, os.getpid())

    def _has_room(self) -> bool:
        if not self._workers:
            self._start()
        return min(worker.in_flight for worker in self._workers) < _CHUNKS_IN_FLIGHT_PER_WORKER

    def _submit(self, elements: list[Any]) -> int:
        worker = min(range(len(self._workers)), key=lambda index: self._workers[index].in_flight)
        encoded, stacked = _encode_chunk(elements)
        name, offsets = self._segments.write(encoded)
        self._workers[worker].send(msgpack.packb([name, [item.spec for item in encoded], offsets, stacked]))
        return worker

    def _collect(self, handle: int) -> tuple[list[Outcome], float]:
        worker = self._workers[handle]
        name, specs, offsets, stacked, errors, seconds = msgpack.unpackb(worker.receive())
        elements = _read_elements(self._segments, name, specs, offsets, stacked)
        if stacked:
            return [(element, None) for element in elements], seconds
        values = iter(elements)
        pid = worker.process.pid or 0
        outcomes: list[Outcome] = [
            (next(values), None) if error is None else (None, _rebuild_error(error[0], error[1], error[2], pid))
            for error in errors
        ]
        return outcomes, seconds

    def _wait_any(self, handles: list[int]) -> int:
        busy = set(handles)
        ready = multiprocessing.connection.wait([self._workers[worker].connection for worker in busy])
        worker = next(index for index in busy if self._workers[index].connection is ready[0])
        # A worker answers its chunks in the order it got them.
        return handles.index(worker)

    def close(self) -> None:
        _shutdown(self._workers, self._segments, os.getpid())
        self._workers = []
        self._pending.clear()
        super().close()


def _shutdown(workers: list[_Worker], segments: _Segments, owner_pid: int) -> None:
    if os.getpid() != owner_pid:
        return  # a forked copy of the owner (a worker of a later map) runs its finalizers too; only the owner stops
    for worker in workers:
        with contextlib.suppress(OSError):
            worker.connection.send_bytes(b"")
    for worker in workers:
        worker.process.join(1.0)
        if worker.process.is_alive():
            worker.process.terminate()
            worker.process.join()
        worker.connection.close()
    workers.clear()
    # Inputs no worker read and answers nobody read.
    segments.remove_all()
