"""A fork server ("zygote") for a local cluster's roles: one process imports torch, numpy and shardflow once, then
forks a process per role that runs the user's script as `__main__`. A fresh Python per role pays ~2 s of imports,
and a local cluster starts all its roles at once on the same cores.

The conversation, over a UNIX stream socketpair between the launcher and its zygote (JSON; nothing is pickled):

- launcher → zygote: a 4-byte big-endian length, then a request. Once per role `{"id", "argv", "env", "cwd",
  "name"}`, the write end of the role's output pipe riding on its first byte (SCM_RIGHTS); at most once, before
  the first role, `{"preload": [module, ...], "env": {...}}`: what the launcher's process imported, for the roles
  to share, and the environment to import it with.
- zygote → launcher, one object a line: `{"ready": true}` once its imports are done; `{"spawned": id, "pid": pid}`
  or `{"refused": id, "reason": text}` per role; `{"exited": pid, "status": wait status}` when a role ends.
- The zygote exits when the launcher hangs up; its roles die with it (each has the zygote's death as its
  parent-death signal), as the zygote dies with the launcher.

A script that imports shardflow before torch has its zygote start then (shardflow/__init__.py), importing on another
core while the script imports; the launcher adopts it.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import gc
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import sysconfig
import threading
import zipfile
from collections.abc import Callable, Mapping, Sequence
from typing import IO, TYPE_CHECKING, Any

import shardflow
from shardflow import env
from shardflow.cluster.spec import TaskSpec

if TYPE_CHECKING:
    import psutil

    from shardflow.cluster.zygote_fork import ForkedZygote

    ZygoteProcess = subprocess.Popen[bytes] | ForkedZygote
    """A fresh zygote's process, or one forked from the script's (zygote_fork.py)."""

PRELOAD = ("numpy", "numpy.random", "torch", "shardflow.train.estimator", "torch._dynamo")
"""What the zygote imports once. Named, not imported here: cluster/ does not depend on train/, the roles do. None
may touch CUDA on import (not even torch.cuda.is_available()): a process forked after that cannot use the GPU.
torch.optim imports torch._dynamo on a PS's first update: ~1.2 s of CPU, which the PS would spend while the chief
waits for it to be initialised."""
READY_TIMEOUT_S = 60.0
SPAWN_TIMEOUT_S = 30.0
ZYGOTE_NAME = "sf:zygote"
_NAME_PREFIX = "sf:"
JOB_VARIABLES = (env.CLUSTER_SECRET, env.LOCAL_THREADS, env.WORKER_THREADS_UP_TO, env.RUNTIME_DIR)
"""What a launcher adds to its roles' environment for the job: read when a role runs, never on import."""
LOADING_VARIABLES = ("PYTHON", "LD_", "OMP_", "GOMP_", "MKL_", "OPENBLAS_", "TORCH", "PYTORCH_", "CUDA_")
"""The beginnings of the variables that Python, torch, numpy and their libraries read as they load. A zygote that
started before one of them changed (shardflow/__init__.py) is not adopted; others change as modules load (e.g.
scikit-learn sets KMP_DUPLICATE_LIB_OK), and the zygote's preloads see their new values."""
REQUEST_HEADER = struct.Struct("!I")
"""The length of the JSON request that follows."""
_PR_SET_PDEATHSIG = 1


class ZygoteError(Exception):
    """The zygote could not start a role: it did not come up, refused, or is gone."""


def wanted() -> bool:
    """Whether `SHARDFLOW_ZYGOTE` (on by default) lets roles be forked from a zygote."""
    setting = env.get(env.ZYGOTE) or "on"
    if setting not in ("on", "off"):
        raise ValueError(f"{env.ZYGOTE}={setting!r}: use on (the default) or off (a fresh Python per role)")
    return setting == "on"


def can_fork(command: Sequence[str]) -> bool:
    """Whether the zygote runs `command` as `python` would: this interpreter, no options, a script file or `-m`."""
    if not sys.platform.startswith("linux") or len(command) < 2 or command[0] != sys.executable:
        return False
    if command[1] == "-m":
        return len(command) > 2 and bool(command[2])
    script = command[1]
    return not script.startswith("-") and os.path.isfile(script) and not zipfile.is_zipfile(script)


def installed_modules() -> list[str]:
    """The modules this process imported from the standard library, installed packages or shardflow: what a role
    running the same script imports too, so the zygote can import them once for all.
    Never `__main__` nor the user's own modules (beside the script, or on PYTHONPATH): only the role runs those."""
    paths = sysconfig.get_paths()
    roots = tuple({os.path.join(paths[key], "") for key in ("stdlib", "purelib", "platlib")})
    names = []
    for name, module in list(sys.modules.items()):
        file = getattr(module, "__file__", None)
        if name in ("__main__", "__mp_main__"):  # e.g. `python -m pytest`: a module of an installed package
            continue
        if name.startswith("shardflow.") or (isinstance(file, str) and file.startswith(roots)):
            names.append(name)
    return names


