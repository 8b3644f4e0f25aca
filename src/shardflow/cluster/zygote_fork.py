"""A zygote forked from the script's own process, where that process has imported torch already.

A zygote started as a fresh Python imports torch again: about 2 s of a core per job, on the cores the job is about
to use, when the script's process holds the same imports. So where the script imports torch before shardflow (as
most do), shardflow/__init__.py forks the zygote from the script's process as it imports shardflow, and the fork
starts out with torch imported. It is done only where the fork is as good as a fresh process:

- one Python thread (the main one), CUDA not initialised, the process's memory under FORK_RSS_LIMIT (a role forked
  from the zygote would carry the script's memory in its own RSS);
- OpenMP's threads released first (GNU libgomp's `omp_pause_resource_all`, which torch's ops start again when
  they next need them): a process forked from one that ran an OpenMP region hangs in its next one;
- in the fork: the standard streams as a fresh zygote has them (no input, unbuffered output), the script's own
  modules and `__main__` forgotten (a role imports them afresh, as it would in a fresh process), the script's
  signal handlers undone, and never a return into the script.

Anything else (no libgomp function to release its threads, a thread, a large process) gets the fresh process.
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import os
import re
import signal
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Mapping
from typing import NoReturn

FORK_RSS_LIMIT = 1 << 30
"""A process that holds more than this (data read before importing shardflow) gets a fresh zygote: about twice
what torch and numpy take once imported."""
_OPENMP = re.compile(r"/lib[gi]?omp[0-9]*[-.][^/]*$")
"""GNU's libgomp (torch's CPU builds), Intel's libiomp5, LLVM's libomp, as /proc/self/maps names them."""
_OMP_PAUSE_HARD = 2
_WAIT_POLL_S = 0.01


class ForkedZygote:
    """The zygote as a child of this process: the part of `subprocess.Popen` that zygote.Zygote uses."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped by another wait of this process: as Popen, taken for exit code 0
                self.returncode = 0
            else:
                if pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"zygote {self.pid}", timeout or 0.0)
            time.sleep(_WAIT_POLL_S)
        assert self.returncode is not None
        return self.returncode

    def kill(self) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)


def fork_zygote(environment: Mapping[str, str]) -> tuple[ForkedZygote, socket.socket] | None:
    """A zygote forked from this process with `environment`, and this end of the conversation with it; None where a
    fork would not be as good as a fresh process (the module's docstring)."""
    if not _forkable() or not _release_openmp_threads():
        return None
    ours, theirs = socket.socketpair()
    for stream in (sys.stdout, sys.stderr):  # else the fork would write what this process had not flushed yet
        with contextlib.suppress(Exception):
            stream.flush()
    starter = os.getpid()
    try:
        pid = os.fork()
    except OSError:
        ours.close()
        theirs.close()
        return None
    if pid == 0:
        _child(ours, theirs, starter, environment)
    theirs.close()
    return ForkedZygote(pid), ours


def _forkable() -> bool:
    """torch imported, the zygote's own rule for a fork (one thread, no CUDA), and a process not too large."""
    if "torch" not in sys.modules:
        return False
    from shardflow.cluster.zygote_process import unsafe_to_fork

    try:
        with open("/proc/self/statm") as statm:
            rss = int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return False
    return rss <= FORK_RSS_LIMIT and unsafe_to_fork() is None


def _release_openmp_threads() -> bool:
    """Has every OpenMP runtime this process loaded release its threads; False where one cannot."""
    try:
        with open("/proc/self/maps") as maps:
            libraries = {line.split()[-1] for line in maps if _OPENMP.search(line)}
    except OSError:
        return False
    for path in libraries:
        if not path.startswith("/") or ".so" not in path:
            continue
        try:
            library = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
            if library.omp_pause_resource_all(_OMP_PAUSE_HARD) != 0:
                return False
        except (OSError, AttributeError):
            return False
    return True


def _child(ours: socket.socket, control: socket.socket, starter: int, environment: Mapping[str, str]) -> NoReturn:
    """The forked zygote: made like a fresh one, then the zygote's loop; never returns into the script."""
    try:
        ours.close()
        os.setsid()  # as a fresh zygote: Ctrl-C in the terminal is the launcher's to handle
        _fresh_streams()
        os.environ.clear()
        os.environ.update(environment)
        _forget_the_script()
        _undo_signal_handlers()
        from shardflow.cluster.zygote_process import serve

        serve(control, starter)
    except BaseException:
        with contextlib.suppress(Exception):
            traceback.print_exc()
    finally:
        os._exit(1)  # serve() ends the process itself; here only when it failed


def _fresh_streams() -> None:
    """No input, output to nowhere, errors where the script's go; both unbuffered, as `python -u` has them."""
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    os.close(null)
    stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
    for name in ("stdin", "__stdin__"):
        setattr(sys, name, stdin)
    for fd, name in ((1, "stdout"), (2, "stderr")):
        old = getattr(sys, name)
        stream = io.TextIOWrapper(
            io.FileIO(fd, "w", closefd=False),
            encoding=getattr(old, "encoding", None),
            errors=getattr(old, "errors", None),
            write_through=True,
        )
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


def _forget_the_script() -> None:
    """Drops `__main__` and the script's own modules (neither of the standard library, an installed package nor
    shardflow), and the script's directory from sys.path: a role imports them afresh, as a fresh process would."""
    from shardflow.cluster.zygote import installed_modules

    kept = {"shardflow", *installed_modules()}
    for name, module in list(sys.modules.items()):
        has_file = isinstance(getattr(module, "__file__", None), str)  # not built in, frozen or a namespace
        if name in ("__main__", "__mp_main__") or (has_file and name not in kept):
            del sys.modules[name]
    # The import of shardflow this fork was made in never ends here: it would stay "initialising" for every thread.
    shardflow = sys.modules["shardflow"]
    if shardflow.__spec__ is not None:
        shardflow.__spec__._initializing = False  # type: ignore[attr-defined]
    if not sys.flags.safe_path and sys.path:
        del sys.path[0]  # the script's directory (`-m`: the working directory), which a role puts back


def _undo_signal_handlers() -> None:
    for signum in signal.valid_signals():
        with contextlib.suppress(OSError, ValueError, TypeError):
            handler = signal.getsignal(signum)
            if callable(handler) and handler is not signal.default_int_handler:
                signal.signal(signum, signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL)
