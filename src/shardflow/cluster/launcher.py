"""Runs one local process per task of a ClusterSpec, prefixes their output, stops them together.

A role that runs a Python script is forked from a zygote that imported torch and shardflow once (cluster/zygote.py);
any other command, or all with `SHARDFLOW_ZYGOTE=off`, starts as a fresh process."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO, Protocol, TextIO

from shardflow import env
from shardflow.cluster import liveness, zygote
from shardflow.cluster.role_log import RoleLog
from shardflow.cluster.runtime_dir import make_runtime_dir
from shardflow.cluster.spec import ClusterSpec, TaskSpec
from shardflow.cluster.zygote import Zygote, ZygoteError
from shardflow.comm.security import new_secret

RESTARTABLE = ("chief", "worker", "ps", "evaluator")
"""The roles a launcher restarts. A worker resumes where the PS say it stopped; a restarted PS gets every PS restored
from the latest checkpoint (train/checkpoints/restore.py); a restarted chief resumes from the live PS at the exact
global step (train/chief.py). The chief only when a signal killed it (SIGKILL for a hang, the OOM killer): one that
exited ended the job on purpose (1: a role failed for good; 143: preempted), as does SIGTERM or SIGINT to it."""
_ENDS_A_CHIEF_ON_PURPOSE = (signal.SIGTERM, signal.SIGINT)
MAX_BACKOFF_S = 30.0
AFTER_THE_CHIEF_S = 30.0
"""Once the chief ended the job (exit 0), how long the other roles get to exit by themselves before they are
stopped: one that could not hear the end (stopped, hung) does not hold the job open, nor is it restarted."""
KILLED_EXIT_TIMEOUT_S = 10.0
"""How long stop() waits to hear of every role's exit after SIGKILL before it goes on without."""
HEALTHY_RUN_S = 60.0
"""A role whose process ran this long before it died starts its restart back-off over from restart_backoff_s: a
death now and then in a long job is no crash loop, and its recovery should not wait out a back-off grown earlier."""
PREEMPTED_EXIT_CODE = 128 + signal.SIGTERM
"""How a preempted job's chief exits, checkpointed or not: the status SIGTERM gives (143)."""
USER_ERROR_EXIT_CODE = 3
"""How a role exits when the user's code or data failed (loss_fn, the model, input_fn): it would fail the same way
again, so it is not restarted; restarts are for crashes, hangs and lost processes."""


class RoleProcess(Protocol):
    """What the launcher needs of a role's process: a `subprocess.Popen` or a `zygote.ForkedProcess`."""

    @property
    def pid(self) -> int: ...

    @property
    def stdout(self) -> IO[bytes] | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def send_signal(self, sig: int) -> None: ...


@dataclass(frozen=True)
class RoleExit:
    """How one task's process ended."""

    task: TaskSpec
    pid: int
    returncode: int

    def describe(self) -> str:
        text = f"{self.task.name} (pid {self.pid}) exited with code {self.returncode}"
        if self.returncode < 0:
            with contextlib.suppress(ValueError):  # not every negative code names a signal
                text += f" ({signal.Signals(-self.returncode).name})"
        return text


