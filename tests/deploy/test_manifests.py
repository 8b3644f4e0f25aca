"""deploy/: every manifest parsed, the cluster each pod or task would see built from the environment its cluster
manager gives it, and the JobSet and the Slurm job run for real as local processes with those environments.

What the managers add is emulated from their code: the JobSet controller's pod annotations and names
(pkg/controllers/jobset_controller.go) and the Job controller's JOB_COMPLETION_INDEX; the TFJob operator's
TF_CONFIG (pkg/controller.v1/tensorflow/tensorflow.go); Slurm's step variables (tests/deploy/fake_srun.py). The
host names the managers give do not resolve here: each process runs in a mount namespace whose /etc/hosts maps
every name to a loopback address of its own (127.0.0.10, .11, ...), and listens on that address
(SHARDFLOW_BIND_ADDRESS), since here every "pod" shares one network namespace. Nothing else differs from what the
manifests give, except the training script: the integration tests' regression job instead of train.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml

from shardflow.cluster.spec import ClusterSpec, TaskSpec, cluster_from_env
from shardflow.train.strategy import ParameterServerStrategy

from .fake_srun import on_host, task_environment

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
REGRESSION_JOB = ROOT / "tests" / "integration" / "jobs" / "regression.py"
SECRET = "manifests-test-secret-0123456789abcdef"
"""What the Kubernetes Secret shardflow-cluster-secret holds in this test; every process gets it."""
NUM_BATCHES = 20
JOBSET_RULE_NAME = r"[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?"
"""What JobSet's webhook accepts as a failure-policy rule's name (pkg/webhooks/jobset_webhook.go)."""
JOB_DEADLINE_S = 150
_KEPT_ENV = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "PYTHONPATH", "VIRTUAL_ENV")


@dataclass(frozen=True)
class Pod:
    """One process as its manager starts it: the environment it gets and the address peers know it by."""

    name: str
    env: Mapping[str, str]
    command: Sequence[str]
    host: str
    port: int

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


def _load(name: str) -> list[dict[str, Any]]:
    return list(yaml.safe_load_all((DEPLOY / name).read_text()))


def _resolve_env(entries: Sequence[Mapping[str, Any]], annotations: Mapping[str, str]) -> dict[str, str]:
    """A container's env as the kubelet fills it: values, downward-API annotations and the test's Secret."""
    resolved = {}
    for entry in entries:
        source = entry.get("valueFrom")
        if source is None:
            resolved[entry["name"]] = str(entry["value"])
        elif "fieldRef" in source:
            match = re.fullmatch(r"metadata\.annotations\['([^']+)'\]", source["fieldRef"]["fieldPath"])
            assert match, f"{entry['name']}: only pod annotations are emulated, not {source}"
            resolved[entry["name"]] = annotations[match[1]]
        else:
            assert source["secretKeyRef"] == {"name": "shardflow-cluster-secret", "key": "secret"}, source
            resolved[entry["name"]] = SECRET
    return resolved


def _port(container: Mapping[str, Any], name: str) -> int:
    (port,) = [port["containerPort"] for port in container["ports"] if port["name"] == name]
    return int(port)


def _jobset_pods(spec: Mapping[str, Any], jobset_name: str) -> list[Pod]:
    """The pods the JobSet controller makes of `spec`: Job <jobset>-<rjob>-<index>, annotated with who it is; an
    Indexed Job's pod <job>-<completion index> with JOB_COMPLETION_INDEX, reachable as <pod>.<subdomain>."""
    subdomain = spec["network"].get("subdomain", jobset_name)
    pods = []
    for replicated_job in spec["replicatedJobs"]:
        job = replicated_job["template"]["spec"]
        assert job["completionMode"] == "Indexed", "stable pod host names need Indexed Jobs"
        (container,) = job["template"]["spec"]["containers"]
        for job_index in range(replicated_job["replicas"]):
            annotations = {
                "jobset.sigs.k8s.io/jobset-name": jobset_name,
                "jobset.sigs.k8s.io/replicatedjob-name": replicated_job["name"],
                "jobset.sigs.k8s.io/job-index": str(job_index),
                "jobset.sigs.k8s.io/replicatedjob-replicas": str(replicated_job["replicas"]),
            }
            for completion_index in range(job["parallelism"]):
                name = f"{jobset_name}-{replicated_job['name']}-{job_index}-{completion_index}"
                env = {"JOB_COMPLETION_INDEX": str(completion_index), **_resolve_env(container["env"], annotations)}
                port = _port(container, "shardflow")
                pods.append(Pod(name, env, container["command"], f"{name}.{subdomain}", port))
    return pods


