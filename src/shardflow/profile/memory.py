"""A sampler thread recording this process's memory as counters (RSS, torch CPU/CUDA allocated, pinned host), the
CPU cores it keeps busy, all of its threads together (the ZeroMQ I/O threads too), and how busy, with any process,
the CPUs it may run on are."""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Mapping
from types import TracebackType

from shardflow.profile.recorder import SpanRecorder, usable_cpus

RSS = "memory.rss"
TORCH_CPU_ALLOCATED = "memory.torch_cpu_allocated"
CUDA_ALLOCATED = "memory.cuda_allocated"
CUDA_RESERVED = "memory.cuda_reserved"
PINNED_HOST = "memory.pinned_host"
CPU_CORES = "cpu.cores"
"""CPU seconds the process used since the previous sample, per second of wall time: the integral over a window is
the CPU time spent in it (planning/calibrate.py relies on that)."""
USABLE_CPUS_BUSY = "cpu.usable_busy"
"""How many of the CPUs the process may run on (its affinity) were busy, with any process, per second of wall time
since the previous sample (Linux only): the cores other jobs take from it too."""
_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def read_rss() -> int:
    """Resident set size in bytes; /proc is read directly because it is ~10x cheaper than psutil."""
    try:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[1]) * _PAGE_SIZE
    except OSError:
        import psutil

        return int(psutil.Process().memory_info().rss)


def read_busy_cpu_s(cpus: set[int]) -> float | None:
    """CPU seconds any process has spent on `cpus` since boot; None where /proc/stat cannot be read."""
    busy = 0
    try:
        with open("/proc/stat", "rb") as stat:
            for line in stat:
                name, _, values = line.partition(b" ")
                if not name.startswith(b"cpu"):
                    break
                if name[3:].isdigit() and int(name[3:]) in cpus:
                    fields = [int(value) for value in values.split()]
                    busy += sum(fields[:8]) - fields[3] - fields[4]  # all but idle and iowait
    except (OSError, ValueError, IndexError):
        return None
    return busy / _CLOCK_TICKS


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

    def __init__(
        self,
        recorder: SpanRecorder,
        interval_s: float = 0.01,
        counters: Callable[[], Mapping[str, float]] | None = None,
    ) -> None:
        """`counters`: more of the role's counters to record with each sample (a PS's tables' rows and admissions)."""
        _check_interval(interval_s)
        self.recorder = recorder
        self.counters = counters
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_cpu: tuple[float, float, float | None] | None = None

    def sample(self) -> None:
        for name, read in memory_readers().items():
            self.recorder.counter(name, float(read()))
        for name, value in (self.counters() if self.counters is not None else {}).items():
            self.recorder.counter(name, float(value))
        wall, cpu, usable_busy = time.perf_counter(), time.process_time(), read_busy_cpu_s(usable_cpus())
        if self._last_cpu is not None and wall > self._last_cpu[0]:
            last_wall, last_cpu, last_usable_busy = self._last_cpu
            self.recorder.counter(CPU_CORES, (cpu - last_cpu) / (wall - last_wall))
            if usable_busy is not None and last_usable_busy is not None:
                self.recorder.counter(USABLE_CPUS_BUSY, (usable_busy - last_usable_busy) / (wall - last_wall))
        self._last_cpu = (wall, cpu, usable_busy)

    def sample_every(self, interval_s: float) -> None:
        """Changes the interval, also while running: the next sample is taken at once."""
        _check_interval(interval_s)
        self.interval_s = interval_s
        self._wake.set()

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("MemorySampler is already running")
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="memory-sampler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._wake.set()
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
            self._wake.wait(self.interval_s)
            if self._stop.is_set():
                return
            self._wake.clear()


def _check_interval(interval_s: float) -> None:
    if interval_s <= 0:
        raise ValueError(f"interval_s must be positive, got {interval_s}")
