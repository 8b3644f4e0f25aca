"""Gradient clipping: in sync mode real PS clip the mean of the replicas' gradients exactly as one process's
torch.nn.utils.clip_grad_norm_ / clip_grad_value_ would, the global norm agreed across PS through the job's
key-value store; in async mode the worker clips its own gradient."""

from __future__ import annotations

import socket

import pytest
import torch

from shardflow.cluster.control_plane import ControlPlane
from shardflow.ps.client import PushRequest
from shardflow.ps.clipping import StoreNormExchange, clip_local_gradients
from shardflow.ps.optimizers import OptimizerSpec
from shardflow.ps.placement import place
from shardflow.ps.update_rules import ApplyConfig
from shardflow.train.checkpoints.servers import init_servers


def _model() -> torch.nn.Module:
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _batches(step: int, worker: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 * step + worker)
    return 3 * torch.randn(6, 4, generator=generator), torch.randn(6, 2, generator=generator)


def _loss(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return torch.nn.functional.mse_loss(model(batch[0]), batch[1])


@pytest.mark.parametrize(
    ("clipping", "clip_in_one_process"),
    [
        ({"clip_grad_norm": 0.2}, lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), 0.2)),
        ({"clip_grad_value": 0.05}, lambda m: torch.nn.utils.clip_grad_value_(m.parameters(), 0.05)),
    ],
    ids=["global-norm", "value"],
)
def test_sync_on_two_ps_equals_one_process_clipping_the_averaged_gradient(start_cluster, clipping, clip_in_one_process):
    cluster = start_cluster(2)
    chief_store = ControlPlane.serve(f"127.0.0.1:{_free_port()}", timeout_s=10)
    stores = [ControlPlane(chief_store.address, timeout_s=10) for _ in cluster.ps]
    for k, ps in enumerate(cluster.ps):
        ps.norm_exchange = StoreNormExchange(stores[k], k, 2, timeout_s=10)
    model = _model()
    placement = place(model.named_parameters(), 2)
    assert {piece.ps for piece in placement.pieces} == {0, 1}
    spec = OptimizerSpec("Adam", {"lr": 0.05}, **clipping)
    init_servers(cluster.client(model, placement), spec, ApplyConfig(mode="sync", num_workers=2))
    workers = [(m := _model(), cluster.client(m, placement, worker_index=i)) for i in range(2)]
    reference = _model()
    optimizer = torch.optim.Adam(reference.parameters(), lr=0.05)
    for step in range(4):
        pushed = []
        for i, (replica, client) in enumerate(workers):
            client.pull(step)
            replica.zero_grad()
            client.begin_push(step)
            _loss(replica, _batches(step, i)).backward()
            pushed.append(client.push(PushRequest()))
        for (_, client), push in zip(workers, pushed, strict=True):
            assert client.wait_push(push).step == step + 1
        optimizer.zero_grad()
        # The mean of the two replicas' losses: its gradient is the mean of theirs, which the PS apply.
        ((_loss(reference, _batches(step, 0)) + _loss(reference, _batches(step, 1))) / 2).backward()
        clip_in_one_process(reference)
        optimizer.step()
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(workers[0][0].state_dict()[name], value, rtol=0, atol=1e-5)


def test_the_ps_agree_the_norm_over_every_ps_in_ps_order():
    chief = ControlPlane.serve(f"127.0.0.1:{_free_port()}", timeout_s=10)
    first = StoreNormExchange(chief, 0, 2, timeout_s=10)
    second = StoreNormExchange(ControlPlane(chief.address), 1, 2, timeout_s=10)
    second.store.set(second._key(7, 1), repr(2.5))
    assert first(7, 1.25) == 3.75


def test_a_ps_waiting_for_a_norm_that_never_comes_names_the_step():
    chief = ControlPlane.serve(f"127.0.0.1:{_free_port()}", timeout_s=10)
    with pytest.raises(RuntimeError, match="gradient norms of global step 4"):
        StoreNormExchange(chief, 0, 2, timeout_s=0.2)(4, 1.0)


def test_async_worker_clip_equals_clip_grad_norm_including_sparse_embeddings():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(20, 4, sparse=True), torch.nn.Flatten(), torch.nn.Linear(8, 1))
    reference = torch.nn.Sequential(torch.nn.Embedding(20, 4), torch.nn.Flatten(), torch.nn.Linear(8, 1))
    reference.load_state_dict(model.state_dict())
    ids = torch.tensor([[1, 5], [5, 9]])
    (10 * model(ids)).sum().backward()
    (10 * reference(ids)).sum().backward()
    clip_local_gradients(model, 0.5)
    torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
    for (name, param), expected in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert param.grad is not None and expected.grad is not None, name
        torch.testing.assert_close(param.grad.to_dense(), expected.grad)
