"""Where an sf.AllReduceStrategy worker computes (AllReduceStrategy.device): the setting checked where the strategy
is built, resolved in the worker's process, a machine's workers spread over its GPUs, HybridStrategy kept on the CPU.
The GPU path itself (pinned host buffers for gloo) runs where a GPU is: tests/integration/test_allreduce_strategy.py."""

from __future__ import annotations

import pytest
import torch

import shardflow as sf
from shardflow.cluster.spec import ClusterSpec, TaskSpec
from shardflow.train.allreduce_state import capture
from shardflow.train.allreduce_worker import local_worker_index

CPU = torch.device("cpu")


@pytest.mark.parametrize("device", [None, "cpu", CPU])
def test_the_cpu_or_the_default_on_a_machine_without_a_gpu_is_the_cpu_for_any_local_worker(device):
    if device is None and torch.cuda.is_available():
        pytest.skip("the default is the GPU where there is one")
    assert sf.AllReduceStrategy(device=device).worker_device(3) == CPU


@pytest.mark.parametrize("device", ["gpu", "cuda:x", 0])
def test_a_device_other_than_cpu_or_cuda_is_refused_naming_the_key(device):
    with pytest.raises(ValueError, match=r"AllReduceStrategy\.device must be 'cpu', 'cuda', 'cuda:N'"):
        sf.AllReduceStrategy(device=device)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without a GPU refuses it")
def test_cuda_on_a_machine_without_a_gpu_is_refused_in_the_worker_naming_the_key():
    strategy = sf.AllReduceStrategy(device="cuda")  # the chief's machine may have no GPU: accepted there
    with pytest.raises(ValueError, match=r"AllReduceStrategy\.device='cuda', but this process sees no CUDA device"):
        strategy.worker_device()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_machines_workers_take_its_gpus_in_turn():
    count = torch.cuda.device_count()
    strategy = sf.AllReduceStrategy(device="cuda")
    assert [strategy.worker_device(i).index for i in range(2 * count)] == list(range(count)) * 2
    assert sf.AllReduceStrategy(device="cuda:0").worker_device(1) == torch.device("cuda:0")


def test_hybrid_workers_compute_on_the_cpu_and_refuse_a_gpu_naming_the_key():
    assert sf.HybridStrategy().worker_device(0) == CPU
    with pytest.raises(ValueError, match=r"HybridStrategy\.device='cuda': the hybrid workers compute on the CPU"):
        sf.HybridStrategy(device="cuda")


SPEC = ClusterSpec(
    {"chief": ("10.0.0.1:2000",), "worker": ("10.0.0.1:2001", "10.0.0.1:2002", "10.0.0.2:2001", "10.0.0.1:2003")}
)


def test_a_workers_place_on_its_machine_counts_the_workers_before_it_at_its_host(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert [local_worker_index(SPEC, TaskSpec("worker", i)) for i in range(4)] == [0, 1, 0, 2]


def test_torchruns_local_rank_names_the_place_on_the_machine(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "5")
    assert local_worker_index(SPEC, TaskSpec("worker", 1)) == 5


def test_a_captured_state_is_a_host_copy_that_training_on_does_not_change():
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    state = capture(model, optimizer, 1)
    before = {name: tensor.clone() for name, tensor in state.params.items()}
    optimizer.step()
    assert all(tensor.device == CPU for tensor in state.params.values())
    assert all(torch.equal(state.params[name], before[name]) for name in before)
    assert set(state.slots) == {"exp_avg", "exp_avg_sq"} and state.scalars == {"step": 1.0}
