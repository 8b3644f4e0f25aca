"""This process's cluster from the cluster manager that started it: a Kubernetes JobSet (also run by Kubeflow
Trainer v2) or a Slurm heterogeneous job. Kubeflow's TFJob needs nothing here: its operator sets TF_CONFIG."""

from __future__ import annotations

import itertools
import re
from collections.abc import Mapping

from shardflow import env
from shardflow.cluster.spec import ClusterSpec, ClusterSpecError, TaskSpec

DEFAULT_PORT = 2222
"""TF's customary port, as TFJob uses."""

MANAGED_ROLES = ("chief", "ps", "worker")
"""The replicated jobs of deploy/jobset.yaml, named after the roles they run, and what the heterogeneous-job
components 0, 1 and 2 of deploy/slurm.sbatch run."""

_JOBSET_VARS = ("REPLICATED_JOB_NAME", "JOB_INDEX")
_COUNT_VARS = {"ps": env.NUM_PS, "worker": env.NUM_WORKERS}
_SLURM_VARS = ("SLURM_JOB_ID", "SLURM_PROCID")


def from_cluster_manager(environ: Mapping[str, str]) -> tuple[ClusterSpec, TaskSpec] | None:
    """The cluster and task a JobSet pod or a Slurm heterogeneous-job task sees; None outside both."""
    if environ.get("JOBSET_NAME", "").strip():
        return from_jobset(environ)
    if environ.get("SLURM_HET_SIZE", "").strip():
        return from_slurm_hetjob(environ)
    return None


def from_jobset(environ: Mapping[str, str]) -> tuple[ClusterSpec, TaskSpec]:
    """Every role at its pod's stable DNS name, `<jobset>-<role>-<job index>-0.<jobset>:<port>`: one pod per Job,
    so that JobSet's RestartJob restarts one process. The pod names itself through the JobSet annotations the
    manifest hands it (JOBSET_NAME, REPLICATED_JOB_NAME, JOB_INDEX) and learns the other roles' counts from
    SHARDFLOW_NUM_PS and SHARDFLOW_NUM_WORKERS."""
    _require(environ, _JOBSET_VARS, "JobSet", "map them from the pod's jobset.sigs.k8s.io annotations")
    name, role = environ["JOBSET_NAME"].strip(), environ["REPLICATED_JOB_NAME"].strip()
    if role not in MANAGED_ROLES:
        raise ClusterSpecError(
            f"JobSet: replicated job {role!r} is not a role; name the replicated jobs {', '.join(MANAGED_ROLES)}"
        )
    if _int(environ, "JOB_COMPLETION_INDEX", default=0) != 0:
        raise ClusterSpecError(
            "JobSet: JOB_COMPLETION_INDEX is not 0: run one pod per Job (parallelism: 1, completions: 1) and one "
            "Job per process (replicas: the count)"
        )
    counts = {"chief": 1, "ps": _int(environ, env.NUM_PS), "worker": _int(environ, env.NUM_WORKERS)}
    replicas = _int(environ, "REPLICATED_JOB_REPLICAS", default=counts[role])
    if replicas != counts[role]:
        fix = "give it replicas: 1" if role == "chief" else f"keep {_COUNT_VARS[role]} equal to its replicas"
        raise ClusterSpecError(
            f"JobSet: replicated job {role!r} has {replicas} replicas but the job has {counts[role]} {role}; {fix}"
        )
    port = _int(environ, env.PORT, default=DEFAULT_PORT)
    spec = ClusterSpec(
        {
            each: tuple(f"{name}-{each}-{index}-0.{name}:{port}" for index in range(count))
            for each, count in counts.items()
        }
    )
    return spec, _task(spec, role, _int(environ, "JOB_INDEX"), "JobSet")


def from_slurm_hetjob(environ: Mapping[str, str]) -> tuple[ClusterSpec, TaskSpec]:
    """Component k of the heterogeneous job runs role MANAGED_ROLES[k], one task per node, on port SHARDFLOW_PORT + k
    (components may share a node). Each component is started by its own `srun --het-group=k`, so SLURM_JOB_ID
    names the component and SLURM_PROCID is the task's index within it."""
    size = _int(environ, "SLURM_HET_SIZE")
    if size != len(MANAGED_ROLES):
        raise ClusterSpecError(
            f"Slurm: SLURM_HET_SIZE={size}, but a shardflow heterogeneous job has {len(MANAGED_ROLES)} components: "
            f"{', '.join(MANAGED_ROLES)} (see deploy/slurm.sbatch)"
        )
    _require(environ, _SLURM_VARS, "Slurm", "start the training script with srun inside the job")
    nodes = [expand_nodelist(_slurm_value(environ, f"SLURM_JOB_NODELIST_HET_GROUP_{k}")) for k in range(size)]
    component = _component(environ, size)
    role = MANAGED_ROLES[component]
    num_tasks = _int(environ, "SLURM_STEP_NUM_TASKS", default=len(nodes[component]))
    if num_tasks != len(nodes[component]):
        raise ClusterSpecError(
            f"Slurm: the step has {num_tasks} tasks but component {component} ({role}) has "
            f"{len(nodes[component])} node(s): start each component with its own `srun --het-group={component} "
            "--ntasks-per-node=1`"
        )
    port = _int(environ, env.PORT, default=DEFAULT_PORT)
    spec = ClusterSpec({each: tuple(f"{node}:{port + k}" for node in nodes[k]) for k, each in enumerate(MANAGED_ROLES)})
    return spec, _task(spec, role, _int(environ, "SLURM_PROCID"), "Slurm")