def _tfjob_pods(tfjob: Mapping[str, Any], namespace: str = "default") -> list[Pod]:
    """The pods the training operator makes of a TFJob, each with the TF_CONFIG it builds: every replica as
    <tfjob>-<type>-<index>.<namespace>.svc:<the tensorflow container's tfjob-port>."""
    name = tfjob["metadata"]["name"]
    replica_specs = tfjob["spec"]["tfReplicaSpecs"]
    containers, cluster = {}, {}
    for replica_type, replica_spec in replica_specs.items():
        (container,) = [c for c in replica_spec["template"]["spec"]["containers"] if c["name"] == "tensorflow"]
        containers[replica_type] = container
        port = _port(container, "tfjob-port")
        role = replica_type.lower()
        cluster[role] = [f"{name}-{role}-{i}.{namespace}.svc:{port}" for i in range(replica_spec["replicas"])]
    pods = []
    for replica_type, container in containers.items():
        role = replica_type.lower()
        for index, address in enumerate(cluster[role]):
            tf_config = {"cluster": cluster, "task": {"type": role, "index": index}, "environment": "cloud"}
            env = {**_resolve_env(container.get("env", []), {}), "TF_CONFIG": json.dumps(tf_config)}
            host, _, port_text = address.rpartition(":")
            pods.append(Pod(f"{name}-{role}-{index}", env, container["command"], host, int(port_text)))
    return pods


def _check_cluster(pods: Sequence[Pod], counts: Mapping[str, int]) -> ClusterSpec:
    """Every pod finds one and the same cluster, in which it is a task of its own, at the address it is known by."""
    specs, tasks = set(), {}
    for pod in pods:
        found = cluster_from_env(pod.env)
        assert found is not None, f"{pod.name} found no cluster in its environment"
        spec, task = found
        assert spec.address(task) == pod.address, (pod.name, task)
        specs.add(spec)
        tasks[task] = pod.name
    assert len(specs) == 1, f"the pods disagree on the cluster: {specs}"
    (spec,) = specs
    assert {role: spec.num(role) for role in counts} == dict(counts)
    assert sorted(tasks, key=str) == sorted(spec.tasks(), key=str), "every task is one pod"
    return spec


# -- Dockerfile -------------------------------------------------------------------------------------------------


def test_dockerfile_pins_the_machines_torch_and_runs_the_training_script_itself():
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    pinned = re.search(r"torch==(\S+)", (ROOT / "Makefile").read_text())
    assert pinned
    assert f"ARG TORCH_VERSION={pinned[1]}\n" in dockerfile
    assert "ARG BASE_IMAGE=" in dockerfile and "FROM ${BASE_IMAGE}" in dockerfile  # CPU by default, CUDA by arg
    assert re.search(r'ARG TORCH_INDEX_URL=""\n', dockerfile), "the index is given at build time, no host named"
    assert "://" not in dockerfile
    assert "ENTRYPOINT" not in dockerfile and "shardflow launch" not in dockerfile
    assert 'CMD ["python", "train.py"]' in dockerfile


# -- JobSet and Kubeflow Trainer v2 ---------------------------------------------------------------------------


