"""A sampler thread recording this process's memory as counters (RSS, torch CPU/CUDA allocated, pinned host), and
the CPU cores it keeps busy, all of its threads together (the ZeroMQ I/O threads too)."""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from types import TracebackType

from shardflow.profile.recorder import SpanRecorder

RSS = "memory.rss"
TORCH_CPU_ALLOCATED = "memory.torch_cpu_allocated"
CUDA_ALLOCATED = "memory.cuda_allocated"
CUDA_RESERVED = "memory.cuda_reserved"
PINNED_HOST = "memory.pinned_host"
CPU_CORES = "cpu.cores"
"""CPU seconds the process used since the previous sample, per second of wall time: the integral over a window is
the CPU time spent in it (tools/calibrate.py relies on that)."""
_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def read_rss() -> int:
    """Resident set size in bytes; /proc is read directly because it is ~10x cheaper than psutil."""
    try:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[1]) * _PAGE_SIZE
    except OSError:
        import psutil

        return int(psutil.Process().memory_info().rss)


def memory_readers() -> dict[str, Callable[[], float]]:
    """The counters this process can read now. torch is only consulted if the program already imported it."""
    readers: dict[str, Callable[[], float]] = {RSS: read_rss}
    torch = sys.modules.get("torch")
    if torch is None:
        return readers
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        readers[CUDA_ALLOCATED] = torch.cuda.memory_allocated
        readers[CUDA_RESERVED] = torch.cuda.memory_reserved
        if hasattr(torch.cuda, "host_memory_stats"):
            readers[PINNED_HOST] = lambda: torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)
    # CPU tensors have no allocator statistics outside torch.profiler; torch_ops derives them during a capture.
    return readers


class MemorySampler:
    """Samples every `interval_s` while running; use as a context manager around the captured steps."""

    def __init__(self, recorder: SpanRecorder, interval_s: float = 0.01) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be positive, got {interval_s}")
        self.recorder = recorder
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_cpu: tuple[float, float] | None = None

    def sample(self) -> None:
        for name, read in memory_readers().items():
            self.recorder.counter(name, float(read()))
        wall, cpu = time.perf_counter(), time.process_time()
        if self._last_cpu is not None and wall > self._last_cpu[0]:
            self.recorder.counter(CPU_CORES, (cpu - self._last_cpu[1]) / (wall - self._last_cpu[0]))
        self._last_cpu = (wall, cpu)

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("MemorySampler is already running")
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="memory-sampler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
            self.sample()

    def __enter__(self) -> MemorySampler:
        self.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()

    def _run(self) -> None:
        while True:
            self.sample()
            if self._stop.wait(self.interval_s):
                return
