"""Cluster layer: who is in the job (ClusterSpec, from TF_CONFIG or torchrun) and local launch."""

from shardflow.cluster.launcher import LocalLauncher, RoleExit, run_local
from shardflow.cluster.spec import (
    DYNAMIC,
    ROLES,
    ClusterSpec,
    ClusterSpecError,
    TaskSpec,
    cluster_from_env,
)

__all__ = [
    "DYNAMIC",
    "ROLES",
    "ClusterSpec",
    "ClusterSpecError",
    "LocalLauncher",
    "RoleExit",
    "TaskSpec",
    "cluster_from_env",
    "run_local",
]
