"""initial_rows: the same id makes the same row, bit for bit, whatever batch, chunk, PS count or process makes it."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from shardflow.ps.embeddings import init
from shardflow.ps.embeddings.init import initial_rows
from shardflow.ps.embeddings.spec import Initializer, RowOptimizer, TableSpec, owners
from shardflow.ps.embeddings.table import ShardTable

SGD = RowOptimizer(name="sgd", lr=0.1)


def _spec(dim: int = 16, **initializer) -> TableSpec:
    return TableSpec(name="items", embedding_dim=dim, initializer=Initializer(**initializer))


def test_a_row_is_the_same_whatever_batch_it_is_drawn_in():
    spec = _spec(dim=7)
    ids = torch.randint(-(2**63), 2**63 - 1, (20_000,))
    whole = initial_rows(spec, ids)
    pieces = torch.cat([initial_rows(spec, ids[i : i + 37]) for i in range(0, ids.numel(), 37)])
    reversed_ = initial_rows(spec, ids.flip(0)).flip(0)
    assert torch.equal(whole, pieces)
    assert torch.equal(whole, reversed_)
    assert torch.equal(whole[1234], initial_rows(spec, ids[1234:1235])[0])


def test_a_row_is_the_same_whatever_the_chunk_size(monkeypatch):
    spec = _spec(dim=5)
    ids = torch.arange(-5_000, 5_000)
    before = initial_rows(spec, ids)
    monkeypatch.setattr(init, "_CHUNK_ROWS", 333)
    assert torch.equal(initial_rows(spec, ids), before)


@pytest.mark.parametrize("partition", ["mod", "range"])
def test_a_fixed_table_starts_the_same_on_any_number_of_ps(partition):
    spec = TableSpec(name="items", embedding_dim=4, num_embeddings=101, partition=partition)
    ids = torch.arange(101)
    alone = ShardTable(spec, SGD, 0, 1).lookup(ids)
    for num_ps in (2, 3):
        tables = [ShardTable(spec, SGD, p, num_ps) for p in range(num_ps)]
        split = torch.empty_like(alone)
        for p, table in enumerate(tables):
            mine = ids[owners(spec, ids, num_ps) == p]
            assert mine.numel() > 0, p
            split[mine] = table.lookup(mine)
        assert torch.equal(split, alone)


def test_a_row_is_the_same_in_another_process_with_another_thread_count():
    spec = _spec(dim=9)
    ids = torch.arange(0, 30_000, 7)
    here = initial_rows(spec, ids)
    code = (
        "import sys, torch\n"
        "torch.set_num_threads(1)\n"
        "from shardflow.ps.embeddings.init import initial_rows\n"
        "from shardflow.ps.embeddings.spec import TableSpec\n"
        "rows = initial_rows(TableSpec(name='items', embedding_dim=9), torch.arange(0, 30_000, 7))\n"
        "sys.stdout.buffer.write(rows.numpy().tobytes())\n"
    )
    there = subprocess.run([sys.executable, "-c", code], capture_output=True, check=True).stdout
    assert there == here.numpy().tobytes()


def test_the_seed_and_the_table_name_each_change_every_row():
    ids = torch.arange(1_000)
    base = initial_rows(_spec(), ids)
    reseeded = initial_rows(_spec(seed=1), ids)
    renamed = initial_rows(TableSpec(name="users", embedding_dim=16), ids)
    assert (base != reseeded).all(dim=1).all()
    assert (base != renamed).all(dim=1).all()


def test_normal_rows_have_the_asked_mean_and_std_and_independent_columns():
    rows = initial_rows(_spec(dim=8, mean=0.5, std=2.0), torch.arange(100_000))
    assert abs(rows.mean().item() - 0.5) < 0.01
    assert abs(rows.std().item() - 2.0) < 0.01
    standard = (rows - 0.5) / 2.0
    assert abs((standard.abs() > 3).float().mean().item() - 0.0027) < 0.0005  # the tails of N(0, 1)
    correlations = torch.corrcoef(standard.T) - torch.eye(8)
    assert correlations.abs().max() < 0.02
    squares = torch.corrcoef((standard**2).T) - torch.eye(8)  # Box-Muller pairs: radius shared
    assert squares.abs().max() < 0.02


def test_uniform_rows_fill_low_to_high():
    rows = initial_rows(_spec(dim=3, kind="uniform", low=-1.0, high=2.0), torch.arange(60_000))
    assert rows.min() >= -1.0
    assert rows.max() < 2.0
    assert torch.allclose(
        torch.histc(rows, bins=6, min=-1.0, max=2.0) / rows.numel(), torch.full((6,), 1 / 6), atol=0.01
    )


def test_zeros_and_constant_rows():
    ids = torch.arange(5)
    assert torch.equal(initial_rows(_spec(dim=3, kind="zeros"), ids), torch.zeros(5, 3))
    assert torch.equal(initial_rows(_spec(dim=3, kind="constant", value=0.25), ids), torch.full((5, 3), 0.25))


def test_no_ids_make_no_rows():
    assert initial_rows(_spec(dim=3), torch.empty(0, dtype=torch.int64)).shape == (0, 3)
