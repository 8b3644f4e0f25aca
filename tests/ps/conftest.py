"""Real ParameterServers on loopback sockets, each serving in its own thread, for the PS tests: every test that uses
them runs twice, with the workers' gradients and parameters over the socket and through shared-memory lanes."""

from __future__ import annotations

import shutil
import tempfile
import threading
from collections.abc import Callable, Iterator

import pytest
import torch

from shardflow.comm.client import Client
from shardflow.comm.server import Server
from shardflow.ps.admin import PSAdmin
from shardflow.ps.client import ParameterClient
from shardflow.ps.placement import Placement
from shardflow.ps.protocol import Shutdown
from shardflow.ps.server import ParameterServer


class Cluster:
    """`num_ps` servers, each serving in its own thread; with `lanes`, also on a UNIX socket, where the clients made
    after the servers were initialised reach them, and offer them shared-memory lanes."""

    def __init__(self, num_ps: int, lanes: bool = False) -> None:
        self.lanes = lanes
        self.runtime_dir = tempfile.mkdtemp(prefix="sf-ps-") if lanes else None
        self.servers = [
            Server("tcp://127.0.0.1:0", local=f"ipc://{self.runtime_dir}/ps-{k}" if lanes else None)
            for k in range(num_ps)
        ]
        self.ps = [ParameterServer(s, k) for k, s in enumerate(self.servers)]
        self.threads = [threading.Thread(target=ps.serve, daemon=True) for ps in self.ps]
        for t in self.threads:
            t.start()

    @property
    def addresses(self) -> list[str]:
        return [s.local_address or s.address for s in self.servers]

    def client(
        self, model: torch.nn.Module, placement: Placement, worker_index: int = 0, wire_dtype: str | None = None
    ) -> ParameterClient:
        client = ParameterClient(
            Client(f"worker:{worker_index}"),
            list(self.addresses),
            placement,
            model,
            timeout_s=5,
            worker_index=worker_index,
            wire_dtype=wire_dtype,
        )
        if self.lanes and all(ps.limits is not None for ps in self.ps):  # a PS maps a lane once initialised
            client.attach_lanes()
        return client

    def admin(self, model: torch.nn.Module, placement: Placement) -> PSAdmin:
        """A client of the chief's requests to every PS."""
        return PSAdmin(Client("chief"), list(self.addresses), placement, model, timeout_s=5)

    def close(self) -> None:
        chief = Client("chief")
        for k, address in enumerate(self.addresses):
            chief.connect(f"ps:{k}", address)
            chief.request(f"ps:{k}", Shutdown().header(), timeout_s=5)
        chief.close()
        for t in self.threads:
            t.join(timeout=5)
        for s in self.servers:
            s.close()
        if self.runtime_dir is not None:
            shutil.rmtree(self.runtime_dir, ignore_errors=True)


@pytest.fixture(params=["socket", "lanes"])
def start_cluster(request: pytest.FixtureRequest) -> Iterator[Callable[[int], Cluster]]:
    """Starts clusters of the given number of PS, shut down after the test."""
    clusters: list[Cluster] = []

    def start(num_ps: int) -> Cluster:
        clusters.append(Cluster(num_ps, lanes=request.param == "lanes"))
        return clusters[-1]

    yield start
    for c in clusters:
        c.close()


@pytest.fixture
def cluster(start_cluster: Callable[[int], Cluster]) -> Cluster:
    return start_cluster(3)


@pytest.fixture
def start_lane_cluster() -> Iterator[Callable[[int], Cluster]]:
    """Starts clusters of the given number of PS that map their workers' lanes, shut down after the test."""
    clusters: list[Cluster] = []

    def start(num_ps: int) -> Cluster:
        clusters.append(Cluster(num_ps, lanes=True))
        return clusters[-1]

    yield start
    for c in clusters:
        c.close()
