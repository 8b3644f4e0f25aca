"""One process, one role: what this process is in the cluster, and its connection to the chief's control plane."""

from __future__ import annotations

from dataclasses import dataclass

from shardflow.cluster.control_plane import ControlPlane
from shardflow.cluster.spec import ClusterSpec, TaskSpec
from shardflow.train.job_keys import ProgressReport


@dataclass
class RoleContext:
    """This process's task in the cluster and its connection to the chief's control plane."""

    spec: ClusterSpec
    task: TaskSpec
    control: ControlPlane
    last_report: ProgressReport | None = None
    """A worker's last progress report: sent again to a restarted chief, whose control service starts empty."""

    @property
    def num_workers(self) -> int:
        return self.spec.num("worker")

    @property
    def num_ps(self) -> int:
        return self.spec.num("ps")
