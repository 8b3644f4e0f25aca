"""Dynamic tables on one PS: admission by count or probability, expiry, capacity with LFU eviction, lookups of
ids without a row, and the checks on ids."""

from __future__ import annotations

import pytest
import torch

from shardflow.ps.embeddings.init import initial_rows
from shardflow.ps.embeddings.spec import Initializer, RowOptimizer, TableSpec, mix
from shardflow.ps.embeddings.table import ShardTable

SGD = RowOptimizer(name="sgd", lr=1.0)
DIM = 4


def _table(**spec) -> ShardTable:
    return ShardTable(TableSpec(name="users", embedding_dim=DIM, **spec), SGD, 0, 1)


def _apply(table: ShardTable, ids, step: int, counts=None, grads=None) -> None:
    ids = torch.tensor(ids, dtype=torch.int64)
    counts = torch.ones_like(ids) if counts is None else torch.tensor(counts, dtype=torch.int64)
    grads = torch.ones(ids.numel(), DIM) if grads is None else grads
    table.apply(ids, counts, grads, step=step)
    table.maintain(step)


def _held(table: ShardTable) -> list[int]:
    return table.rows_state(False)["ids"].tolist()


def test_ids_get_a_row_once_seen_admit_after_times():
    table = _table(admit_after=3)
    _apply(table, [1, 2, 3, 1], step=0)  # 1 twice in one batch
    _apply(table, [1, 2, 4], step=1, counts=[1, 1, 5])  # 4 seen five times at once
    _apply(table, [2, 3], step=2)
    assert _held(table) == [1, 2, 4]
    assert table.stats()["admitted"] == 3
    state = table.rows_state(False)
    assert state["counts"].tolist() == [3, 3, 5]
    assert state["last_seen"].tolist() == [1, 2, 1]


def test_an_admitted_row_takes_the_gradient_of_the_update_that_admits_it():
    table = _table(admit_after=2)
    _apply(table, [7], step=0)
    grads = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    _apply(table, [7], step=1, grads=grads)
    spec = table.spec
    assert torch.equal(table.lookup(torch.tensor([7])), initial_rows(spec, torch.tensor([7])) - grads)


def test_gradients_of_ids_without_a_row_are_dropped_and_counted():
    table = _table(admit_after=2)
    _apply(table, [5, 6], step=0)
    assert table.stats()["rejected"] == 2
    assert table.stats()["rows"] == 0
    assert torch.equal(table.lookup(torch.tensor([5])), initial_rows(table.spec, torch.tensor([5])))


def test_a_lookup_of_an_id_without_a_row_reads_its_initial_values_and_makes_nothing():
    table = _table(admit_after=2)
    ids = torch.tensor([-(2**63), 0, 2**63 - 1])
    assert torch.equal(table.lookup(ids), initial_rows(table.spec, ids))
    _apply(table, [0], step=0)  # one sighting: the lookup above was not one
    assert table.stats()["rows"] == 0


def test_admission_by_probability_is_reproducible_and_near_p():
    def admitted(seed: int) -> list[int]:
        spec = TableSpec(name="users", embedding_dim=DIM, admit_probability=0.25, initializer=Initializer(seed=seed))
        table = ShardTable(spec, SGD, 0, 1)
        for step in range(4):
            _apply(table, list(range(step * 1_000, (step + 1) * 1_000)), step=step)
        return _held(table)

    first = admitted(seed=0)
    assert admitted(seed=0) == first
    assert admitted(seed=1) != first
    assert 900 < len(first) < 1_100


def test_admission_by_probability_counts_every_sighting_of_a_batch():
    table = _table(admit_probability=0.05)
    ids = list(range(2_000))
    _apply(table, ids, step=0, counts=[20] * len(ids))  # 1 - 0.95**20 = 0.64
    assert 1_150 < table.stats()["rows"] < 1_400


def test_rows_unseen_for_expire_after_steps_are_removed():
    table = _table(expire_after_steps=10)
    _apply(table, [1, 2], step=0)
    table.mark_saved()
    for step in range(1, 12):
        _apply(table, [2], step=step)
    assert _held(table) == [2]
    assert table.stats()["expired"] == 1
    assert table.rows_state(True)["removed"].tolist() == [1]


