"""shardflow: parameter-server training, input pipelines and a cluster-wide profiler for PyTorch."""

from shardflow import optim
from shardflow.train.estimator import Estimator, RoleFailedError, train_and_evaluate
from shardflow.train.specs import EvalSpec, InputContext, TrainResult, TrainSpec
from shardflow.train.strategy import ParameterServerStrategy

__all__ = [
    "EvalSpec",
    "Estimator",
    "InputContext",
    "ParameterServerStrategy",
    "RoleFailedError",
    "TrainResult",
    "TrainSpec",
    "optim",
    "train_and_evaluate",
]
__version__ = "0.1.0"
