"""A table's checkpoint state: full and changed rows, their replay onto a fresh table, and restoring the rows of
two PS onto three."""

from __future__ import annotations

import pytest
import torch

from shardflow.ps.embeddings.spec import RowOptimizer, TableSpec, owners
from shardflow.ps.embeddings.table import ShardTable

ADAM = RowOptimizer(name="lazy_adam", lr=0.01)
ADAGRAD = RowOptimizer(name="adagrad", lr=0.1)
DIM = 3
DYNAMIC = TableSpec(name="users", embedding_dim=DIM, admit_after=2, expire_after_steps=4, capacity_per_ps=60)


def _train(tables: list[ShardTable], steps: range, seed: int = 0, id_range: int = 200) -> None:
    """Pushes each step's ids (repeats included) to the PS that own them, as the lead does."""
    generator = torch.Generator().manual_seed(seed)
    spec, num_ps = tables[0].spec, len(tables)
    for step in steps:
        ids = torch.randint(0, id_range, (50,), generator=generator)
        grads = torch.randn(50, DIM, generator=generator)
        owner = owners(spec, ids, num_ps)
        for p, table in enumerate(tables):
            mine = owner == p
            table.apply(ids[mine], torch.ones(int(mine.sum()), dtype=torch.int64), grads[mine], step=step)
            table.maintain(step)


def _merged(tables: list[ShardTable]) -> dict[str, torch.Tensor]:
    """Every PS's full state as one, sorted by id."""
    states = [table.rows_state(False) for table in tables]
    merged = {key: torch.cat([state[key] for state in states]) for key in states[0] if not key.startswith("pending.")}
    order = torch.argsort(merged["ids"])
    merged = {key: value[order] for key, value in merged.items()}
    # The ids waiting for admission, of every PS together (not where each waits).
    pending = {key: torch.cat([s[key] for s in states]) for key in states[0] if key.startswith("pending.")}
    pending.pop("pending.source", None)
    if pending:
        order = torch.argsort(pending["pending.ids"])
        merged |= {key: value[order] for key, value in pending.items()}
    return merged


