"""One process, one role: what this process is in the cluster, and the PS and evaluator entry points."""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from shardflow.cluster.rendezvous import ControlPlane, ControlPlaneError
from shardflow.cluster.spec import DYNAMIC, ClusterSpec, TaskSpec
from shardflow.comm.server import Server
from shardflow.ps.server import ParameterServer
from shardflow.train.profiling import RoleProfiler

if TYPE_CHECKING:
    from shardflow.train.estimator import Estimator


@dataclass
class RoleContext:
    """This process's task in the cluster and its connection to the chief's control plane."""

    spec: ClusterSpec
    task: TaskSpec
    control: ControlPlane

    @property
    def num_workers(self) -> int:
        return self.spec.num("worker")

    @property
    def num_ps(self) -> int:
        return self.spec.num("ps")


def _bind_address(address: str) -> str:
    if address == DYNAMIC:
        return "tcp://0.0.0.0:0"
    return f"tcp://{address}"


def _connect_address(bound: str) -> str:
    # A PS bound to every interface publishes an address the other machines can reach.
    if "://0.0.0.0:" in bound:
        return bound.replace("0.0.0.0", socket.gethostbyname(socket.gethostname()))
    return bound


def run_ps(role: RoleContext) -> None:
    torch.set_num_threads(1)
    server = Server(_bind_address(role.spec.address(role.task)))
    try:
        role.control.set(f"ps/{role.task.index}/address", _connect_address(server.address))
        ps = ParameterServer(server, role.task.index)
        profiler = RoleProfiler(role.task.name, role.control)

        def periodic(step: int) -> None:
            profiler.check_requests()
            profiler.at_step(step)

        def job_over() -> bool:
            try:
                return role.control.is_set("shutdown")
            except RuntimeError as error:
                raise ControlPlaneError(
                    f"{role.task.name} lost the chief's control plane at {role.control.address}: {error}"
                ) from error

        ps.serve(should_stop=job_over, periodic=periodic)
        profiler.finish()
    finally:
        server.close()


def run_evaluator(est: Estimator, role: RoleContext) -> None:
    """Until evaluation follows checkpoints (side-car mode), the evaluator waits for the job's end."""
    role.control.get("shutdown", waiting_for="the chief to finish the job", timeout_s=7 * 24 * 3600)
