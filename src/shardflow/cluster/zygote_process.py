"""The zygote process (see cluster/zygote.py): imports once, then forks a process per role on the launcher's request;
the fork becomes the role and runs its script as `__main__`, as `python` would have."""

from __future__ import annotations

import atexit
import builtins
import contextlib
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
import warnings
import weakref
from dataclasses import dataclass
from importlib.machinery import SourceFileLoader
from typing import Any, NoReturn

from shardflow.cluster import liveness
from shardflow.cluster.zygote import (
    PRELOAD,
    REQUEST_HEADER,
    ZYGOTE_NAME,
    collect_then_freeze,
    die_with,
    die_with_parent,
)

_PR_SET_NAME = 15


@dataclass(frozen=True)
class _Request:
    id: int
    argv: list[str]
    env: dict[str, str]
    cwd: str
    name: str
    output: int  # the write end of the role's output pipe


@dataclass(frozen=True)
class _Preload:
    modules: list[str]
    env: dict[str, str]


def main() -> None:
    """The zygote as a fresh process: `python -c ... CONTROL_FD LAUNCHER_PID` (shardflow._ZYGOTE_ENTRY)."""
    serve(socket.socket(fileno=int(sys.argv[1])), int(sys.argv[2]))


def serve(control: socket.socket, parent: int) -> NoReturn:
    """The zygote: imports, then forks a role per request until the launcher (process `parent`) hangs up. Runs the
    role in a child."""
    # Only now, after this module's imports (torch's among them): a launcher that died meanwhile ends this here.
    die_with(parent)
    _set_process_name(ZYGOTE_NAME)
    # The recipe of gc.freeze's documentation: no collection leaves holes in the pages the roles share, and the
    # roles' collections skip what the zygote imported, so they neither copy those pages nor spend time on them
    # (a full collection: ~200 ms with torch imported, ~1 ms frozen; and so is the exit's).
    gc.disable()
    for module in PRELOAD:
        importlib.import_module(module)
    gc.freeze()
    try:
        _report(control, {"ready": True})
    except (BrokenPipeError, ConnectionResetError):
        # The launcher hung up during the imports (its script failed before any role started): nothing to do.
        os._exit(0)
    request = _serve(control)
    if request is None:
        # Hung up. Nothing the zygote holds needs finalizing, and finalizing torch's modules takes ~0.5 s.
        os._exit(0)
    _end(_become(request))


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
                if isinstance(request, _Preload):
                    _preload(request)
                    continue
                unsafe = unsafe_to_fork()
                if unsafe is not None:
                    os.close(request.output)
                    _report(control, {"refused": request.id, "reason": unsafe})
                    continue
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


def _preload(request: _Preload) -> None:
    """Imports what the launcher's process imported (zygote.installed_modules), each once; one that fails here is
    the role's to import (and to report). Its warnings were the launcher's to show."""
    os.environ.clear()
    os.environ.update(request.env)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in request.modules:
            if name in sys.modules:
                continue
            with contextlib.suppress(Exception, SystemExit):  # the role imports it again and reports what fails
                importlib.import_module(name)
    gc.freeze()


def unsafe_to_fork() -> str | None:
    """Why a fork of this process would not be the fresh process a role needs, or None: asked by the zygote before
    each role, and by a script's process before its zygote is forked from it (zygote_fork.py)."""
    # numpy's OpenBLAS starts a thread on import; its own fork handler stops it before every fork.
    if threading.active_count() != 1:
        names = ", ".join(thread.name for thread in threading.enumerate() if thread is not threading.current_thread())
        return f"an imported module started a thread ({names}); a fork would not have it"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "an imported module initialised CUDA, which a forked process cannot use"
    return None


def _receive(control: socket.socket) -> _Request | _Preload | None:
    """The next request: a role to fork, or modules to preload; None when the launcher hung up."""
    try:
        header, fds, _, _ = socket.recv_fds(control, REQUEST_HEADER.size, 1)
    except ConnectionResetError:  # the launcher's process ended without reading what this one reported
        return None
    if not header:
        return None
    (size,) = REQUEST_HEADER.unpack(header + _read_exactly(control, REQUEST_HEADER.size - len(header)))
    message = json.loads(_read_exactly(control, size))
    if "preload" in message:
        for fd in fds:
            os.close(fd)
        return _Preload(modules=message["preload"], env=message["env"])
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


def _become(request: _Request) -> int:
    """In the forked child: the request's process, as `python` would have started it, then its script; returns
    the exit status `python` would."""
    gc.enable()
    os.dup2(request.output, 1)
    os.dup2(request.output, 2)
    os.close(request.output)
    _set_process_name(request.name)
    os.chdir(request.cwd)
    os.environ.clear()
    os.environ.update(request.env)
    # Before the script runs: however long it takes to reach shardflow, the role is not taken for hung.
    liveness.keep_touching()
    _reseed()
    sys.orig_argv = list(request.argv)
    return _run(request.argv[1:])


def _reseed() -> None:
    """A fresh process seeds numpy's global RNG and torch's default generator from the OS; a fork copies the
    zygote's, which siblings would share. (Python's `random` reseeds itself after a fork.)"""
    import numpy.random
    import torch

    numpy.random.seed()
    torch.default_generator.seed()


def _run(args: list[str]) -> int:
    """Runs `script args...` or `-m module args...` as `__main__`; returns its exit status: that of SystemExit, or
    1 after an uncaught error, as in `python`."""
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
        return 1
    except SystemExit as exit_:
        if exit_.code is None or isinstance(exit_.code, int):
            return exit_.code or 0
        print(exit_.code, file=sys.stderr)
        return 1
    return 0


def _end(status: int) -> NoReturn:
    """Ends the role as Python ends a process, up to its exit handlers and the flush of stdout and stderr, then
    exits without tearing the modules down, as multiprocessing ends the processes it forks. That teardown takes
    0.5-2 s with torch imported, as it writes to every page the role shares with the zygote; what it would
    finalize lives in this process only (shardflow's sockets do not linger)."""
    while True:  # as Python does first: wait for the threads that are not daemons
        waiting = [
            thread for thread in threading.enumerate() if not thread.daemon and thread is not threading.main_thread()
        ]
        if not waiting:
            break
        for thread in waiting:
            thread.join()
    # The collection it would make first is of no use here, nor torch's taking its operator libraries apart (~50 ms,
    # writing to pages shared with the zygote): the user's exit handlers and finalizers run, then the process ends.
    atexit.unregister(collect_then_freeze)
    _keep_torchs_libraries()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(status)


def _keep_torchs_libraries() -> None:
    for finalizer, info in list(getattr(weakref.finalize, "_registry", {}).items()):
        function = getattr(info, "func", None)
        if getattr(function, "__name__", "") == "_del_library" and function.__module__ == "torch.library":
            finalizer.atexit = False


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
