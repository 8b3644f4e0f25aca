"""A real job across three hosts: network namespaces joined by veth pairs, chief and ps:0 on host a, worker:0 on b,
worker:1 on c, each role started by hand with TF_CONFIG as a cluster manager would, at its host's own address. Off
loopback every connection is CURVE-encrypted and authenticated with the cluster secret.

The job is tests/integration/jobs/audit.py, whose final parameters count how many times each record's gradient was
applied."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO, Any

import psutil
import pytest
import torch
from safetensors.torch import load_file

from shardflow.comm.security import Credentials

from .netns import Network, network, unavailable

pytestmark = pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))

AUDIT_JOB = Path(__file__).parents[1] / "integration" / "jobs" / "audit.py"
STRANGER = Path(__file__).parent / "stranger.py"
SECRET = "the multihost tests' cluster secret"
NUM_RECORDS, BATCH = 1024, 8
HOST_OF = {"chief": "a", "ps:0": "a", "worker:0": "b", "worker:1": "c"}
PORT_OF = {"chief": 7000, "ps:0": 7001, "worker:0": 7002, "worker:1": 7003}


class ThreeHostJob:
    """The audit job's four roles, each a process in its host's namespace with its output in a log of its own."""

    def __init__(self, net: Network, tmp_path: Path, config: dict[str, Any]) -> None:
        self.net = net
        self.tmp_path = tmp_path
        self.model_dir = tmp_path / "model"
        self.result_path = tmp_path / "result.json"
        self.address = {role: f"{net[host].address}:{PORT_OF[role]}" for role, host in HOST_OF.items()}
        config = {"model_dir": str(self.model_dir), "result": str(self.result_path), "num_ps": 1, **config}
        self.config_path = tmp_path / "config.json"
        self.config_path.write_text(json.dumps(config))
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        """The job's roles by name."""
        self._started: list[subprocess.Popen[bytes]] = []
        self._logs: list[IO[bytes]] = []

    def cluster(self) -> dict[str, list[str]]:
        return {
            "chief": [self.address["chief"]],
            "ps": [self.address["ps:0"]],
            "worker": [self.address["worker:0"], self.address["worker:1"]],
        }

    def start(self, roles: Iterable[str] = HOST_OF) -> None:
        for role in roles:
            task_type, _, index = role.partition(":")
            tf_config = {"cluster": self.cluster(), "task": {"type": task_type, "index": int(index or 0)}}
            env = {"TF_CONFIG": json.dumps(tf_config), "SHARDFLOW_CLUSTER_SECRET": SECRET}
            self.procs[role] = self.run_on(HOST_OF[role], role, [str(AUDIT_JOB), str(self.config_path)], env)

    def run_on(self, host: str, name: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        """`python argv` on `host`, with `env` and none of this process's SHARDFLOW_ variables or TF_CONFIG."""
        inherited = {k: v for k, v in os.environ.items() if not k.startswith(("SHARDFLOW_", "TF_CONFIG"))}
        log = open(self.log_path(name), "wb")  # noqa: SIM115  (closed in close())
        self._logs.append(log)
        command = self.net[host].command([sys.executable, *argv])
        env = {**inherited, "PYTHONUNBUFFERED": "1", **env}
        self._started.append(subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT))
        return self._started[-1]

    def log_path(self, name: str) -> Path:
        return self.tmp_path / f"{name.replace(':', '-')}.log"

    def log(self, name: str) -> str:
        return self.log_path(name).read_text(errors="replace")

    def logs(self) -> str:
        return "\n".join(f"----- {role} -----\n{self.log(role)[-3000:]}" for role in self.procs)

    def wait_for_training(self) -> None:
        """Until the chief lets the workers start (it writes job.json just before)."""
        self.wait_for(lambda: (self.model_dir / "job.json").exists(), "the chief to write job.json", 60)

    def wait_for_log(self, name: str, pattern: str, timeout_s: float) -> re.Match[str]:
        found: list[re.Match[str]] = []

        def seen() -> bool:
            match = re.search(pattern, self.log(name))
            found.extend([match] if match else [])
            return match is not None

        self.wait_for(seen, f"{pattern!r} in the log of {name}", timeout_s)
        return found[0]

    def wait_for(self, condition: Any, what: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not condition():
            # A worker done with its shard may exit; a role that failed, or the chief, means the wait is over.
            codes = {role: p.poll() for role, p in self.procs.items()}
            ended = {
                role: code for role, code in codes.items() if code not in (None, 0) or (role, code) == ("chief", 0)
            }
            if time.monotonic() > deadline or ended:
                pytest.fail(f"waited {timeout_s}s for {what}; ended meanwhile: {ended}\n{self.logs()}")
            time.sleep(0.05)

    def finish(self, timeout_s: float) -> dict[str, int]:
        """Every role's exit status; fails naming the roles still running after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                running = [r for r, p in self.procs.items() if p.poll() is None]
                pytest.fail(f"{', '.join(running)} still running after {timeout_s}s\n{self.logs()}")
        return {role: proc.returncode for role, proc in self.procs.items()}

    def close(self) -> None:
        for proc in self._started:
            _kill_tree(proc.pid)
            proc.wait()
        for log in self._logs:
            log.close()


def _kill_tree(pid: int) -> None:
    try:
        parent = psutil.Process(pid)
        processes = [*parent.children(recursive=True), parent]
    except psutil.NoSuchProcess:
        return
    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()


@pytest.fixture
def hosts() -> Iterator[Network]:
    with network(["a", "b", "c", "d"]) as net:
        yield net


@pytest.fixture
def three_host_job(hosts: Network, tmp_path: Path) -> Iterator[Any]:
    """Makes the job; kills every process it started before the namespaces go."""
    jobs: list[ThreeHostJob] = []

    def make(**config: Any) -> ThreeHostJob:
        jobs.append(ThreeHostJob(hosts, tmp_path, config))
        return jobs[-1]

    try:
        yield make
    finally:
        for job in jobs:
            job.close()


def _assert_exact(job: ThreeHostJob, codes: dict[str, int]) -> None:
    """Every role exited 0, the global step is exact, every record's gradient was applied exactly once and every
    parameter is finite."""
    assert codes == dict.fromkeys(HOST_OF, 0), job.logs()
    result = json.loads(job.result_path.read_text())
    assert result["global_step"] == NUM_RECORDS // BATCH, result
    assert sum(result["worker_steps"].values()) == NUM_RECORDS // BATCH, result
    params = load_file(str(Path(result["checkpoint"]) / "model.safetensors"))
    assert all(bool(torch.isfinite(p).all()) for p in params.values()), params
    applied = params["seen"]
    counts = torch.bincount(applied.round().long().clamp(0, 3), minlength=4).tolist()
    assert torch.equal(applied, torch.ones_like(applied)), f"records applied 0, 1, 2, 3+ times: {counts}"


def test_a_job_across_three_hosts_refuses_a_stranger_without_the_secret_and_ends_at_its_exact_step(
    three_host_job, hosts, tmp_path
):
    """One job for two behaviours, as a job costs seconds: a stranger's tries (push, pull, stop, a control key) all
    land in the middle of training, and the job still ends exact, ps:0 serving CURVE-encrypted at its own address."""
    # Slow steps, at least 64 x 0.15s of training per worker: the stranger's tries take about 4s (mostly waits for
    # answers that never come), so about 5s are left over even on a loaded machine.
    job = three_host_job(step_delay_s=0.15)
    stranger_config = tmp_path / "stranger.json"
    stranger_config.write_text(
        json.dumps(
            {
                "chief": job.address["chief"],
                "ps": job.address["ps:0"],
                # Public keys are public: the stranger gets the servers', so only the secret it lacks keeps it out.
                "server_key": Credentials(SECRET).server_keys()[0].decode(),
                "numel": NUM_RECORDS + 4 + 1,  # the audit model's `seen`, head.weight and head.bias
            }
        )
    )
    outcomes_path = tmp_path / "stranger-outcomes.json"
    argv = [str(STRANGER), str(stranger_config), str(job.model_dir / "job.json"), str(outcomes_path)]
    # Without the secret, its own client would refuse to connect off loopback: it opts out, as an attacker would.
    stranger = job.run_on("d", "stranger", argv, {"SHARDFLOW_INSECURE": "1"})
    job.start(role for role in HOST_OF if role != "chief")
    # The chief (who starts training) starts once the stranger has imported, so however slow that import is on a
    # loaded machine, the stranger's tries begin when training does.
    job.wait_for(
        lambda: stranger.poll() is not None or "the stranger waits" in job.log("stranger"),
        "the stranger to import and wait for the job",
        60,
    )
    assert stranger.poll() is None, job.log("stranger")
    job.start(["chief"])
    try:
        stranger.wait(timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the stranger did not finish its tries within 60s\n{job.log('stranger')}\n{job.logs()}")
    assert stranger.returncode == 0, job.log("stranger")
    outcomes = json.loads(outcomes_path.read_text())
    still_training = {role: p.poll() is None for role, p in job.procs.items()}
    codes = job.finish(timeout_s=90)
    assert outcomes["ps reachable"] == outcomes["chief reachable"] == "yes", outcomes
    tries = {key: outcome for key, outcome in outcomes.items() if "reachable" not in key}
    assert set(tries) == {"push", "pull", "stop", "control key, unauthenticated", "control key, a guessed secret"}
    assert all(outcome.startswith("refused") for outcome in tries.values()), json.dumps(outcomes, indent=1)
    assert all(still_training.values()), f"the job ended before the stranger was done: {still_training}"
    # The PS logged the refusal once, naming the stranger's host, and no request of it.
    refusals = [line for line in job.log("ps:0").splitlines() if hosts["d"].address in line]
    assert len(refusals) == 1 and "refused" in refusals[0], job.log("ps:0")
    _assert_exact(job, codes)
    # ps:0 serves at host a's own address, not loopback: so its traffic is CURVE-encrypted.
    assert re.search(
        rf"ps:0 serving at tcp://{re.escape(job.address['ps:0'])} \([^)]*CURVE-encrypted\)", job.log("ps:0")
    ), job.logs()


def test_a_worker_cut_off_longer_than_the_heartbeat_deadline_is_named_lost_then_rejoins_and_the_job_ends_exact(
    three_host_job, hosts
):
    heartbeat_timeout_s, cut_s = 2.0, 4.0
    job = three_host_job(heartbeat_timeout_s=heartbeat_timeout_s, step_delay_s=0.05, worker_rejoin_timeout_s=60)
    job.start()
    job.wait_for_training()
    time.sleep(0.5)  # of about 3s of training
    hosts.unplug("c")
    cut_at = time.monotonic()
    try:
        lost = job.wait_for_log("chief", r"worker:1 is lost: no heartbeat for ([\d.]+)s", heartbeat_timeout_s + 10)
        named_after_s = time.monotonic() - cut_at
        time.sleep(max(0.0, cut_at + cut_s - time.monotonic()))
    finally:
        hosts.plug("c")
    codes = job.finish(timeout_s=90)
    # Silent for the deadline (beats come every second, so at most a beat's interval more, and the chief looks
    # every 50 ms), named well before the cable came back.
    assert heartbeat_timeout_s <= float(lost[1]) < heartbeat_timeout_s + 2, lost[0]
    assert named_after_s < cut_s, (named_after_s, lost[0])
    assert "worker:1 rejoined" in job.log("chief"), job.logs()
    _assert_exact(job, codes)
