"""Where a worker computes (ParameterServerStrategy.device): the device is resolved in the worker's own process,
a batch moves to it, and on the CPU the path is the one without a device: no copy between the model and the wire.
This machine has no GPU, so the CUDA path (pinned host buffers on a side stream) is not run here."""

from __future__ import annotations

import importlib.util
from collections import namedtuple
from pathlib import Path

import numpy as np
import pytest
import torch

import shardflow as sf
from shardflow.comm.client import Client
from shardflow.data.torch_edge import to_torch
from shardflow.ps.client import ParameterClient, PushRequest
from shardflow.ps.optimizers import SGD
from shardflow.ps.placement import Partitioner, place
from shardflow.ps.staging import HostStaging
from shardflow.ps.update_rules import ApplyConfig
from shardflow.train.checkpoints import store
from shardflow.train.checkpoints.servers import init_servers
from shardflow.train.worker_step import batch_to_device

from ..integration.conftest import JobRun
from ..ps.conftest import Cluster

JOB = Path(__file__).parents[1] / "integration" / "jobs" / "embedding.py"
_spec = importlib.util.spec_from_file_location("embedding_job", JOB)
assert _spec is not None and _spec.loader is not None
embedding_job = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(embedding_job)

Pair = namedtuple("Pair", "ids weights")
CPU = torch.device("cpu")


def test_the_default_device_is_cuda_where_the_worker_sees_one_else_the_cpu():
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert sf.ParameterServerStrategy().worker_device() == torch.device(expected)


@pytest.mark.parametrize("device", ["cpu", torch.device("cpu")])
def test_the_cpu_given_as_a_string_or_a_torch_device_is_the_cpu(device):
    assert sf.ParameterServerStrategy(device=device).worker_device() == CPU


@pytest.mark.parametrize("device", ["gpu", "mps", "cuda:x", "", 0])
def test_a_device_other_than_cpu_or_cuda_is_refused_naming_the_key(device):
    with pytest.raises(ValueError, match=r"ParameterServerStrategy\.device must be 'cpu', 'cuda', 'cuda:N'"):
        sf.ParameterServerStrategy(device=device)


@pytest.mark.parametrize(
    "device", [f"cuda:{torch.cuda.device_count()}", *([] if torch.cuda.is_available() else ["cuda"])]
)
def test_a_gpu_the_worker_cannot_use_is_refused_naming_the_key(device):
    # Accepted where the strategy is built: the chief's and the PS's machines may have no GPU.
    strategy = sf.ParameterServerStrategy(device=device)
    with pytest.raises(ValueError, match=rf"ParameterServerStrategy\.device='{device}', but this process sees"):
        strategy.worker_device()


def _nested_batch() -> dict:
    return {
        "x": np.ones((2, 3), dtype=np.float32),
        "pairs": [Pair(torch.arange(2), torch.zeros(2))],
        "tags": (torch.ones(1), "name", 3),
        "words": np.array(["a", "b"]),
    }


def test_a_batch_moves_to_the_device_in_nested_dicts_tuples_and_lists():
    # The meta device stands in for a GPU: a tensor that moved there shows it, with no GPU at hand.
    moved = batch_to_device(to_torch(_nested_batch()), torch.device("meta"))
    assert moved["x"].is_meta and moved["x"].shape == (2, 3)
    assert isinstance(moved["pairs"], list) and isinstance(moved["pairs"][0], Pair)
    assert all(t.is_meta for t in moved["pairs"][0])
    tags, name, count = moved["tags"]
    assert tags.is_meta and (name, count) == ("name", 3)
    assert moved["words"].tolist() == ["a", "b"]


def test_on_the_cpu_a_batch_keeps_its_tensors_without_a_copy():
    batch = to_torch(_nested_batch())
    moved = batch_to_device(batch, CPU)
    assert moved["x"] is batch["x"] and moved["pairs"][0].ids is batch["pairs"][0].ids


def test_on_the_cpu_host_staging_hands_the_tensors_on_as_they_are():
    staging = HostStaging(CPU)
    tensors = [torch.ones(3), torch.arange(4)]
    to_host = staging.to_host(tensors)
    staging.wait_host()
    assert all(a is b for a, b in zip(to_host, tensors, strict=True))
    assert all(a is b for a, b in zip(staging.to_device(tensors), tensors, strict=True))


def _mlp() -> torch.nn.Module:
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def test_on_the_cpu_pulled_parameters_are_views_of_the_frames_and_a_push_applies():
    model = _mlp()
    placement = place(model.named_parameters(), 1, Partitioner())
    cluster = Cluster(1)
    try:
        init_servers(cluster.admin(model, placement), SGD(lr=0.5), ApplyConfig(num_workers=1))
        worker = cluster.client(_mlp(), placement)
        assert worker.staging.device == CPU
        worker.pull()
        # Every float32 parameter on ps:0 is a slice of its one received buffer: no copy was made.
        assert len({p.untyped_storage().data_ptr() for p in worker.model.parameters()}) == 1

        x = torch.randn(5, 4)
        worker.begin_push(0)
        worker.model(x).sum().backward()
        reply = worker.wait_push(worker.push(PushRequest()))
        model(x).sum().backward()
        assert reply.step == 1
        for param, expected in zip(worker.model.parameters(), model.parameters(), strict=True):
            assert expected.grad is not None
            torch.testing.assert_close(param.detach(), expected.detach() - 0.5 * expected.grad, rtol=0, atol=1e-6)
    finally:
        cluster.close()


def test_a_model_on_two_devices_is_refused():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1, device="meta"))
    client = Client("worker:0")
    try:
        with pytest.raises(ValueError, match="several devices"):
            ParameterClient(client, ["tcp://127.0.0.1:9"], place(model.named_parameters(), 1, Partitioner()), model)
    finally:
        client.close()


def test_a_job_on_device_cpu_trains_dense_and_row_sparse_variables_like_one_process(tmp_path):
    steps, batch = 4, 8
    proc, result = JobRun(tmp_path)(
        "embedding.py", device="cpu", mode="sync", num_workers=2, num_ps=2, num_batches=2 * steps, batch=batch
    )
    assert proc.returncode == 0, proc.stdout
    assert result["global_step"] == steps

    # One process, the same model and torch.optim.Adagrad (the job's default), on both workers' batches at once.
    model = embedding_job.one_process(steps, batch)
    latest = store.latest(tmp_path / "model")
    assert latest is not None
    trained = store.load_state(latest)[0].params
    for name, expected in model.state_dict().items():
        torch.testing.assert_close(trained[name], expected, atol=1e-5, rtol=0, msg=name)
