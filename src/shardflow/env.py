"""Every `SHARDFLOW_*` environment variable: its name, what it means, and the one function that reads it.

Set by users:

- `SHARDFLOW_CLUSTER`: the cluster as TF_CONFIG-style JSON; `shardflow launch` sets it for every role.
- `SHARDFLOW_NUM_PS`: how many PS a torchrun job has, when the program does not say.
- `SHARDFLOW_CLUSTER_SECRET`: a secret every process of a job shares; a PS then accepts only its holders.
- `SHARDFLOW_ENCRYPT`: `always` encrypts loopback traffic too (a machine shared with untrusted users).
- `SHARDFLOW_RECORDER`: `on` (the default), `off`, or `alternate:N` (record in every other block of N global
  steps, so one run measures what the always-on recorder costs).

Set by shardflow's own tools for the processes they start:

- `SHARDFLOW_LOCAL_THREADS`: torch threads per role of a local cluster, so the roles share the cores.
- `SHARDFLOW_MODEL_DIR`: overrides `Estimator.model_dir` (`shardflow scale` gives each run its own).
- `SHARDFLOW_PROFILE_STEPS`: `first,last` overrides `Estimator.profile_steps`.
- `SHARDFLOW_RESULT_JSON`: where the chief writes what the run did, for the tool that started it.

Set by fault-injection tests and `make faults` (see faults.py):

- `SHARDFLOW_FAULT`: JSON naming a role, a point in its work and a step where its process kills itself.
"""

from __future__ import annotations

import os

CLUSTER = "SHARDFLOW_CLUSTER"
NUM_PS = "SHARDFLOW_NUM_PS"
CLUSTER_SECRET = "SHARDFLOW_CLUSTER_SECRET"
ENCRYPT = "SHARDFLOW_ENCRYPT"
RECORDER = "SHARDFLOW_RECORDER"
LOCAL_THREADS = "SHARDFLOW_LOCAL_THREADS"
MODEL_DIR = "SHARDFLOW_MODEL_DIR"
PROFILE_STEPS = "SHARDFLOW_PROFILE_STEPS"
RESULT_JSON = "SHARDFLOW_RESULT_JSON"
FAULT = "SHARDFLOW_FAULT"

ALL = (
    CLUSTER,
    NUM_PS,
    CLUSTER_SECRET,
    ENCRYPT,
    RECORDER,
    LOCAL_THREADS,
    MODEL_DIR,
    PROFILE_STEPS,
    RESULT_JSON,
    FAULT,
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
