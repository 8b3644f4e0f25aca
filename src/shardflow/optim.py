"""`sf.optim.*`: optimizers that run on the parameter servers through `torch.optim`."""

from shardflow.ps.optimizers import SGD, Adagrad, Adam, AdamW, OptimizerSpec, RMSprop
from shardflow.ps.schedules import ScheduleSpec

__all__ = ["SGD", "Adagrad", "Adam", "AdamW", "OptimizerSpec", "RMSprop", "ScheduleSpec"]
