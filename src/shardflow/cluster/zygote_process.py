"""The zygote process (see cluster/zygote.py): imports once, then forks a process per role on the launcher's request;
the fork becomes the role and runs its script as `__main__`, as `python` would have."""

from __future__ import annotations

import builtins
import ctypes
import gc
import importlib
import io
import json
import os
import runpy
import selectors
import signal
import socket
import sys
import threading
import types
from dataclasses import dataclass
from importlib.machinery import SourceFileLoader
from typing import Any

from shardflow.cluster.zygote import PRELOAD, REQUEST_HEADER, ZYGOTE_NAME, die_with_parent

_PR_SET_NAME = 15


@dataclass(frozen=True)
class _Request:
    id: int
    argv: list[str]
    env: dict[str, str]
    cwd: str
    name: str
    output: int  # the write end of the role's output pipe


def main() -> None:
    """The zygote: imports, then forks a role per request until the launcher hangs up. Runs the role in a child."""
    control = socket.socket(fileno=int(sys.argv[1]))
    _set_process_name(ZYGOTE_NAME)
    # The recipe of gc.freeze's documentation: no collection leaves holes in the pages the roles share, and the
    # roles' collections skip what the zygote imported, so they neither copy those pages nor spend time on them
    # (a full collection: ~200 ms with torch imported, ~1 ms frozen; and so is the exit's).
    gc.disable()
    for module in PRELOAD:
        importlib.import_module(module)
    gc.freeze()
    _report(control, {"ready": True})
    request = _serve(control)
    if request is None:
        # Hung up. Nothing the zygote holds needs finalizing, and finalizing torch's modules takes ~0.5 s.
        os._exit(0)
    _become(request)


def _serve(control: socket.socket) -> _Request | None:
    """One thread, no torch op: fork is safe. Returns a request in the child forked for it, None at hang-up."""
    die_with_zygote = die_with_parent()
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    # SIGCHLD writes to wake_write, so select() wakes up to reap.
    signal.set_wakeup_fd(wake_write, warn_on_full_buffer=False)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)
    with selectors.DefaultSelector() as selector:
        selector.register(control, selectors.EVENT_READ)
        selector.register(wake_read, selectors.EVENT_READ)
        while True:
            for key, _ in selector.select():
                if key.fd == wake_read:
                    os.read(wake_read, 4096)
                    continue
                request = _receive(control)
                if request is None:
                    return None
                # numpy's OpenBLAS starts a thread on import; its own fork handler stops it before every fork.
                assert threading.active_count() == 1, "the zygote forks with one thread only"
                in_session_read, in_session_write = os.pipe()
                try:
                    pid = os.fork()
                except OSError as error:
                    _report(control, {"refused": request.id, "reason": str(error)})
                    pid = -1
                if pid == 0:
                    if die_with_zygote is not None:
                        die_with_zygote()
                    os.setsid()  # its own process group, which the launcher signals
                    signal.set_wakeup_fd(-1)
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    for fd in (in_session_read, in_session_write, wake_read, wake_write, control.detach()):
                        os.close(fd)
                    return request
                os.close(request.output)
                os.close(in_session_write)
                # As with Popen(start_new_session=True): the pid is told once its process group exists.
                os.read(in_session_read, 1)
                os.close(in_session_read)
                if pid > 0:
                    _report(control, {"spawned": request.id, "pid": pid})
            _report_exits(control)


def _receive(control: socket.socket) -> _Request | None:
    header, fds, _, _ = socket.recv_fds(control, REQUEST_HEADER.size, 1)
    if not header:
        return None
    (size,) = REQUEST_HEADER.unpack(header + _read_exactly(control, REQUEST_HEADER.size - len(header)))
    message = json.loads(_read_exactly(control, size))
    [output] = fds
    return _Request(
        id=message["id"],
        argv=message["argv"],
        env=message["env"],
        cwd=message["cwd"],
        name=message["name"],
        output=output,
    )


def _read_exactly(control: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = control.recv(size - len(data))
        if not chunk:
            raise EOFError("the launcher hung up in the middle of a request")
        data += chunk
    return data


def _report(control: socket.socket, message: dict[str, Any]) -> None:
    control.sendall(json.dumps(message).encode() + b"\n")


def _report_exits(control: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _report(control, {"exited": pid, "status": status})


def _become(request: _Request) -> None:
    """In the forked child: the request's process, as `python` would have started it, then its script."""
    gc.enable()
    os.dup2(request.output, 1)
    os.dup2(request.output, 2)
    os.close(request.output)
    _set_process_name(request.name)
    os.chdir(request.cwd)
    os.environ.clear()
    os.environ.update(request.env)
    _reseed()
    sys.orig_argv = list(request.argv)
    _run(request.argv[1:])


def _reseed() -> None:
    """A fresh process seeds numpy's global RNG and torch's default generator from the OS; a fork copies the
    zygote's, which siblings would share. (Python's `random` reseeds itself after a fork.)"""
    import numpy.random
    import torch

    numpy.random.seed()
    torch.default_generator.seed()


def _run(args: list[str]) -> None:
    """Runs `script args...` or `-m module args...` as `__main__`; an uncaught error exits 1 as in `python`."""
    try:
        if args[0] == "-m":
            sys.argv = args[1:]
            sys.path.insert(0, os.getcwd())
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = args
            _run_script(args[0])
    except Exception as error:
        traceback = error.__traceback__
        while traceback is not None and traceback.tb_frame.f_code.co_filename == __file__:
            traceback = traceback.tb_next  # the user's frames only, as in a fresh `python`
        # The default hook prints the exception's own traceback, so that is the one to cut.
        sys.excepthook(type(error), error.with_traceback(traceback), traceback)
        raise SystemExit(1) from None


def _run_script(path: str) -> None:
    file = os.path.join(os.getcwd(), path)
    sys.path.insert(0, os.path.dirname(os.path.realpath(file)))
    main_module = types.ModuleType("__main__")
    main_module.__dict__.update(
        __annotations__={},
        __builtins__=builtins,
        __cached__=None,
        __file__=file,
        __loader__=SourceFileLoader("__main__", file),
    )
    sys.modules["__main__"] = main_module
    with io.open_code(file) as source:
        code = compile(source.read(), file, "exec", dont_inherit=True)
    exec(code, main_module.__dict__)


def _set_process_name(name: str) -> None:
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_NAME, name.encode()[:15])