def test_jobset_restarts_a_failed_ps_or_worker_alone_and_succeeds_with_the_chief():
    (jobset,) = _load("jobset.yaml")
    spec = jobset["spec"]
    assert jobset["apiVersion"] == "jobset.x-k8s.io/v1alpha2"
    assert spec["successPolicy"] == {"operator": "All", "targetReplicatedJobs": ["chief"]}
    assert spec["network"]["enableDNSHostnames"] is True
    names = [replicated_job["name"] for replicated_job in spec["replicatedJobs"]]
    assert names == ["chief", "ps", "worker"]
    rules = spec["failurePolicy"]["rules"]
    assert all(re.fullmatch(JOBSET_RULE_NAME, rule["name"]) for rule in rules), "JobSet's webhook refuses the name"
    # JobSet runs the first rule that matches a failed Job: any role's Job is recreated alone (a restarted chief
    # resumes from the live PS, a restarted PS makes every PS reload the latest checkpoint).
    first = {name: next(rule for rule in rules if name in rule.get("targetReplicatedJobs", names)) for name in names}
    assert {name: rule["action"] for name, rule in first.items()} == {
        "chief": "RestartJob",
        "ps": "RestartJob",
        "worker": "RestartJob",
    }
    for replicated_job in spec["replicatedJobs"]:
        job = replicated_job["template"]["spec"]
        # One process per Job, failing the Job at once: RestartJob then restarts exactly that process.
        assert (job["parallelism"], job["completions"], job["backoffLimit"]) == (1, 1, 0), replicated_job["name"]
        assert job["template"]["spec"]["restartPolicy"] == "Never"
    assert spec["replicatedJobs"][0]["replicas"] == 1


def _containers(name: str) -> dict[str, dict[str, Any]]:
    """Each role's container in deploy/<name>, by role."""
    (manifest,) = _load(name)
    if manifest["kind"] == "JobSet":
        return {
            job["name"]: job["template"]["spec"]["template"]["spec"]["containers"][0]
            for job in manifest["spec"]["replicatedJobs"]
        }
    replica_specs = manifest["spec"]["tfReplicaSpecs"]
    return {role.lower(): spec["template"]["spec"]["containers"][0] for role, spec in replica_specs.items()}


def _probe(container: Mapping[str, Any], liveness_file: Path) -> int:
    """The exit status of the container's liveness probe, run as the kubelet runs it: in the container's env."""
    probe = container["livenessProbe"]
    environ = {**_base_env(), "SHARDFLOW_LIVENESS_FILE": str(liveness_file)}
    return subprocess.run(probe["exec"]["command"], env=environ, timeout=10, check=False).returncode


@pytest.mark.parametrize("manifest", ["jobset.yaml", "tfjob.yaml"])
def test_a_hung_ps_or_worker_fails_its_liveness_probe_and_is_restarted(manifest, tmp_path):
    containers = _containers(manifest)
    assert "livenessProbe" not in containers["chief"]  # the chief is what every role hangs on; its restart is manual
    for role in ("ps", "worker"):
        container = containers[role]
        env = {entry["name"]: entry.get("value") for entry in container["env"]}
        assert env["SHARDFLOW_LIVENESS_FILE"] == "/tmp/shardflow-alive", role
        probe = container["livenessProbe"]
        # A stopped process ignores the SIGTERM that comes first: SIGKILL follows within seconds.
        assert probe["terminationGracePeriodSeconds"] <= 5 and probe["periodSeconds"] <= 10, probe
        alive = tmp_path / f"{role}.alive"
        assert _probe(container, alive) == 0, "a role still starting (no file yet) is alive"
        alive.touch()
        assert _probe(container, alive) == 0, "a role that beat just now is alive"
        os.utime(alive, (time.time() - 31, time.time() - 31))  # silent past hung_timeout_s (30 s)
        assert _probe(container, alive) != 0, "a role silent for 31 s is hung"
    # The JobSet's failure policy restarts a failed ps or worker Job; the TFJob's ExitCode policy a pod killed by
    # a signal (137).
    assert ParameterServerStrategy().hung_timeout_s == 30


