"""Helpers that run the real training jobs in tests/integration/jobs as separate processes."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from shardflow.cluster.zygote import role_of

JOBS = Path(__file__).parent / "jobs"


class JobRun:
    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path

    def __call__(
        self, job: str, timeout_s: float = 120, env: dict[str, str] | None = None, **config: Any
    ) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
        """Run `job` with `config` to its end; `env` adds environment variables."""
        config.setdefault("model_dir", str(self.tmp_path / "model"))
        config.setdefault("result", str(self.tmp_path / "result.json"))
        config_path = self.tmp_path / "config.json"
        config_path.write_text(json.dumps(config))
        proc = subprocess.Popen(
            [sys.executable, str(JOBS / job), str(config_path)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, **env} if env else None,
        )
        try:
            out, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_tree(proc.pid)
            out, _ = proc.communicate()
            pytest.fail(f"{job} did not finish in {timeout_s}s:\n{out}")
        finally:
            _kill_tree(proc.pid)
        done = subprocess.CompletedProcess(proc.args, proc.returncode, out, "")
        result_path = Path(config["result"])
        result = json.loads(result_path.read_text()) if result_path.exists() else {}
        return done, result


def kill_role_after(launcher: subprocess.Popen[str], steps_log: Path, role: str, count: int) -> None:
    """SIGKILL `role`'s process under `launcher` once the workers wrote `count` lines to `steps_log` (one a
    batch), within 90 s."""
    deadline = time.monotonic() + 90
    while not steps_log.exists() or len(steps_log.read_text().splitlines()) < count:
        assert time.monotonic() < deadline and launcher.poll() is None, launcher.communicate(timeout=5)[0]
        time.sleep(0.02)
    for child in psutil.Process(launcher.pid).children(recursive=True):
        if role_of(child) == role:
            child.kill()
            return
    pytest.fail(f"no {role} process under the launcher")


def finish_launcher(launcher: subprocess.Popen[str], timeout_s: float) -> str:
    """The launcher's output once it ended; the job killed, and the test failed, after `timeout_s`."""
    try:
        return launcher.communicate(timeout=timeout_s)[0]
    except subprocess.TimeoutExpired:
        _kill_tree(launcher.pid)
        pytest.fail(f"the job did not end within {timeout_s}s:\n{launcher.communicate()[0]}")
    finally:
        _kill_tree(launcher.pid)


def _kill_tree(pid: int) -> None:
    try:
        parent = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return
    for child in parent.children(recursive=True):
        child.kill()
    parent.kill()


@pytest.fixture
def run_job(tmp_path: Path) -> JobRun:
    return JobRun(tmp_path)


class BackgroundJob:
    """A job started without waiting, so a test can act on its role processes while it runs."""

    def __init__(self, tmp_path: Path, job: str, env: dict[str, str] | None = None, **config: Any) -> None:
        config.setdefault("model_dir", str(tmp_path / "model"))
        config.setdefault("result", str(tmp_path / "result.json"))
        config_path = tmp_path / "config.json"
        config_path.write_text(json.dumps(config))
        self.proc = subprocess.Popen(
            [sys.executable, str(JOBS / job), str(config_path)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.seen: set[int] = {self.proc.pid}

    def roles(self) -> dict[str, psutil.Process]:
        """Role name -> process, for every role process under the job."""
        found = {}
        for child in psutil.Process(self.proc.pid).children(recursive=True):
            try:
                name = role_of(child)
            except psutil.Error:
                continue
            self.seen.add(child.pid)
            if name is not None:
                found[name] = child
        return found

    def wait_for_file(self, path: Path, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while not path.exists():
            if time.monotonic() > deadline or self.proc.poll() is not None:
                pytest.fail(f"{path} never appeared:\n{self.finish(5)[1]}")
            time.sleep(0.1)

    def finish(self, timeout_s: float) -> tuple[int, str]:
        try:
            out, _ = self.proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_tree(self.proc.pid)
            out, _ = self.proc.communicate()
            pytest.fail(f"the job did not exit within {timeout_s}s:\n{out}")
        return self.proc.returncode, out

    def leftovers(self) -> list[int]:
        return [
            pid for pid in self.seen if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        ]

    def close(self) -> None:
        _kill_tree(self.proc.pid)
        for pid in self.leftovers():
            psutil.Process(pid).kill()


@pytest.fixture
def start_job(tmp_path: Path):
    jobs: list[BackgroundJob] = []

    def start(job: str, env: dict[str, str] | None = None, **config: Any) -> BackgroundJob:
        jobs.append(BackgroundJob(tmp_path, job, env, **config))
        return jobs[-1]

    yield start
    for job in jobs:
        job.close()


class TFConfigJob:
    """A job started the way a cluster manager starts one: a process per role, each with its own TF_CONFIG on
    127.0.0.1, and the test as the supervisor that may start a role again."""

    def __init__(self, job: str, config: Path, env: dict[str, str], num_ps: int = 2, num_workers: int = 2) -> None:
        with contextlib.ExitStack() as stack:
            sockets = [stack.enter_context(socket.socket()) for _ in range(1 + num_ps + num_workers)]
            for s in sockets:
                s.bind(("127.0.0.1", 0))
            ports = [s.getsockname()[1] for s in sockets]
        addresses = [f"127.0.0.1:{port}" for port in ports]
        self.cluster = {"chief": addresses[:1], "ps": addresses[1 : 1 + num_ps], "worker": addresses[1 + num_ps :]}
        self.command = [sys.executable, str(JOBS / job), str(config)]
        self.env = env
        tasks = [("chief", 0), *(("ps", k) for k in range(num_ps)), *(("worker", k) for k in range(num_workers))]
        self.procs: dict[tuple[str, int], subprocess.Popen[str]] = {}
        for task in tasks:
            self.start(*task)

    def start(self, task_type: str, index: int) -> subprocess.Popen[str]:
        """Start (or start again) one role's process."""
        tf_config = {"cluster": self.cluster, "task": {"type": task_type, "index": index}}
        env = {**self.env, "TF_CONFIG": json.dumps(tf_config)}
        process = subprocess.Popen(self.command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.procs[task_type, index] = process
        return process

    def finish(self, timeout_s: float = 150) -> dict[tuple[str, int], str]:
        """Every role's output once all exited; kills what is left on the way out."""
        try:
            return {task: process.communicate(timeout=timeout_s)[0] for task, process in self.procs.items()}
        finally:
            self.kill()

    def kill(self) -> None:
        for process in self.procs.values():
            process.kill()

    def describe(self, outputs: dict[tuple[str, int], str]) -> str:
        """Each role's exit code and the end of its output, for a failed assertion."""
        parts = (f"--- {task} exited {self.procs[task].returncode}:\n{out[-3000:]}" for task, out in outputs.items())
        return "\n".join(parts)
