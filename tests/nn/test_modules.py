"""sf.nn modules in one process (sf.nn.local_tables) compute what torch.nn.Embedding / EmbeddingBag compute on the
same rows: outputs and the rows' updates, for every bag mode, per-sample weights and padding."""

from __future__ import annotations

import pytest
import torch

import shardflow as sf
from shardflow.ps.embeddings.init import initial_rows

NUM, DIM = 50, 4


class Bags(torch.nn.Module):
    def __init__(self, **kwargs: object) -> None:
        super().__init__()
        self.table = sf.nn.EmbeddingBag(NUM, DIM, optimizer=sf.nn.sgd(0.5), **kwargs)  # type: ignore[arg-type]


def _torch_twin(module: sf.nn.EmbeddingBag, **kwargs: object) -> torch.nn.EmbeddingBag:
    twin = torch.nn.EmbeddingBag(NUM, DIM, **kwargs)  # type: ignore[arg-type]
    with torch.no_grad():
        twin.weight.copy_(initial_rows(module.spec(), torch.arange(NUM)))
        if twin.padding_idx is not None:
            twin.weight[twin.padding_idx] = 0  # as torch makes it, and the PS stores it
    return twin


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("padding_idx", [None, 3])
def test_a_bag_of_ids_equals_torch_embedding_bag_and_trains_the_same_rows(mode, padding_idx):
    model = Bags(mode=mode, padding_idx=padding_idx)
    sf.nn.table_specs(model)
    twin = _torch_twin(model.table, mode=mode, padding_idx=padding_idx)
    ids = torch.tensor([1, 3, 3, 7, 9, 3, 12, 1], dtype=torch.int32)
    offsets = torch.tensor([0, 3, 5])
    with sf.nn.local_tables(model) as tables:
        out = model.table(ids, offsets)
        expected = twin(ids.long(), offsets)
        torch.testing.assert_close(out, expected)
        (out * torch.arange(out.numel()).view_as(out)).sum().backward()
        (expected * torch.arange(expected.numel()).view_as(expected)).sum().backward()
        tables.step()
        torch.optim.SGD([twin.weight], lr=0.5).step()
        torch.testing.assert_close(model.table(torch.arange(NUM), torch.arange(NUM)), twin.weight.detach())


def test_per_sample_weights_of_a_sum_bag_equal_torch():
    model = Bags(mode="sum")
    sf.nn.table_specs(model)
    twin = _torch_twin(model.table, mode="sum")
    ids, offsets, weights = torch.tensor([4, 5, 4, 8]), torch.tensor([0, 2]), torch.tensor([0.5, 2.0, -1.0, 3.0])
    with sf.nn.local_tables(model):
        torch.testing.assert_close(model.table(ids, offsets, weights), twin(ids, offsets, weights))


def test_a_table_outside_a_job_names_itself_and_the_way_to_run_it():
    model = Bags()
    sf.nn.table_specs(model)
    with pytest.raises(RuntimeError, match=r"'table' lives on the parameter servers.*sf\.nn\.local_tables"):
        model.table(torch.tensor([1]), torch.tensor([0]))


def test_float_ids_are_refused_naming_the_table_and_the_cast():
    model = Bags()
    sf.nn.table_specs(model)
    with sf.nn.local_tables(model), pytest.raises(TypeError, match=r"'table' looks up integer ids.*\.long\(\)"):
        model.table(torch.tensor([1.0]), torch.tensor([0]))