def process_name(task_name: str) -> str:
    """The name a forked role's process carries (at most 15 bytes are kept), e.g. `sf:worker:1`."""
    return _NAME_PREFIX + task_name


def role_of(process: psutil.Process) -> str | None:
    """The task name (`worker:1`) of a local cluster's role process, or None: for tools and tests that look at
    process trees. A forked role's environment in /proc is the zygote's, so its name says which role it is; what
    a role forks or starts inherits its name or environment, and is no role."""
    parent = process.parent()
    if parent is None:
        return None
    name: str = process.name()
    parent_name: str = parent.name()
    if parent_name == ZYGOTE_NAME and name.startswith(_NAME_PREFIX):
        return name[len(_NAME_PREFIX) :]
    if name.startswith(_NAME_PREFIX) or parent_name.startswith(_NAME_PREFIX):
        return None
    cluster = process.environ().get(env.CLUSTER)
    if cluster is None or parent.environ().get(env.CLUSTER) == cluster:
        return None
    task = json.loads(cluster)["task"]
    return TaskSpec(task["type"], task["index"]).name


def die_with_parent() -> Callable[[], None] | None:
    """A function for a fresh child that has Linux SIGKILL it when the process that made it dies; None elsewhere.

    Linux sends the signal when the *thread* that forked the child ends."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    parent = os.getpid()
    return lambda: _die_with(parent, prctl)


def die_with(parent: int) -> None:
    """Has Linux SIGKILL this process when the thread of `parent` that started it ends; at once if it has."""
    if sys.platform.startswith("linux"):
        _die_with(parent, ctypes.CDLL(None, use_errno=True).prctl)


def _die_with(parent: int, prctl: Callable[[int, int], int]) -> None:
    prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL))
    # The parent may have died before prctl ran; then no signal would ever come.
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGKILL)


def exit_without_final_collection() -> None:
    """Has this process, when it exits, collect its garbage once and then freeze what is left, so that Python's
    shutdown does not collect it again while it tears the modules down. With torch and scikit-learn imported, those
    shutdown collections take 1.5-3 s of a process's exit; one collection and a freeze, ~0.3 s. As Python's own
    documentation allows, objects still alive at exit then may not have `__del__` called; refcounting still tears
    them down, and everything that is garbage when the process exits is collected, finalizers and all."""
    atexit.unregister(collect_then_freeze)  # once, however often it is asked for
    atexit.register(collect_then_freeze)


def collect_then_freeze() -> None:
    gc.collect()
    gc.freeze()


def _adopt_early_zygote(environment: Mapping[str, str]) -> tuple[ZygoteProcess, socket.socket] | None:
    """The zygote shardflow started on import, if there is one and the LOADING_VARIABLES of its environment are the
    job's; another is stopped: torch, as it loaded there, read values the job has changed since."""
    early, shardflow._early_zygote = shardflow._early_zygote, None
    if early is None:
        return None
    starter, process, ours, early_environment = early
    if starter != os.getpid():
        return None  # this process is a fork of the one that started it, and shares its end of the conversation

    def read_on_loading(variables: Mapping[str, str]) -> dict[str, str]:
        return {name: value for name, value in variables.items() if name.startswith(LOADING_VARIABLES)}

    if read_on_loading(early_environment) == read_on_loading(environment):
        return process, ours
    ours.close()  # it exits when hung up on; its imports may still take a while
    process.kill()
    process.wait()
    return None