def test_expiry_is_checked_every_eighth_of_its_period():
    table = _table(expire_after_steps=80)
    _apply(table, [1], step=0)  # due from step 81 on; checked at 0, 10, ..., 80, 90
    for step in range(1, 90):
        _apply(table, [2], step=step)
    assert _held(table) == [1, 2]
    _apply(table, [2], step=90)
    assert _held(table) == [2]


def test_over_capacity_the_least_frequently_seen_rows_go_first():
    table = _table(capacity_per_ps=3)
    _apply(table, [1, 2, 3], step=0, counts=[5, 1, 3])
    _apply(table, [4], step=1, counts=[2])
    assert _held(table) == [1, 3, 4]
    assert table.stats()["evicted"] == 1


def test_among_equally_seen_rows_the_least_recently_seen_go_first():
    table = _table(capacity_per_ps=2)
    _apply(table, [1], step=0)
    _apply(table, [2], step=1)
    _apply(table, [3], step=2)
    assert _held(table) == [2, 3]


def test_pending_sightings_are_bounded_forgetting_the_least_recently_seen():
    table = ShardTable(TableSpec(name="users", embedding_dim=DIM, admit_after=2), SGD, 0, 1, max_pending_ids=8)
    _apply(table, [100], step=0)
    _apply(table, [200], step=1)
    _apply(table, list(range(7)), step=2)  # nine pending: down to 7, forgetting 100 and 200, seen longest ago
    _apply(table, [100, 0], step=3)
    assert _held(table) == [0]


def test_the_padding_id_reads_zeros_and_is_never_updated():
    table = _table(padding_idx=0)
    _apply(table, [0, 1], step=0)
    assert _held(table) == [1]
    assert torch.equal(table.lookup(torch.tensor([0])), torch.zeros(1, DIM))


def test_max_norm_renormalises_stored_rows_at_lookup():
    table = _table(max_norm=1.0)
    _apply(table, [3], step=0)  # the stored row is N(0,1) values minus 1: norm about 2.2
    looked_up = table.lookup(torch.tensor([3, 4]))
    assert torch.allclose(looked_up.norm(dim=1), torch.ones(2), atol=1e-5)
    assert torch.equal(table.rows_state(False)["values"], looked_up[:1])


def test_ids_owned_by_another_ps_are_refused_naming_the_table_and_id():
    spec = TableSpec(name="users", embedding_dim=DIM)
    table = ShardTable(spec, SGD, 1, 3)
    ids = torch.arange(100)
    wrong = int(ids[mix(ids) % 3 != 1][0])
    with pytest.raises(ValueError, match=f"lookup: table 'users': id {wrong} belongs to PS"):
        table.lookup(ids)


def test_ids_of_a_fixed_table_outside_it_are_refused():
    table = ShardTable(TableSpec(name="items", embedding_dim=DIM, num_embeddings=10), SGD, 0, 1)
    with pytest.raises(ValueError, match="apply: table 'items' has ids 0 to 9, got id 10"):
        table.apply(torch.tensor([3, 10]), torch.ones(2, dtype=torch.int64), torch.ones(2, DIM), step=0)


def test_ids_that_are_not_int64_are_refused():
    table = _table()
    with pytest.raises(ValueError, match="1-D int64"):
        table.lookup(torch.tensor([1, 2], dtype=torch.int32))


def test_gradients_of_the_wrong_shape_are_refused():
    table = _table()
    with pytest.raises(ValueError, match=r"float32 \[2, 4\]"):
        table.apply(torch.tensor([1, 2]), torch.ones(2, dtype=torch.int64), torch.ones(2, 3), step=0)


def test_storage_grows_and_reuses_freed_rows():
    table = _table(expire_after_steps=1)
    for step in range(20):
        _apply(table, list(range(step * 1_000, (step + 1) * 1_000)), step=step)
    assert table.stats()["rows"] <= 2_000
    assert table._values.shape[0] <= 4_096  # freed rows were reused, not new ones made


def test_an_update_without_ids_still_counts_as_an_optimizer_step():
    table = _table()
    table.apply(torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64), torch.empty(0, DIM), step=0)
    assert table.lookup(torch.empty(0, dtype=torch.int64)).shape == (0, DIM)
    assert table.scalars()["optimizer_step"] == 1.0
    assert table.stats()["rows"] == 0
