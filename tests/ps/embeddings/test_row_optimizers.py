"""The row optimizers on a fixed table split over two PS equal torch's sparse path in one process:
nn.Embedding(sparse=True) with SGD, Adagrad or SparseAdam."""

from __future__ import annotations

import pytest
import torch

from shardflow.ps.embeddings.init import initial_rows
from shardflow.ps.embeddings.spec import RowOptimizer, TableSpec, owners
from shardflow.ps.embeddings.table import ShardTable

NUM_EMBEDDINGS, DIM = 40, 6

OPTIMIZERS = {
    "sgd": (RowOptimizer(name="sgd", lr=0.3), lambda params: torch.optim.SGD(params, lr=0.3)),
    "adagrad": (
        RowOptimizer(name="adagrad", lr=0.2, lr_decay=0.05, initial_accumulator_value=0.1),
        lambda params: torch.optim.Adagrad(params, lr=0.2, lr_decay=0.05, initial_accumulator_value=0.1),
    ),
    "lazy_adam": (
        RowOptimizer(name="lazy_adam", lr=0.05, eps=1e-8, beta1=0.8, beta2=0.99),
        lambda params: torch.optim.SparseAdam(params, lr=0.05, betas=(0.8, 0.99), eps=1e-8),
    ),
}


def _batches() -> list[torch.Tensor]:
    """Ids of several steps, with repeats; in the third, every id is below 20 (PS 1 of a range split gets none);
    in the fourth, every id is even (PS 1 of a mod split gets none)."""
    generator = torch.Generator().manual_seed(3)
    batches = [torch.randint(0, NUM_EMBEDDINGS, (25,), generator=generator) for _ in range(2)]
    batches.append(torch.tensor([3, 3, 3, 7, 19, 0, 7]))
    batches.append(torch.tensor([2, 2, 8, 30, 38, 38, 38]))
    batches += [torch.randint(0, NUM_EMBEDDINGS, (25,), generator=generator) for _ in range(3)]
    return batches


@pytest.mark.parametrize("partition", ["mod", "range"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_two_ps_equal_torch_sparse_embedding_in_one_process(name, partition):
    row_optimizer, torch_optimizer = OPTIMIZERS[name]
    spec = TableSpec(name="items", embedding_dim=DIM, num_embeddings=NUM_EMBEDDINGS, partition=partition)
    shards = [ShardTable(spec, row_optimizer, p, 2) for p in range(2)]
    ids_all = torch.arange(NUM_EMBEDDINGS)
    embedding = torch.nn.Embedding(NUM_EMBEDDINGS, DIM, sparse=True)
    embedding.weight.data.copy_(initial_rows(spec, ids_all))
    optimizer = torch_optimizer(embedding.parameters())
    generator = torch.Generator().manual_seed(5)
    for step, ids in enumerate(_batches()):
        weights = torch.randn(ids.numel(), DIM, generator=generator)
        optimizer.zero_grad()
        (embedding(ids) * weights).sum().backward()
        optimizer.step()
        owner = owners(spec, ids, 2)
        for p, shard in enumerate(shards):
            mine = owner == p
            shard.apply(ids[mine], torch.ones(int(mine.sum()), dtype=torch.int64), weights[mine], step=step)
    assembled = torch.empty(NUM_EMBEDDINGS, DIM)
    for p, shard in enumerate(shards):
        mine = ids_all[owners(spec, ids_all, 2) == p]
        assembled[mine] = shard.lookup(mine)
    assert torch.allclose(assembled, embedding.weight.detach(), atol=1e-5, rtol=0)


def test_scale_multiplies_the_summed_gradient():
    spec = TableSpec(name="items", embedding_dim=2, num_embeddings=4)
    table = ShardTable(spec, RowOptimizer(name="sgd", lr=1.0), 0, 1)
    before = table.lookup(torch.tensor([1]))
    grads = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    table.apply(torch.tensor([1, 1]), torch.tensor([1, 1]), grads, step=0, scale=0.5)
    assert torch.allclose(table.lookup(torch.tensor([1])), before - torch.tensor([[2.0, 3.0]]))


def test_lr_overrides_the_optimizers():
    spec = TableSpec(name="items", embedding_dim=2, num_embeddings=4)
    table = ShardTable(spec, RowOptimizer(name="sgd", lr=1.0), 0, 1)
    before = table.lookup(torch.tensor([2]))
    table.apply(torch.tensor([2]), torch.tensor([1]), torch.ones(1, 2), step=0, lr=0.25)
    assert torch.allclose(table.lookup(torch.tensor([2])), before - 0.25)


def test_rowwise_adagrad_keeps_one_accumulator_per_row():
    optimizer = RowOptimizer(name="rowwise_adagrad", lr=0.5, eps=1e-6, initial_accumulator_value=0.2)
    spec = TableSpec(name="items", embedding_dim=3, num_embeddings=5)
    table = ShardTable(spec, optimizer, 0, 1)
    expected = initial_rows(spec, torch.arange(5)).double()
    accumulators = [0.2] * 5
    steps = [([0, 3, 3], [[1.0, -2.0, 0.5], [0.1, 0.2, 0.3], [1.0, 1.0, 1.0]]), ([3, 4], [[2.0, 0.0, -1.0], [0.5] * 3])]
    for step, (ids, grads) in enumerate(steps):
        table.apply(torch.tensor(ids), torch.ones(len(ids), dtype=torch.int64), torch.tensor(grads), step=step)
        summed: dict[int, torch.Tensor] = {}
        for i, grad in zip(ids, grads, strict=True):
            summed[i] = summed.get(i, torch.zeros(3, dtype=torch.float64)) + torch.tensor(grad, dtype=torch.float64)
        for i, row_grad in summed.items():
            accumulators[i] += float((row_grad**2).mean())
            expected[i] -= 0.5 * row_grad / (accumulators[i] ** 0.5 + 1e-6)
    assert torch.allclose(table.lookup(torch.arange(5)).double(), expected, atol=1e-6, rtol=0)
    assert torch.allclose(table.rows_state(False)["slot.sum"].double(), torch.tensor(accumulators, dtype=torch.float64))


def test_lazy_adam_with_per_row_steps_corrects_each_row_from_its_first_update():
    optimizer = RowOptimizer(name="lazy_adam", lr=0.1, eps=1e-8, per_row_steps=True)
    spec = TableSpec(name="items", embedding_dim=2, num_embeddings=3)
    table = ShardTable(spec, optimizer, 0, 1)
    ones = torch.ones(1, dtype=torch.int64)
    for step in range(5):
        table.apply(torch.tensor([0]), ones, torch.ones(1, 2), step=step)
    before = table.lookup(torch.tensor([1]))
    table.apply(torch.tensor([1]), ones, torch.ones(1, 2), step=5)
    # A row's first Adam step with its own count 1 moves it by lr (m / sqrt(v) = 1 after bias correction).
    assert torch.allclose(table.lookup(torch.tensor([1])), before - 0.1, atol=1e-6)
    assert table.rows_state(False)["slot.step"].tolist() == [5, 1, 0]
