"""The two ways `make chaos` runs an audit job (1 chief, 2 PS, 2 workers), each with a supervisor that restarts what
dies: `shardflow launch` (workers and PS), or every role a process of its own under TF_CONFIG with the driver as the
supervisor of all of them, the chief included, as a JobSet's or TFJob's restart policy is."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
from audited_runs import JOB, Lines, Run

from shardflow.cluster.zygote import role_of

ROLES = ("chief", "ps:0", "ps:1", "worker:0", "worker:1")
MAX_RESTARTS = 50
"""Per role: a soak kills the same role many times; the defaults (3) would end it by design."""
RESTART_BACKOFF_S = 0.5


class ChaosJob:
    """A running job: its output lines, its role processes by name, and every process it ever had (to find orphans)."""

    def __init__(self) -> None:
        self.lines = Lines()
        self._seen: dict[int, float] = {}
        """pid -> start time of every process of the job seen so far."""
        self._seen_lock = threading.Lock()

    def pids(self) -> dict[str, int]:
        raise NotImplementedError

    def ended(self) -> bool:
        raise NotImplementedError

    def returncode(self) -> int | None:
        raise NotImplementedError

    def kill(self) -> None:
        """Ends every process of the job (a stopped one too)."""
        raise NotImplementedError

    def wait(self, timeout_s: float) -> int | None:
        """The job's exit status once it ended by itself; None if it had not within timeout_s."""
        deadline = time.monotonic() + timeout_s
        while not self.ended():
            if time.monotonic() > deadline:
                return None
            time.sleep(0.2)
        return self.returncode()

    def sleep(self, seconds: float) -> bool:
        """Sleeps, or less if the job ends; whether it still runs."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self.ended():
                return False
            time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
        return not self.ended()

    def _remember(self, processes: list[psutil.Process]) -> None:
        with self._seen_lock:
            for process in processes:
                with contextlib.suppress(psutil.Error):
                    self._seen.setdefault(process.pid, process.create_time())

    def _watch(self, roots: Callable[[], list[int]]) -> None:
        """Remembers every process under the `roots` (and the roots) once a second while the job runs."""

        def watch() -> None:
            while not self.ended():
                self._remember(_tree(roots()))
                time.sleep(1.0)

        threading.Thread(target=watch, daemon=True).start()

    def leftovers(self) -> list[int]:
        """Processes of the job still alive (not zombies) after it ended: orphans."""
        alive = []
        with self._seen_lock:
            seen = dict(self._seen)
        for pid, created in seen.items():
            with contextlib.suppress(psutil.Error):
                process = psutil.Process(pid)
                if process.create_time() == created and process.status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
        return alive

    def kill_leftovers(self) -> list[int]:
        """Kills the orphans, after a moment for the processes still on their way out; returns their pids."""
        time.sleep(1.0)
        orphans = self.leftovers()
        for pid in orphans:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return orphans


def _tree(roots: list[int]) -> list[psutil.Process]:
    found = []
    for pid in roots:
        with contextlib.suppress(psutil.Error):
            root = psutil.Process(pid)
            found += [root, *root.children(recursive=True)]
    return found


def _kill_tree(processes: list[psutil.Process]) -> None:
    for process in processes:
        with contextlib.suppress(psutil.Error):
            process.send_signal(signal.SIGCONT)  # a stopped process dies of SIGKILL too, but its group may not
            process.kill()


class LaunchedJob(ChaosJob):
    """`shardflow launch --workers 2 --ps 2 audit.py config.json`: the launcher restarts a worker or PS that dies;
    a lost chief ends the job (its process is the launcher's control plane)."""

    def __init__(self, workdir: Path, config: dict[str, Any], env: dict[str, str]) -> None:
        super().__init__()
        prefix = [sys.executable, "-m", "shardflow", "launch", "--workers", "2", "--ps", "2"]
        prefix += ["--max-restarts", str(MAX_RESTARTS), "--restart-backoff", str(RESTART_BACKOFF_S)]
        self._run = Run(workdir, config, env, prefix)
        self.lines = self._run
        self._watch(lambda: [self._run.proc.pid])

    def pids(self) -> dict[str, int]:
        found = {}
        for process in _tree([self._run.proc.pid])[1:]:
            with contextlib.suppress(psutil.Error):
                if (name := role_of(process)) is not None:
                    found[name] = process.pid
        return found

    def ended(self) -> bool:
        return self._run.proc.poll() is not None

    def returncode(self) -> int | None:
        return self._run.proc.poll()

    def kill(self) -> None:
        _kill_tree(_tree([self._run.proc.pid]))
        self._run.wait(10)


class SupervisedJob(ChaosJob):
    """Every role a process of its own with TF_CONFIG on 127.0.0.1; this object is their supervisor: a role that
    exits with an error is started again after RESTART_BACKOFF_S, up to MAX_RESTARTS times. The job has ended when
    every role exited 0, or failed when a role ran out of restarts."""

    def __init__(self, workdir: Path, config: dict[str, Any], env: dict[str, str]) -> None:
        super().__init__()
        path = workdir / "config.json"
        path.write_text(json.dumps(config))
        self._command = [sys.executable, str(JOB), str(path)]
        self._env = env
        self._cluster = _loopback_cluster()
        self._state = threading.Lock()
        self._processes: dict[str, subprocess.Popen[str]] = {}
        self._exits: dict[str, int] = {}
        """The roles done for good: exited 0, or out of restarts."""
        self._restarts: dict[str, int] = {}
        self._stopping = False
        for role in ROLES:
            self._start(role)
        self._watch(lambda: list(self.pids().values()))

    def _start(self, role: str) -> None:
        task_type, index = role.split(":") if ":" in role else (role, "0")
        tf_config = {"cluster": self._cluster, "task": {"type": task_type, "index": int(index)}}
        process = subprocess.Popen(
            self._command,
            env={**self._env, "TF_CONFIG": json.dumps(tf_config)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        assert process.stdout is not None
        self._processes[role] = process
        self._remember(_tree([process.pid]))
        self.lines.follow(process.stdout, f"[{role}] ")
        threading.Thread(target=self._supervise, args=(role, process), daemon=True).start()

    def _supervise(self, role: str, process: subprocess.Popen[str]) -> None:
        returncode = process.wait()
        with self._state:
            if self._stopping:
                return
            restarts = self._restarts.get(role, 0)
            if returncode == 0 or restarts >= MAX_RESTARTS:
                self._exits[role] = returncode
                self.lines.add(f"[supervisor] {role} (pid {process.pid}) exited with code {returncode}")
                return
            self._restarts[role] = restarts + 1
            self.lines.add(
                f"[supervisor] {role} (pid {process.pid}) exited with code {returncode}; restarting it in "
                f"{RESTART_BACKOFF_S:g}s"
            )
        time.sleep(RESTART_BACKOFF_S)
        with self._state:
            if not self._stopping:
                self._start(role)
                self.lines.add(f"[supervisor] restarted {role} (pid {self._processes[role].pid})")

    def pids(self) -> dict[str, int]:
        with self._state:
            return {role: p.pid for role, p in self._processes.items() if p.poll() is None}

    def ended(self) -> bool:
        with self._state:
            failed = any(code != 0 for code in self._exits.values())
            return failed or len(self._exits) == len(ROLES)

    def returncode(self) -> int | None:
        if not self.ended():
            return None
        with self._state:
            return 0 if all(code == 0 for code in self._exits.values()) else 1

    def kill(self) -> None:
        with self._state:
            self._stopping = True
            processes = list(self._processes.values())
        for process in processes:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGCONT)
                os.killpg(process.pid, signal.SIGKILL)
        for process in processes:
            process.wait()


def _loopback_cluster() -> dict[str, list[str]]:
    """Free ports on 127.0.0.1 for every role (TF_CONFIG's `cluster`)."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in ROLES]
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        addresses = [f"127.0.0.1:{s.getsockname()[1]}" for s in sockets]
    return {"chief": addresses[:1], "ps": addresses[1:3], "worker": addresses[3:]}