def test_jobset_pods_find_one_cluster_at_their_stable_dns_names():
    (jobset,) = _load("jobset.yaml")
    pods = _jobset_pods(jobset["spec"], jobset["metadata"]["name"])
    spec = _check_cluster(pods, {"chief": 1, "ps": 2, "worker": 2})
    assert spec.roles["ps"] == ("shardflow-ps-0-0.shardflow:2222", "shardflow-ps-1-0.shardflow:2222")
    assert all(pod.env["SHARDFLOW_CLUSTER_SECRET"] == SECRET for pod in pods)


def test_jobset_roles_train_together_as_local_processes(tmp_path):
    (jobset,) = _load("jobset.yaml")
    pods = _jobset_pods(jobset["spec"], jobset["metadata"]["name"])
    result = _run_pods(pods, tmp_path)
    assert result["global_step"] == NUM_BATCHES
    assert result["worker_steps"] == {"worker:0": NUM_BATCHES // 2, "worker:1": NUM_BATCHES // 2}
    # Each role kept its liveness file fresh: the PS and workers for their probe (the chief's beat has no probe in
    # these manifests; a launcher watches it).
    beating = sorted(path.name for path in tmp_path.glob("*.alive"))
    assert beating == sorted(f"{pod.name}.alive" for pod in pods), beating


def test_training_runtime_ships_the_jobset_and_its_trainjob_names_the_pods():
    (jobset,) = _load("jobset.yaml")
    runtime, trainjob = _load("trainingruntime.yaml")
    assert (runtime["apiVersion"], runtime["kind"]) == ("trainer.kubeflow.org/v1alpha1", "TrainingRuntime")
    assert runtime["spec"]["template"]["spec"] == jobset["spec"]
    assert trainjob["kind"] == "TrainJob"
    assert trainjob["spec"]["runtimeRef"] == {
        "name": runtime["metadata"]["name"],
        "apiGroup": "trainer.kubeflow.org",
        "kind": "TrainingRuntime",
    }
    # Trainer v2 names the JobSet after the TrainJob.
    pods = _jobset_pods(runtime["spec"]["template"]["spec"], trainjob["metadata"]["name"])
    spec = _check_cluster(pods, {"chief": 1, "ps": 2, "worker": 2})
    name = trainjob["metadata"]["name"]
    assert spec.address(TaskSpec("chief", 0)) == f"{name}-chief-0-0.{name}:2222"


# -- TFJob ----------------------------------------------------------------------------------------------------


def test_tfjob_pods_read_the_tf_config_the_operator_gives_them():
    (tfjob,) = _load("tfjob.yaml")
    assert (tfjob["apiVersion"], tfjob["kind"]) == ("kubeflow.org/v1", "TFJob")
    replica_specs = tfjob["spec"]["tfReplicaSpecs"]
    assert replica_specs["Chief"]["replicas"] == 1
    assert "successPolicy" not in tfjob["spec"]  # the default: the TFJob succeeds when its chief does
    assert tfjob["spec"]["runPolicy"]["cleanPodPolicy"] == "Running"
    assert {replica_spec["restartPolicy"] for replica_spec in replica_specs.values()} == {"ExitCode"}
    pods = _tfjob_pods(tfjob)
    spec = _check_cluster(pods, {"chief": 1, "ps": 2, "worker": 2})
    assert spec.address(TaskSpec("worker", 1)) == "shardflow-worker-1.default.svc:2222"
    assert all(pod.env["SHARDFLOW_CLUSTER_SECRET"] == SECRET for pod in pods)


# -- Slurm ----------------------------------------------------------------------------------------------------


def _sbatch_components() -> list[dict[str, str]]:
    """The #SBATCH options of each heterogeneous-job component, in order."""
    components: list[dict[str, str]] = [{}]
    for line in (DEPLOY / "slurm.sbatch").read_text().splitlines():
        if not line.startswith("#SBATCH"):
            continue
        (option,) = line.removeprefix("#SBATCH").split()
        if option == "hetjob":
            components.append({})
        else:
            name, _, value = option.removeprefix("--").partition("=")
            components[-1][name] = value
    return components


class SlurmAllocation:
    """What sbatch gives the batch script of the heterogeneous job: one job ID and node list per component."""

    def __init__(self, components: Sequence[Mapping[str, str]], first_job_id: int = 4100) -> None:
        self.layout: list[tuple[int, list[str]]] = []
        self.batch = {"SLURM_HET_SIZE": str(len(components)), "SLURM_JOB_ID": str(first_job_id)}
        number = 1
        for component, options in enumerate(components):
            count = int(options["nodes"])
            nodes = [f"node{n:02d}" for n in range(number, number + count)]
            compact = nodes[0] if count == 1 else f"node[{number:02d}-{number + count - 1:02d}]"
            number += count
            self.layout.append((first_job_id + component, nodes))
            self.batch[f"SLURM_JOB_ID_HET_GROUP_{component}"] = str(first_job_id + component)
            self.batch[f"SLURM_JOB_NODELIST_HET_GROUP_{component}"] = compact
            self.batch[f"SLURM_JOB_NUM_NODES_HET_GROUP_{component}"] = str(count)

    def tasks(self, batch: Mapping[str, str], port: int) -> list[Pod]:
        return [
            Pod(node, task_environment(dict(batch), component, job_id, nodes, index), (), node, port + component)
            for component, (job_id, nodes) in enumerate(self.layout)
            for index, node in enumerate(nodes)
        ]


def test_slurm_hetjob_components_run_chief_ps_and_workers_one_task_per_node():
    components = _sbatch_components()
    assert len(components) == 3
    assert [options["ntasks-per-node"] for options in components] == ["1", "1", "1"]
    assert [options["nodes"] for options in components] == ["1", "2", "2"]
    script = (DEPLOY / "slurm.sbatch").read_text()
    sruns = [shlex.split(line) for line in script.splitlines() if line.startswith("srun ")]
    assert sorted(next(arg for arg in srun if arg.startswith("--het-group=")) for srun in sruns) == [
        "--het-group=0",
        "--het-group=1",
        "--het-group=2",
    ], "each component by its own srun"
    allocation = SlurmAllocation(components)
    batch = {**allocation.batch, "SHARDFLOW_PORT": "2222", "SHARDFLOW_CLUSTER_SECRET": SECRET}
    spec = _check_cluster(allocation.tasks(batch, 2222), {"chief": 1, "ps": 2, "worker": 2})
    assert spec.roles == {
        "chief": ("node01:2222",),
        "ps": ("node02:2223", "node03:2223"),
        "worker": ("node04:2224", "node05:2224"),
    }


def test_slurm_hetjob_roles_train_together_as_local_processes(tmp_path):
    allocation = SlurmAllocation(_sbatch_components())
    hosts = _hosts_file(tmp_path, [node for _, nodes in allocation.layout for node in nodes])
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    srun = bin_dir / "srun"
    fake_srun = Path(__file__).parent / "fake_srun.py"
    srun.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} {shlex.quote(str(fake_srun))} "$@"\n')
    srun.chmod(0o755)
    environ = {
        **_base_env(),
        **allocation.batch,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "PYTHON": sys.executable,
        "SHARDFLOW_CLUSTER_SECRET": SECRET,
        "FAKE_SLURM_LAYOUT": json.dumps(allocation.layout),
        "FAKE_SLURM_HOSTS": str(hosts),
    }
    config = _job_config(tmp_path)
    log = tmp_path / "sbatch.log"
    with open(log, "w") as out:
        batch = subprocess.Popen(
            ["bash", str(DEPLOY / "slurm.sbatch"), str(REGRESSION_JOB), str(config)],
            env=environ,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        status = batch.wait(timeout=JOB_DEADLINE_S)
    except subprocess.TimeoutExpired:
        status = None
    finally:
        # The batch script, the fake srun and every task share the script's process group.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(batch.pid, signal.SIGKILL)
        batch.wait()
    assert status == 0, f"the batch script (waited {JOB_DEADLINE_S}s for it) ended with {status}:\n{log.read_text()}"
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["global_step"] == NUM_BATCHES
    assert result["worker_steps"] == {"worker:0": NUM_BATCHES // 2, "worker:1": NUM_BATCHES // 2}


# -- running the roles ----------------------------------------------------------------------------------------


def _base_env() -> dict[str, str]:
    """What a container has besides its manifest's env: a PATH and the like, nothing of this test's cluster."""
    return {name: os.environ[name] for name in _KEPT_ENV if name in os.environ}


def _job_config(tmp_path: Path) -> Path:
    config = tmp_path / "config.json"
    config.write_text(
        json.dumps(
            {
                "mode": "async",
                "num_ps": 2,
                "num_workers": 2,
                "epochs": 1,
                "num_batches": NUM_BATCHES,
                "model_dir": str(tmp_path / "model"),
                "result": str(tmp_path / "result.json"),
            }
        )
    )
    return config


def _hosts_file(tmp_path: Path, names: Sequence[str]) -> Path:
    """An /etc/hosts that puts each name on a loopback address of its own."""
    hosts = tmp_path / "hosts"
    lines = ["127.0.0.1 localhost", *(f"127.0.0.{10 + i} {name}" for i, name in enumerate(names))]
    hosts.write_text("\n".join(lines) + "\n")
    return hosts


def _run_pods(pods: Sequence[Pod], tmp_path: Path) -> dict[str, Any]:
    """Start every pod's process as its container would (python <script>, with the pod's env) on the address its
    name maps to; wait for all; the chief's result."""
    hosts = _hosts_file(tmp_path, [pod.host for pod in pods])
    addresses = {pod.host: f"127.0.0.{10 + i}" for i, pod in enumerate(pods)}
    config = _job_config(tmp_path)
    processes: dict[str, subprocess.Popen[bytes]] = {}
    logs = {pod.name: tmp_path / f"{pod.name}.log" for pod in pods}
    try:
        for pod in pods:
            assert list(pod.command) == ["python", "train.py"], pod.command
            environ = {**_base_env(), **pod.env, "SHARDFLOW_BIND_ADDRESS": addresses[pod.host]}
            if "SHARDFLOW_LIVENESS_FILE" in environ:  # each container has a /tmp of its own
                environ["SHARDFLOW_LIVENESS_FILE"] = str(tmp_path / f"{pod.name}.alive")
            with open(logs[pod.name], "w") as out:
                argv = on_host([sys.executable, str(REGRESSION_JOB), str(config)], str(hosts))
                processes[pod.name] = subprocess.Popen(argv, env=environ, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + JOB_DEADLINE_S
        while any(process.poll() is None for process in processes.values()) and time.monotonic() < deadline:
            time.sleep(0.2)
        statuses = {name: process.poll() for name, process in processes.items()}
    finally:
        for process in processes.values():
            _kill_tree(process.pid)
    output = "\n".join(f"--- {name} (exit {statuses.get(name)}):\n{logs[name].read_text()}" for name in logs)
    running = [name for name, status in statuses.items() if status is None]
    assert not running, f"waited {JOB_DEADLINE_S}s for {', '.join(running)} to exit:\n{output}"
    assert set(statuses.values()) == {0}, output
    return json.loads((tmp_path / "result.json").read_text())


def _kill_tree(pid: int) -> None:
    try:
        process = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return
    for child in process.children(recursive=True):
        child.kill()
    process.kill()