def expand_nodelist(nodelist: str) -> list[str]:
    """Slurm's compact host list, as `scontrol show hostnames` expands it: "node[01-03,07],gpu5" ->
    node01, node02, node03, node07, gpu5. Zero padding is kept; several bracketed ranges in one name expand to
    every combination."""
    hosts: list[str] = []
    for name in _split_top_level(nodelist):
        parts = re.split(r"(\[[^\[\]]*\])", name)
        if not name or any("[" in part or "]" in part for part in parts[::2]):
            raise ClusterSpecError(f"Slurm: cannot read the node list {nodelist!r} (at {name!r})")
        choices = [
            [part] if index % 2 == 0 else _expand_range(part[1:-1], nodelist) for index, part in enumerate(parts)
        ]
        hosts.extend("".join(combination) for combination in itertools.product(*choices))
    return hosts


def _split_top_level(nodelist: str) -> list[str]:
    """The comma-separated names of a node list, leaving the commas inside brackets alone."""
    names, depth, start = [], 0, 0
    for index, char in enumerate(nodelist):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            names.append(nodelist[start:index].strip())
            start = index + 1
    names.append(nodelist[start:].strip())
    return names


def _expand_range(ranges: str, nodelist: str) -> list[str]:
    numbers: list[str] = []
    for item in ranges.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:-(\d+))?\s*", item)
        if match is None or (match[2] is not None and int(match[2]) < int(match[1])):
            raise ClusterSpecError(f"Slurm: cannot read the range [{ranges}] in the node list {nodelist!r}")
        first, last = match[1], match[2] or match[1]
        numbers.extend(str(number).zfill(len(first)) for number in range(int(first), int(last) + 1))
    return numbers


def _component(environ: Mapping[str, str], size: int) -> int:
    """The component whose job ID is this step's: an srun of one het group gets that component's SLURM_JOB_ID."""
    job_id = environ["SLURM_JOB_ID"].strip()
    for component in range(size):
        if _slurm_value(environ, f"SLURM_JOB_ID_HET_GROUP_{component}") == job_id:
            return component
    raise ClusterSpecError(
        f"Slurm: SLURM_JOB_ID={job_id} is none of the components' SLURM_JOB_ID_HET_GROUP_0..{size - 1}: "
        "run the training script with srun inside the heterogeneous job's batch script"
    )


def _task(spec: ClusterSpec, role: str, index: int, manager: str) -> TaskSpec:
    task = TaskSpec(role, index)
    try:
        spec.validate_task(task)
    except ClusterSpecError as error:
        raise ClusterSpecError(f"{manager}: {error}") from None
    return task


def _require(environ: Mapping[str, str], names: tuple[str, ...], manager: str, fix: str) -> None:
    missing = [name for name in names if not environ.get(name, "").strip()]
    if missing:
        raise ClusterSpecError(f"{manager}: the environment lacks {', '.join(missing)}; {fix}")


def _slurm_value(environ: Mapping[str, str], name: str) -> str:
    value = environ.get(name, "").strip()
    if not value:
        raise ClusterSpecError(
            f"Slurm: the environment lacks {name}, which sbatch sets in a heterogeneous job; submit the job with "
            "sbatch (see deploy/slurm.sbatch)"
        )
    return value


def _int(environ: Mapping[str, str], name: str, default: int | None = None) -> int:
    value = environ.get(name, "").strip()
    if not value and default is not None:
        return default
    if not value:
        raise ClusterSpecError(f"the environment lacks {name}; set it in the manifest (see deploy/)")
    try:
        number = int(value)
    except ValueError:
        raise ClusterSpecError(f"{name}={value!r} is not an integer") from None
    if number < 0:
        raise ClusterSpecError(f"{name}={number} must not be negative")
    return number
