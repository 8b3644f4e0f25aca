"""Cluster layer: who is in the job (ClusterSpec, from TF_CONFIG or torchrun) and local launch."""

from __future__ import annotations

from typing import TYPE_CHECKING

from shardflow._lazy import lazy_dir, lazy_getattr

if TYPE_CHECKING:
    from shardflow.cluster.launcher import LocalLauncher, RoleExit
    from shardflow.cluster.local_job import run_local
    from shardflow.cluster.spec import DYNAMIC, ROLES, ClusterSpec, ClusterSpecError, TaskSpec, cluster_from_env

# Imported on first use: the launcher brings torch and ZeroMQ, which `shardflow --help` and a module of this package
# that needs neither (liveness, control_keys) should not wait for.
_LAZY = {
    **dict.fromkeys(("LocalLauncher", "RoleExit"), "shardflow.cluster.launcher"),
    "run_local": "shardflow.cluster.local_job",
    **dict.fromkeys(("DYNAMIC", "ROLES", "ClusterSpec", "ClusterSpecError", "TaskSpec"), "shardflow.cluster.spec"),
    "cluster_from_env": "shardflow.cluster.spec",
}

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

__getattr__ = lazy_getattr(__name__, _LAZY)
__dir__ = lazy_dir(__name__, _LAZY)
