"""Every `SHARDFLOW_*` environment variable: its name, what it means, and the one function that reads it.

Set by users:

- `SHARDFLOW_CLUSTER`: the cluster as TF_CONFIG-style JSON; `shardflow launch` sets it for every role.
- `SHARDFLOW_NUM_PS`: how many PS a torchrun job has, when the program does not say, or a JobSet job has.
- `SHARDFLOW_NUM_WORKERS`: how many workers a JobSet job has (a pod reads every role's count from these two).
- `SHARDFLOW_PORT`: the port roles listen on in a JobSet (every pod) or a Slurm heterogeneous job (the chief; each
  PS on the next port, each worker on the one after); default 2222.
- `SHARDFLOW_CLUSTER_SECRET`: the secret every process of a job shares; every server of the job (the chief's
  control service, each PS) accepts only its holders. The local launcher makes one per job by itself.
- `SHARDFLOW_CLUSTER_SECRET_FILE`: a file holding that secret (a Kubernetes Secret mounted as a file).
- `SHARDFLOW_ENCRYPT`: `always` encrypts a local cluster's private UNIX sockets too (TCP always is).
- `SHARDFLOW_INSECURE`: `1`, with no secret given, turns authentication and encryption off on every address
  (logged loudly), so that a role may serve off loopback without a secret. Off by default.
- `SHARDFLOW_BIND_ADDRESS`: the interface a role listens on when its address in the cluster spec is not
  loopback (default: every interface); it still advertises the address from the spec.
- `SHARDFLOW_MAX_FRAME_MB`: the largest message part a server accepts (ZMQ_MAXMSGSIZE; default 1024).
- `SHARDFLOW_RECORDER`: `on` (the default), `off`, or `alternate:N` (record in every other block of N global
  steps, so one run measures what the always-on recorder costs).
- `SHARDFLOW_ZYGOTE`: `on` (the default) forks a local cluster's Python roles from one process that imported torch
  and shardflow once; `off` starts each role as a fresh Python.
- `SHARDFLOW_LOCAL_SOCKETS`: `on` (the default) has a local cluster's roles reach each PS over a UNIX socket; `off`
  over loopback TCP, as roles on other machines would (to watch the traffic with a packet capture, or compare).
- `SHARDFLOW_LIVENESS_FILE`: a file every role touches every second, for its supervisor to find it hung
  (cluster/liveness.py): deploy/'s manifests set it for their liveness probe, the local launcher for its own watch.
- `SHARDFLOW_SHARED_MEMORY`: `on` (the default) has a worker move its gradients and parameters to and from each PS
  it reaches over a UNIX socket through shared memory (ps/lanes.py); `off` through the socket.
- `SHARDFLOW_PS_THREADS`: the intra-op torch threads of each PS. Default: the cores the PS may use (its affinity
  mask, capped by its cgroup's CPU quota) divided among the PS and workers on its machine, at least 1
  (train/ps_role.py).

Set by shardflow's own tools for the processes they start:

- `SHARDFLOW_LOCAL_THREADS`: torch threads per role of a local cluster, so the roles share the cores.
- `SHARDFLOW_WORKER_THREADS_UP_TO`: the cores per worker of a local cluster, where more than its share: a CPU worker
  times its steps with both and keeps the faster (train/thread_tuning.py).
- `SHARDFLOW_MODEL_DIR`: overrides `Estimator.model_dir` (`shardflow scale` gives each run its own).
- `SHARDFLOW_PROFILE_STEPS`: `first,last` overrides `Estimator.profile_steps`.
- `SHARDFLOW_RESULT_JSON`: where the chief writes what the run did, for the tool that started it.
- `SHARDFLOW_RUNTIME_DIR`: a local cluster's private directory (mode 0700) for its roles' UNIX sockets: a PS
  serves the roles of its own machine there as well as over TCP, at a fraction of loopback TCP's cost.

Set by fault-injection tests and `make faults` (see faults.py):

- `SHARDFLOW_FAULT`: JSON naming a role, a point in its work and a step where its process kills itself.
"""

from __future__ import annotations

import os

CLUSTER = "SHARDFLOW_CLUSTER"
NUM_PS = "SHARDFLOW_NUM_PS"
NUM_WORKERS = "SHARDFLOW_NUM_WORKERS"
PORT = "SHARDFLOW_PORT"
CLUSTER_SECRET = "SHARDFLOW_CLUSTER_SECRET"
CLUSTER_SECRET_FILE = "SHARDFLOW_CLUSTER_SECRET_FILE"
ENCRYPT = "SHARDFLOW_ENCRYPT"
INSECURE = "SHARDFLOW_INSECURE"
BIND_ADDRESS = "SHARDFLOW_BIND_ADDRESS"
MAX_FRAME_MB = "SHARDFLOW_MAX_FRAME_MB"
RECORDER = "SHARDFLOW_RECORDER"
LOCAL_THREADS = "SHARDFLOW_LOCAL_THREADS"
WORKER_THREADS_UP_TO = "SHARDFLOW_WORKER_THREADS_UP_TO"
MODEL_DIR = "SHARDFLOW_MODEL_DIR"
PROFILE_STEPS = "SHARDFLOW_PROFILE_STEPS"
RESULT_JSON = "SHARDFLOW_RESULT_JSON"
FAULT = "SHARDFLOW_FAULT"
ZYGOTE = "SHARDFLOW_ZYGOTE"
RUNTIME_DIR = "SHARDFLOW_RUNTIME_DIR"
LOCAL_SOCKETS = "SHARDFLOW_LOCAL_SOCKETS"
SHARED_MEMORY = "SHARDFLOW_SHARED_MEMORY"
LIVENESS_FILE = "SHARDFLOW_LIVENESS_FILE"
PS_THREADS = "SHARDFLOW_PS_THREADS"

ALL = (
    CLUSTER,
    NUM_PS,
    NUM_WORKERS,
    PORT,
    CLUSTER_SECRET,
    CLUSTER_SECRET_FILE,
    ENCRYPT,
    INSECURE,
    BIND_ADDRESS,
    MAX_FRAME_MB,
    RECORDER,
    LOCAL_THREADS,
    WORKER_THREADS_UP_TO,
    MODEL_DIR,
    PROFILE_STEPS,
    RESULT_JSON,
    FAULT,
    ZYGOTE,
    RUNTIME_DIR,
    LOCAL_SOCKETS,
    SHARED_MEMORY,
    LIVENESS_FILE,
    PS_THREADS,
)


def get(name: str) -> str | None:
    """The variable's value, or None when it is unset or blank."""
    if name not in ALL:
        raise KeyError(f"{name} is not a shardflow environment variable; they are {', '.join(ALL)}")
    value = os.environ.get(name, "").strip()
    return value or None


def get_int(name: str) -> int | None:
    """The variable as an integer, or None when unset; an error names the variable when it is not one."""
    value = get(name)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not an integer") from None


def profile_steps() -> tuple[int, int] | None:
    """`SHARDFLOW_PROFILE_STEPS` as (first, last), or None when unset."""
    value = get(PROFILE_STEPS)
    if value is None:
        return None
    first, comma, last = value.partition(",")
    try:
        if not comma:
            raise ValueError
        return int(first), int(last)
    except ValueError:
        raise ValueError(f"{PROFILE_STEPS}={value!r}: expected 'first,last', e.g. '10,15'") from None