def _assert_same(state: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert state.keys() == expected.keys()
    for key in expected:
        assert torch.equal(state[key], expected[key]), key


@pytest.mark.parametrize("optimizer", [ADAM, ADAGRAD], ids=["lazy_adam", "adagrad"])
def test_full_state_restores_a_dynamic_table_that_trains_on_as_the_live_one(optimizer):
    # Admitted at the first sighting: the sightings of ids not admitted yet are not part of the state.
    spec = TableSpec(name="users", embedding_dim=DIM, expire_after_steps=4, capacity_per_ps=60)
    live = ShardTable(spec, optimizer, 0, 1)
    _train([live], range(10))
    restored = ShardTable(spec, optimizer, 0, 1)
    restored.load_rows(live.rows_state(False))
    restored.load_scalars(live.scalars())
    _assert_same(restored.rows_state(False), live.rows_state(False))
    _train([live], range(10, 12), seed=1)
    _train([restored], range(10, 12), seed=1)
    assert torch.equal(restored.rows_state(False)["values"], live.rows_state(False)["values"])


def test_full_then_changed_rows_replay_to_the_live_dynamic_table():
    live = ShardTable(DYNAMIC, ADAM, 0, 1)
    _train([live], range(10))
    full, scalars = live.rows_state(False), live.scalars()
    live.mark_saved()
    _train([live], range(10, 12), seed=1)
    increment = live.rows_state(True)
    assert increment["removed"].numel() > 0  # expiry and eviction removed rows since the full state
    assert increment["ids"].numel() < live.stats()["rows"]
    replayed = ShardTable(DYNAMIC, ADAM, 0, 1)
    replayed.load_rows(full)
    replayed.load_rows(increment)
    replayed.load_scalars(live.scalars())
    _assert_same(replayed.rows_state(False), live.rows_state(False))
    assert scalars["optimizer_step"] == 10.0


def test_changed_rows_of_a_fixed_table_are_those_updated_since_the_mark():
    spec = TableSpec(name="items", embedding_dim=DIM, num_embeddings=30, max_norm=0.5)
    table = ShardTable(spec, ADAGRAD, 1, 2)
    table.mark_saved()
    table.apply(torch.tensor([3, 5, 3]), torch.ones(3, dtype=torch.int64), torch.ones(3, DIM), step=0)
    table.lookup(torch.tensor([7, 9]))  # renormalised (N(0, 1) rows of 3 values have norms above 0.5)
    changed = table.rows_state(True)
    assert changed["ids"].tolist() == [3, 5, 7, 9]
    assert changed["removed"].numel() == 0
    table.mark_saved()
    assert table.rows_state(True)["ids"].numel() == 0


def test_full_then_changed_rows_replay_to_the_live_fixed_table():
    spec = TableSpec(name="items", embedding_dim=DIM, num_embeddings=300)
    live = ShardTable(spec, ADAM, 0, 1)
    _train([live], range(3), id_range=300)
    full = live.rows_state(False)
    live.mark_saved()
    _train([live], range(3, 6), seed=1, id_range=300)
    replayed = ShardTable(spec, ADAM, 0, 1)
    replayed.load_rows(full)
    replayed.load_rows(live.rows_state(True))
    _assert_same(replayed.rows_state(False), live.rows_state(False))


@pytest.mark.parametrize(
    "spec",
    [
        DYNAMIC,
        TableSpec(name="items", embedding_dim=DIM, num_embeddings=200, partition="mod"),
        TableSpec(name="items", embedding_dim=DIM, num_embeddings=200, partition="range"),
    ],
    ids=["dynamic", "fixed-mod", "fixed-range"],
)
def test_the_rows_of_two_ps_restore_onto_three(spec):
    two = [ShardTable(spec, ADAM, p, 2) for p in range(2)]
    _train(two, range(8))
    three = [ShardTable(spec, ADAM, p, 3) for p in range(3)]
    for state in (table.rows_state(False) for table in two):
        for table in three:
            table.load_rows(state)
    _assert_same(_merged(three), _merged(two))
    assert all(table.stats()["rows"] > 0 for table in three)


def test_a_state_without_a_slot_is_refused_naming_it():
    table = ShardTable(DYNAMIC, ADAM, 0, 1)
    state = ShardTable(DYNAMIC, ADAGRAD, 0, 1).rows_state(False)
    with pytest.raises(ValueError, match=r"table 'users': the checkpoint's 'slot\.exp_avg' should be"):
        table.load_rows(state)


def test_stats_count_memory_of_values_slots_index_and_metadata():
    table = ShardTable(DYNAMIC, ADAM, 0, 1)
    empty = table.memory_bytes()
    _train([table], range(3))
    stats = table.stats()
    assert stats["memory_bytes"] == table.memory_bytes() > empty
    assert stats["rows"] == stats["admitted"] - stats["evicted"] - stats["expired"]
    # The values alone, as one dense tensor of the rows held: what `shardflow plan` sums for all-reduce.
    assert stats["values_bytes"] == stats["rows"] * DIM * 4 < stats["memory_bytes"]


def test_a_fixed_tables_values_are_every_row_it_owns():
    spec = TableSpec(name="items", embedding_dim=DIM, num_embeddings=1_001)
    stats = [ShardTable(spec, ADAGRAD, index, 2).stats() for index in range(2)]
    assert [s["rows"] for s in stats] == [501, 500]
    assert sum(s["values_bytes"] for s in stats) == 1_001 * DIM * 4


def test_rows_outside_a_fixed_table_are_refused_naming_the_first():
    bigger = ShardTable(TableSpec(name="items", embedding_dim=DIM, num_embeddings=20), ADAM, 0, 1)
    smaller = ShardTable(TableSpec(name="items", embedding_dim=DIM, num_embeddings=10), ADAM, 0, 1)
    with pytest.raises(ValueError, match="table 'items' has ids 0 to 9; the checkpoint has a row of id 10"):
        smaller.load_rows(bigger.rows_state(False))


def test_ids_waiting_for_admission_keep_their_sightings_across_a_restore_onto_three_ps():
    """Sightings of ids not admitted yet are in the state: restored onto 3 PS (after a full state and an increment,
    each of which holds a PS's whole waiting set), the same ids are admitted at the same sighting as live."""
    spec = TableSpec(name="users", embedding_dim=DIM, admit_after=3)
    two = [ShardTable(spec, ADAGRAD, p, 2) for p in range(2)]
    _train(two, range(3), id_range=400)
    files = [table.rows_state(False) for table in two]
    for table in two:
        table.mark_saved()
    _train(two, range(3, 5), seed=2, id_range=400)
    files += [table.rows_state(True) for table in two]
    three = [ShardTable(spec, ADAGRAD, p, 3) for p in range(3)]
    for state in files:
        for table in three:
            table.load_rows(state)
    for table in three:
        table.load_scalars(two[0].scalars())
    _assert_same(_merged(three), _merged(two))
    assert _merged(two)["pending.ids"].numel() > 0
    _train(two, range(5, 8), seed=3, id_range=400)
    _train(three, range(5, 8), seed=3, id_range=400)
    _assert_same(_merged(three), _merged(two))