class LocalLauncher:
    """Starts one process per task of a ClusterSpec, all running one command, and watches them."""

    def __init__(
        self,
        spec: ClusterSpec,
        command: Sequence[str],
        *,
        skip: Collection[TaskSpec] = (),
        env: Mapping[str, str] | None = None,
        prefix_output: bool = True,
        output: TextIO | None = None,
        log_dir: str | os.PathLike[str] | None = None,
        max_restarts: int = 0,
        restart_backoff_s: float = 1.0,
        restartable: Collection[str] = RESTARTABLE,
        preload: Sequence[str] = (),
        hung_timeout_s: float | None = None,
        healthy_run_s: float = HEALTHY_RUN_S,
        after_chief_s: float = AFTER_THE_CHIEF_S,
    ) -> None:
        """`max_restarts`: how many times a process of a task whose type is in `restartable` is started again
        after it dies (any exit but 0, while the launcher is not stopping; the chief's, see RESTARTABLE),
        `restart_backoff_s` after its first death, doubling each time up to MAX_BACKOFF_S, and again from
        `restart_backoff_s` after a run of `healthy_run_s`; a death beyond that is the task's failure.
        `hung_timeout_s`: such a process that leaves its liveness file (cluster/liveness.py) untouched for this long
        from its start is killed, and so restarted. `preload`: modules the zygote imports for every forked role.
        `after_chief_s`: see AFTER_THE_CHIEF_S."""
        if not command or isinstance(command, str):
            raise ValueError(
                f"command must be a non-empty list of arguments, e.g. [python, 'train.py'], got {command!r}"
            )
        for task in skip:
            spec.validate_task(task)
        self._tasks = [task for task in spec.tasks() if task not in skip]
        self._spec, self._command, self._env, self._secret = spec, list(command), dict(env or {}), new_secret()
        self._runtime_dir: str | None = None
        self._prefix_output = prefix_output
        # Each role's output is also kept, unprefixed, in log_dir/<role>.log.
        self._log_dir = Path(log_dir) if log_dir is not None else None
        self._output = output if output is not None else sys.stdout
        self._write_lock = threading.Lock()
        self._state = threading.Condition()
        self._processes: dict[TaskSpec, RoleProcess] = {}
        self._zygote: Zygote | None = None
        self._preload = list(preload)
        self._forking = False  # whether new processes come from the zygote; off for good after it failed once
        self._exits: list[RoleExit] = []
        self._first_failure: RoleExit | None = None
        self._chief_done_at: float | None = None  # when the chief exited 0: the job is over, whatever the others do
        self._after_chief_s = after_chief_s
        self._readers: list[threading.Thread] = []
        self._max_restarts, self._restart_backoff_s = max_restarts, restart_backoff_s
        self._restartable = frozenset(restartable)
        self._restart_counts: dict[TaskSpec, int] = {}
        self._healthy_run_s, self._hung_timeout_s = healthy_run_s, hung_timeout_s
        self._backoff_levels: dict[TaskSpec, int] = {}  # the back-off of the next restart is 2**level times the first
        self._started_at: dict[TaskSpec, float] = {}
        # Deaths waiting out their back-off: when to start the task again, and how its last process ended.
        self._pending: dict[TaskSpec, tuple[float, RoleExit]] = {}
        self.restarts: list[RoleExit] = []
        """Every death that was followed by a restart, in order."""
        self._started = self._stopping = self._stopped = False

    def start(self) -> None:
        """Starts every task not skipped. Call it from a thread that outlives the children.

        Linux delivers the parent-death signal when the *thread* that forked a child exits.
        """
        if self._started:
            raise RuntimeError("LocalLauncher.start() was already called")
        self._started = True
        self._runtime_dir = make_runtime_dir()
        try:
            self._start_zygote()
            for task in self._tasks:
                self._processes[task] = self._spawn(task)
        except BaseException:
            self._follow_processes(self._processes)
            self.stop(grace_s=0)
            raise
        self._follow_processes(self._processes)
        if self._max_restarts:
            # Restarted processes are forked by this thread, which lives as long as the launcher: a child's
            # parent-death signal fires when the thread that forked it ends.
            self._start_thread(self._restart_when_due)
            if self._hung_timeout_s is not None:
                self._start_thread(self._kill_when_hung, self._hung_timeout_s)

    def _start_zygote(self) -> None:
        if not (zygote.wanted() and zygote.can_fork(self._command)):
            return
        try:
            self._zygote = Zygote.start(self._job_env(), self._say)
            self._forking = True
        except ZygoteError as error:
            self._say(f"{error}; every role starts as a fresh process instead")
            return
        if self._preload:
            self._zygote.preload(self._preload, self._job_env())

    def _spawn(self, task: TaskSpec) -> RoleProcess:
        self._started_at[task] = time.monotonic()
        if self._hung_timeout_s is not None:
            # The watch starts now: a role stopped before it first touched the file is hung too.
            liveness.touch(self._liveness_file(task))
        if self._zygote is not None and self._forking:
            try:
                return self._zygote.spawn(self._command, self._child_env(task), zygote.process_name(task.name))
            except ZygoteError as error:
                self._forking = False
                self._say(f"{error}; roles start as fresh processes from now on")
        return subprocess.Popen(
            self._command,
            env=self._child_env(task),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=zygote.die_with_parent(),
        )

    def _restart_when_due(self) -> None:
        with self._state:
            while not self._stopping:
                now = time.monotonic()
                due = [task for task, (at, _) in self._pending.items() if at <= now]
                for task in due:
                    del self._pending[task]
                    # Under the lock, so that stop() sees every process it has to end.
                    process = self._processes[task] = self._spawn(task)
                    self._follow_processes({task: process})
                    self._say(f"restarted {task.name} (pid {process.pid})")
                wake = min((at for at, _ in self._pending.values()), default=None)
                self._state.wait(None if wake is None else max(0.0, wake - time.monotonic()))
            # Stopping: a death still waiting for its restart is how that task ended.
            for _, role_exit in self._pending.values():
                self._exits.append(role_exit)
            self._pending.clear()
            self._state.notify_all()

    def _kill_when_hung(self, timeout_s: float) -> None:
        """SIGKILL to a role silent past `timeout_s` that can be restarted: _wait_for then restarts it. One that
        cannot is left to the chief, which waits for it, hands its shard over or fails the job naming it."""
        with self._state:
            while not self._state.wait_for(lambda: self._stopping, min(1.0, timeout_s / 4)):
                exited = {role_exit.task for role_exit in self._exits}
                for task, process in self._processes.items():
                    silent_s = liveness.silent_for(self._liveness_file(task))
                    if silent_s is None or silent_s <= timeout_s:
                        continue
                    if task in self._pending or task in exited or not self._can_restart(task):
                        continue
                    liveness.forget(self._liveness_file(task))  # one kill per hang
                    self._say(
                        f"{task.name} (pid {process.pid}) is hung: no heartbeat for {silent_s:.1f}s "
                        f"(hung_timeout_s={timeout_s:g}); killing it to restart it"
                    )
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(process.pid, signal.SIGKILL)

    def _can_restart(self, task: TaskSpec, returncode: int = -signal.SIGKILL) -> bool:
        """Whether `task` gets another process after one that ended with `returncode` (by default: that the
        launcher's SIGKILL ends)."""
        if task.type not in self._restartable or self._restart_counts.get(task, 0) >= self._max_restarts:
            return False
        if returncode == USER_ERROR_EXIT_CODE:
            return False
        return task.type != "chief" or (returncode < 0 and -returncode not in _ENDS_A_CHIEF_ON_PURPOSE)

    def _liveness_file(self, task: TaskSpec) -> Path:
        assert self._runtime_dir is not None
        return Path(self._runtime_dir) / f"{task.name.replace(':', '-')}.alive"

    @property
    def pids(self) -> dict[str, int]:
        return {task.name: process.pid for task, process in self._processes.items()}

    def wait(self, timeout_s: float | None = None) -> RoleExit | None:
        """Waits until all tasks exited (None if all exited 0) or one failed (returns that one).

        Exits caused by stop() are not failures.
        """
        self._require_started()
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._state:
            while self._first_failure is None and len(self._exits) < len(self._processes):
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(f"tasks still running after {timeout_s} s: {', '.join(self._running())}")
                if self._chief_done_at is not None:
                    left_s = self._chief_done_at + self._after_chief_s - time.monotonic()
                    if left_s <= 0:
                        self._say(
                            f"the chief ended the job {self._after_chief_s:g}s ago; stopping "
                            f"{', '.join(self._running())}, which did not exit"
                        )
                        break
                    remaining = left_s if remaining is None else min(remaining, left_s)
                self._state.wait(remaining)
            return self._first_failure

    def watch(self, on_failure: Callable[[RoleExit], None]) -> None:
        """Calls on_failure once, from a daemon thread, when a task fails."""
        self._require_started()

        def run() -> None:
            with self._state:
                self._state.wait_for(
                    lambda: (
                        self._first_failure is not None or self._stopping or len(self._exits) == len(self._processes)
                    )
                )
                failure = self._first_failure
            if failure is not None:
                on_failure(failure)

        self._start_thread(run)

    def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM to every task's process group, SIGKILL after grace_s in total, reap all."""
        with self._state:
            if self._stopped:
                return
            self._stopping = True
            self._state.notify_all()  # a restart waiting out its back-off is called off
        self._signal_groups(signal.SIGTERM)
        with self._state:
            self._state.wait_for(lambda: len(self._exits) == len(self._processes), grace_s)
        # Also kills what the tasks left behind in their groups, e.g. a subprocess ignoring SIGTERM.
        self._signal_groups(signal.SIGKILL)
        with self._state:
            reaped = self._state.wait_for(lambda: len(self._exits) == len(self._processes), KILLED_EXIT_TIMEOUT_S)
            unheard = [] if reaped else self._running()
            self._stopped = True
        if unheard:
            # Closing the zygote below ends its roles with it (their parent-death signal); say whom this gave up on.
            self._say(f"no exit heard from {', '.join(unheard)} {KILLED_EXIT_TIMEOUT_S:g} s after SIGKILL; going on")
        if self._zygote is not None:
            self._zygote.close()
        if self._runtime_dir is not None:
            shutil.rmtree(self._runtime_dir, ignore_errors=True)
        deadline = time.monotonic() + 1.0
        for reader in self._readers:
            reader.join(max(0.0, deadline - time.monotonic()))

    def preempt(self, grace_s: float) -> int | None:
        """SIGTERM to the chief alone, which checkpoints and ends the job (see train/preemption.py); waits up to
        grace_s for every task to exit. How they exit is no failure; stop() ends what is left. The chief's exit
        status, None while it runs."""
        with self._state:
            self._stopping = True
            self._state.notify_all()
        chief = next((process for task, process in self._processes.items() if task.type == "chief"), None)
        if chief is not None:
            # The process, not its group: the chief's own subprocesses are the chief's to end.
            with contextlib.suppress(ProcessLookupError):
                chief.send_signal(signal.SIGTERM)
        with self._state:
            self._state.wait_for(lambda: len(self._exits) == len(self._processes), grace_s)
            return next((ended.returncode for ended in self._exits if ended.task.type == "chief"), None)

    def __enter__(self) -> LocalLauncher:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()

    def _child_env(self, task: TaskSpec) -> dict[str, str]:
        child = {**self._job_env(), env.CLUSTER: self._spec.to_json(task)}
        if self._hung_timeout_s is not None:
            child[env.LIVENESS_FILE] = str(self._liveness_file(task))
        return child

    def _job_env(self) -> dict[str, str]:
        """Every role's environment but its task: also the zygote's, so that what reads the environment at import
        time sees what it would in a fresh role."""
        child = {**os.environ, **self._env}
        # One secret per job, made here unless the job has one: no other process can talk to its roles.
        given = (child.get(name, "").strip() for name in (env.CLUSTER_SECRET, env.CLUSTER_SECRET_FILE, env.INSECURE))
        if not any(given):
            child[env.CLUSTER_SECRET] = self._secret
        # Without TF_CONFIG no reader of the environment can take it for this task's role.
        child.pop("TF_CONFIG", None)
        child["PYTHONUNBUFFERED"] = "1"
        if self._runtime_dir is not None:
            child[env.RUNTIME_DIR] = self._runtime_dir
        return child

    def _start_thread(self, target: Callable[..., None], *args: object) -> threading.Thread:
        thread = threading.Thread(target=target, args=args, daemon=True)
        thread.start()
        return thread

    def _follow_processes(self, processes: Mapping[TaskSpec, RoleProcess]) -> None:
        # At start, threads start only after every fork: preexec_fn runs between fork and exec.
        for task, process in processes.items():
            self._start_thread(self._wait_for, task, process)
            assert process.stdout is not None
            self._readers.append(self._start_thread(self._copy_output, task, process.stdout))

    def _wait_for(self, task: TaskSpec, process: RoleProcess) -> None:
        returncode = process.wait()
        with self._state:
            role_exit = RoleExit(task, process.pid, returncode)
            if task.type == "chief" and returncode == 0:
                self._chief_done_at = time.monotonic()
            over = self._chief_done_at is not None  # the job's result is the chief's: nothing after it fails it
            if returncode != 0 and not self._stopping and not over and self._can_restart(task, returncode):
                restarts = self._restart_counts[task] = self._restart_counts.get(task, 0) + 1
                ran_s = time.monotonic() - self._started_at[task]
                level = 0 if ran_s >= self._healthy_run_s else self._backoff_levels.get(task, 0)
                self._backoff_levels[task] = level + 1
                delay = min(self._restart_backoff_s * 2**level, MAX_BACKOFF_S)
                self._pending[task] = (time.monotonic() + delay, role_exit)
                self.restarts.append(role_exit)
                self._say(
                    f"{role_exit.describe()}; restarting it in {delay:g}s (restart {restarts} of {self._max_restarts})"
                )
                self._state.notify_all()
                return
            self._exits.append(role_exit)
            if returncode != 0 and over and not self._stopping:
                self._say(f"{role_exit.describe()} after the chief ended the job")
            elif returncode != 0 and not self._stopping and self._first_failure is None:
                self._first_failure = role_exit
            self._state.notify_all()

    def _copy_output(self, task: TaskSpec, stream: IO[bytes]) -> None:
        prefix = f"[{task.name}] " if self._prefix_output else ""
        writable = True
        log: contextlib.AbstractContextManager[RoleLog | None] = contextlib.nullcontext()
        if self._log_dir is not None:
            log = RoleLog(self._log_dir, task.name, self._say)
        with stream, log as log_file:
            for raw in iter(stream.readline, b""):
                line = raw.decode("utf-8", errors="replace")
                if not line.endswith("\n"):
                    line += "\n"
                if log_file is not None:
                    log_file.write(line)
                if not writable:
                    continue  # keep draining, or the child blocks on a full pipe
                with self._write_lock:
                    try:
                        self._output.write(prefix + line)
                        self._output.flush()
                    except (OSError, ValueError):
                        writable = False

    def _say(self, line: str) -> None:
        with self._write_lock, contextlib.suppress(OSError, ValueError):
            self._output.write(f"[launcher] {line}\n")
            self._output.flush()

    def _signal_groups(self, signum: signal.Signals) -> None:
        for process in self._processes.values():
            # Each task leads its own session, so its group id is its pid even after it exited.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signum)

    def _running(self) -> list[str]:
        exited = {role_exit.task for role_exit in self._exits}
        return [task.name for task in self._processes if task not in exited]

    def _require_started(self) -> None:
        if not self._started:
            raise RuntimeError("call LocalLauncher.start() first")