class ForkedProcess:
    """A role forked by the zygote, with the part of `subprocess.Popen` the launcher uses."""

    def __init__(self, pid: int, stdout: IO[bytes]) -> None:
        self.pid = pid
        self.stdout = stdout
        self.returncode: int | None = None
        self._exited = threading.Event()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._exited.wait(timeout):
            raise subprocess.TimeoutExpired(f"role process {self.pid}", timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def _set_exited(self, returncode: int) -> None:
        self.returncode = returncode
        self._exited.set()


class Zygote:
    """The launcher's end: starts the zygote, asks it for role processes and follows their exits."""

    def __init__(self, process: ZygoteProcess, control: socket.socket, say: Callable[[str], None]) -> None:
        self.pid = process.pid
        self._process = process
        self._control = control
        self._say = say
        self._send_lock = threading.Lock()  # apart from _state: a send may block until the zygote reads
        self._state = threading.Condition()
        self._ready = False
        self._gone = False
        self._closing = False
        self._next_id = 0
        self._pending: dict[int, IO[bytes]] = {}  # request id -> the output pipe's read end
        self._replies: dict[int, ForkedProcess | str] = {}  # the process, or why the zygote refused
        self._roles: dict[int, ForkedProcess] = {}  # pid -> process, until it exits
        self._reader = threading.Thread(target=self._read_reports, daemon=True)
        self._reader.start()

    @classmethod
    def start(cls, environment: Mapping[str, str], say: Callable[[str], None]) -> Zygote:
        """Starts a zygote with `environment`, or adopts the one this process started when it imported shardflow,
        and waits until its imports are done. Call it from a thread that outlives the zygote (the parent-death
        signal)."""
        adopted = _adopt_early_zygote(environment)
        if adopted is not None:
            process, ours = adopted
        else:
            try:
                process, ours = shardflow._start_zygote_process(environment)
            except OSError as error:
                raise ZygoteError(f"the zygote did not start: {error}") from error
        zygote = cls(process, ours, say)
        with zygote._state:
            zygote._state.wait_for(lambda: zygote._ready or zygote._gone, READY_TIMEOUT_S)
            ready, gone = zygote._ready and not zygote._gone, zygote._gone
        if not ready:
            zygote.close()  # reaps it
            why = f"exited with code {process.returncode}" if gone else f"took over {READY_TIMEOUT_S:g} s"
            raise ZygoteError(f"the zygote (pid {zygote.pid}) {why} before its imports were done (see its stderr)")
        return zygote

    def preload(self, modules: Sequence[str], environment: Mapping[str, str]) -> None:
        """Has the zygote import `modules` (see installed_modules) with the job's `environment` before it forks the
        next role. One that fails to import is left for the role to import; one that makes forking unsafe (it
        started a thread or initialised CUDA) has the zygote refuse every role from then on, so the launcher starts
        them as fresh processes."""
        modules_environment = {name: value for name, value in environment.items() if name not in JOB_VARIABLES}
        self._send(json.dumps({"preload": list(modules), "env": modules_environment}).encode())

    def spawn(self, argv: Sequence[str], environment: Mapping[str, str], name: str) -> ForkedProcess:
        """Forks a process that runs `argv` (see can_fork) with `environment` in this working directory."""
        request: dict[str, Any] = {"argv": list(argv), "env": dict(environment), "cwd": os.getcwd(), "name": name}
        read_end, write_end = os.pipe()
        stdout = open(read_end, "rb")  # noqa: SIM115 (the launcher reads it to the end and closes it)
        with self._state:
            request_id = request["id"] = self._next_id
            self._next_id += 1
            self._pending[request_id] = stdout
        try:
            if not self._gone:
                self._send(json.dumps(request).encode(), write_end)
        finally:
            os.close(write_end)
        with self._state:
            self._state.wait_for(lambda: request_id in self._replies or self._gone, SPAWN_TIMEOUT_S)
            reply = self._replies.pop(request_id, None)
            if reply is None:
                self._pending.pop(request_id, None)  # a late reply kills the process it reports
        if reply is None:
            stdout.close()
            why = "is gone" if self._gone else f"did not answer within {SPAWN_TIMEOUT_S:g} s"
            raise ZygoteError(f"the zygote (pid {self.pid}) {why}, asked to start {name}")
        if isinstance(reply, str):
            raise ZygoteError(f"the zygote (pid {self.pid}) could not start {name}: {reply}")
        return reply

    def close(self, timeout_s: float = 5.0) -> None:
        """Hangs up; the zygote exits, and with it any role still running."""
        with self._state:
            self._closing = True
        with contextlib.suppress(OSError):
            self._control.shutdown(socket.SHUT_WR)
        try:
            self._process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._reader.join(timeout_s)
        self._control.close()

    def _send(self, payload: bytes, fd: int | None = None) -> None:
        data = REQUEST_HEADER.pack(len(payload)) + payload
        # A failed send means the zygote is gone; the reader then hears it hang up.
        with self._send_lock, contextlib.suppress(OSError):
            sent = socket.send_fds(self._control, [data], [] if fd is None else [fd])
            self._control.sendall(data[sent:])

    def _read_reports(self) -> None:
        with self._control.makefile("rb") as reports:
            for line in reports:
                self._on_report(json.loads(line))
        self._on_hang_up()

    def _on_report(self, report: dict[str, Any]) -> None:
        with self._state:
            if "exited" in report:
                process = self._roles.pop(report["exited"], None)
                if process is not None:
                    process._set_exited(os.waitstatus_to_exitcode(report["status"]))
            elif "spawned" in report:
                stdout = self._pending.pop(report["spawned"], None)
                if stdout is None:  # its request gave up waiting
                    os.kill(report["pid"], signal.SIGKILL)
                    return
                process = self._roles[report["pid"]] = ForkedProcess(report["pid"], stdout)
                self._replies[report["spawned"]] = process
            elif "refused" in report and report["refused"] in self._pending:
                self._pending.pop(report["refused"]).close()
                self._replies[report["refused"]] = report["reason"]
            self._ready = self._ready or "ready" in report
            self._state.notify_all()

    def _on_hang_up(self) -> None:
        """The zygote exited: its roles were sent SIGKILL (parent-death signal); so are their process groups."""
        with self._state:
            self._gone = True
            lost = list(self._roles.values())
            self._roles.clear()
            closing = self._closing
            self._state.notify_all()
        for process in lost:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)
            process._set_exited(-signal.SIGKILL)
        if not closing and self._ready:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._process.wait(5.0)
            self._say(
                f"the zygote (pid {self.pid}) exited with code {self._process.returncode}; its roles died with it"
            )
