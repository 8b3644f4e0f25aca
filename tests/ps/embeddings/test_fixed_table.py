"""A fixed table's lookups read as torch.nn.Embedding's: max_norm renormalises the stored rows, the padding row
reads zeros and never trains."""

from __future__ import annotations

import torch

from shardflow.ps.embeddings.init import initial_rows
from shardflow.ps.embeddings.spec import RowOptimizer, TableSpec
from shardflow.ps.embeddings.table import ShardTable

SGD = RowOptimizer(name="sgd", lr=0.5)


def test_max_norm_renormalises_like_torch_embedding():
    spec = TableSpec(name="items", embedding_dim=5, num_embeddings=12, max_norm=1.5, norm_type=3.0)
    table = ShardTable(spec, SGD, 0, 1)
    embedding = torch.nn.Embedding(12, 5, max_norm=1.5, norm_type=3.0)
    embedding.weight.data.copy_(initial_rows(spec, torch.arange(12)))
    ids = torch.tensor([4, 1, 4, 9])
    with torch.no_grad():
        expected = embedding(ids)
    assert torch.allclose(table.lookup(ids), expected, atol=1e-6, rtol=0)
    stored = table.rows_state(False)["values"]  # the rows looked up, renormalised in place; the others not
    assert torch.allclose(stored, embedding.weight.detach(), atol=1e-6, rtol=0)
    assert table.rows_state(True)["ids"].tolist() == [4, 9]  # 1 was within max_norm: unchanged


def test_the_padding_row_reads_zeros_and_never_trains():
    spec = TableSpec(name="items", embedding_dim=3, num_embeddings=6, padding_idx=-1)  # id 5, as torch counts it
    table = ShardTable(spec, SGD, 1, 2)
    assert torch.equal(table.lookup(torch.tensor([5])), torch.zeros(1, 3))
    before = table.lookup(torch.tensor([1]))
    table.apply(torch.tensor([5, 1]), torch.ones(2, dtype=torch.int64), torch.ones(2, 3), step=0)
    assert torch.equal(table.lookup(torch.tensor([5])), torch.zeros(1, 3))
    assert torch.allclose(table.lookup(torch.tensor([1])), before - 0.5)
    assert table.rows_state(False)["values"][2].abs().sum() == 0  # stored as zeros, as torch's padding row


def test_fixed_tables_hold_every_row_from_the_start():
    spec = TableSpec(name="items", embedding_dim=3, num_embeddings=10, partition="range")
    tables = [ShardTable(spec, RowOptimizer(name="adagrad", lr=0.1), p, 3) for p in range(3)]
    assert [t.stats()["rows"] for t in tables] == [4, 4, 2]
    assert [t.rows_state(False)["ids"].tolist() for t in tables] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
