"""shardflow: parameter-server training, input pipelines and a cluster-wide profiler for PyTorch."""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

from shardflow import env
from shardflow._lazy import lazy_dir, lazy_getattr

if TYPE_CHECKING:
    import socket
    import subprocess
    from collections.abc import Mapping

    from shardflow import metrics, nn, optim
    from shardflow.cluster.zygote_fork import ForkedZygote
    from shardflow.ps.placement import Partitioner
    from shardflow.train.estimator import Estimator, train_and_evaluate
    from shardflow.train.hooks import Hook, StepInfo
    from shardflow.train.job import RoleFailedError
    from shardflow.train.specs import EarlyStopping, EvalSpec, InputContext, Preempted, TrainResult, TrainSpec
    from shardflow.train.strategy import AllReduceStrategy, HybridStrategy, ParameterServerStrategy

# Imported on first use, so that the command-line tool and `shardflow.data` start without torch's import cost.
_LAZY = {
    "optim": "shardflow.optim",
    "nn": "shardflow.nn",
    "metrics": "shardflow.metrics",
    "Estimator": "shardflow.train.estimator",
    "RoleFailedError": "shardflow.train.job",
    "train_and_evaluate": "shardflow.train.estimator",
    "EarlyStopping": "shardflow.train.specs",
    "EvalSpec": "shardflow.train.specs",
    "Hook": "shardflow.train.hooks",
    "StepInfo": "shardflow.train.hooks",
    "Partitioner": "shardflow.ps.placement",
    "InputContext": "shardflow.train.specs",
    "Preempted": "shardflow.train.specs",
    "TrainResult": "shardflow.train.specs",
    "TrainSpec": "shardflow.train.specs",
    "ParameterServerStrategy": "shardflow.train.strategy",
    "AllReduceStrategy": "shardflow.train.strategy",
    "HybridStrategy": "shardflow.train.strategy",
}

__all__ = [
    "AllReduceStrategy",
    "EarlyStopping",
    "Estimator",
    "EvalSpec",
    "Hook",
    "HybridStrategy",
    "InputContext",
    "ParameterServerStrategy",
    "Partitioner",
    "Preempted",
    "RoleFailedError",
    "StepInfo",
    "TrainResult",
    "TrainSpec",
    "metrics",
    "nn",
    "optim",
    "train_and_evaluate",
]
__version__ = "0.1.0"


__getattr__ = lazy_getattr(__name__, _LAZY, submodules=("optim", "nn", "metrics"))
__dir__ = lazy_dir(__name__, _LAZY)


# A local cluster's roles are forked from a zygote, a process that imports torch and shardflow once for all of them
# (cluster/zygote.py). Its process is started here, where starting it costs no import: shardflow.cluster imports
# torch.

# `python -c` puts the working directory first on sys.path: the zygote imports nothing from there; each role puts its
# script's directory there, as `python script.py` does.
_ZYGOTE_ENTRY = "import sys; del sys.path[0]; from shardflow.cluster.zygote_process import main; main()"
_CLUSTER_VARIABLES = (env.CLUSTER, "TF_CONFIG", "JOBSET_NAME", "SLURM_HET_SIZE", "WORLD_SIZE")
"""Any of them set: this process is a role of a cluster (cluster_from_env), and starts no cluster of its own."""

_early_zygote: tuple[int, subprocess.Popen[bytes] | ForkedZygote, socket.socket, dict[str, str]] | None = None
"""The process that started a zygote on import (a fork of it must not adopt it), the zygote, its end of the
conversation and its environment; until a launcher adopts it (zygote.Zygote.start)."""


def _start_zygote_process(environment: Mapping[str, str]) -> tuple[subprocess.Popen[bytes], socket.socket]:
    """A zygote process with `environment`, and the launcher's end of the conversation with it. It dies with the
    thread that calls this (the parent-death signal)."""
    import socket
    import subprocess

    ours, theirs = socket.socketpair()
    try:
        process = subprocess.Popen(
            [sys.executable, "-c", _ZYGOTE_ENTRY, str(theirs.fileno()), str(os.getpid())],
            env=dict(environment),
            pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            start_new_session=True,
        )
    except BaseException:
        ours.close()
        raise
    finally:
        theirs.close()
    return process, ours


def _start_zygote_early(importer: str) -> None:
    """Starts the zygote now, on another core while this process imports torch and the rest, when the script that
    runs (`importer` imported shardflow) will start a local cluster: `__main__` is a script run as
    `python script.py` or `python -m module`, it makes an Estimator, nothing in the environment names a cluster,
    and SHARDFLOW_ZYGOTE is not off. The launcher adopts it; a script that never starts its cluster leaves it idle
    until the script exits."""
    global _early_zygote
    argv = sys.orig_argv
    if (
        importer != "__main__"
        or not sys.platform.startswith("linux")
        or env.get(env.ZYGOTE) == "off"
        or any(os.environ.get(name, "").strip() for name in _CLUSTER_VARIABLES)
        or len(argv) < 2
        or (argv[1].startswith("-") and argv[1] != "-m")
    ):
        return
    import threading

    if threading.current_thread() is not threading.main_thread():
        return  # the zygote would die with this thread
    script = getattr(sys.modules.get("__main__"), "__file__", None)
    try:
        with open(str(script), encoding="utf-8") as source:
            if script is None or "Estimator" not in source.read():
                return
    except (OSError, ValueError):  # no such file, or not text
        return
    environment = {**os.environ, "PYTHONUNBUFFERED": "1"}  # as a launcher starts it: print() is not held back
    from shardflow.cluster.zygote_fork import fork_zygote

    # With torch imported here already, a fork has it imported too (cluster/zygote_fork.py); else a fresh process.
    forked = fork_zygote(environment)
    try:
        process, ours = forked if forked is not None else _start_zygote_process(environment)
    except OSError:
        return  # the launcher starts one, and says why if it cannot
    _early_zygote = (os.getpid(), process, ours, environment)


def _importer() -> str | None:
    """The name of the module whose import statement is importing shardflow now."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(("<frozen importlib", __file__)):
        frame = frame.f_back  # type: ignore[assignment]
    return None if frame is None else str(frame.f_globals.get("__name__"))


_start_zygote_early(_importer() or "")
