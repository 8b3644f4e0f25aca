"""shardflow: parameter-server training, input pipelines and a cluster-wide profiler for PyTorch."""

from __future__ import annotations

from typing import TYPE_CHECKING

from shardflow._lazy import lazy_getattr

if TYPE_CHECKING:
    from shardflow import optim
    from shardflow.ps.placement import Partitioner
    from shardflow.train.estimator import Estimator, train_and_evaluate
    from shardflow.train.hooks import Hook, StepInfo
    from shardflow.train.job import RoleFailedError
    from shardflow.train.specs import EarlyStopping, EvalSpec, InputContext, Preempted, TrainResult, TrainSpec
    from shardflow.train.strategy import ParameterServerStrategy

# Imported on first use, so that the command-line tool and `shardflow.data` start without torch's import cost.
_LAZY = {
    "optim": "shardflow.optim",
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
}

__all__ = [
    "EarlyStopping",
    "Estimator",
    "EvalSpec",
    "Hook",
    "InputContext",
    "ParameterServerStrategy",
    "Partitioner",
    "Preempted",
    "RoleFailedError",
    "StepInfo",
    "TrainResult",
    "TrainSpec",
    "optim",
    "train_and_evaluate",
]
__version__ = "0.1.0"


__getattr__ = lazy_getattr(__name__, _LAZY, submodules=("optim",))
