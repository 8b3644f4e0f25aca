"""A worker's input position: exact resume, and epochs that stay exact when a restore changes the worker count."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest

from shardflow import data
from shardflow.train.input import InputPosition, Lookahead, carry_over
from shardflow.train.specs import InputContext, TrainSpec

NUM_RECORDS = 50


def pipeline(ctx: InputContext):
    """A shardflow.data pipeline: its iterator has get_state/set_state."""
    ids = data.Dataset.range(NUM_RECORDS).shard(ctx.num_workers, ctx.worker_index)
    return ids.shuffle(8, seed=3).batch(3)


def generator(ctx: InputContext):
    """A plain generator: resumed by re-creating it and skipping what was consumed."""
    ids = np.arange(ctx.worker_index, NUM_RECORDS, ctx.num_workers)
    for i in range(0, len(ids), 3):
        yield ids[i : i + 3]


def take(position: InputPosition, count: int) -> list[int]:
    seen: list[int] = []
    for _ in range(count):
        batch = position.next()
        if batch is None:
            break
        seen.extend(int(i) for i in batch)
    return seen


def drain(position: InputPosition) -> list[int]:
    return take(position, 10**6)


def run_until(spec: TrainSpec, num_workers: int, batches_each: int) -> tuple[Counter[int], dict[str, dict]]:
    """Each worker reads `batches_each` batches; returns what was read and the positions, JSON round-tripped as a
    checkpoint stores them."""
    seen: Counter[int] = Counter()
    positions = {}
    for w in range(num_workers):
        position = InputPosition(spec, InputContext(num_workers, w))
        seen.update(take(position, batches_each))
        positions[f"worker:{w}"] = json.loads(json.dumps(position.get_state()))
    return seen, positions


@pytest.mark.parametrize("input_fn", [pipeline, generator])
def test_a_restored_position_continues_with_the_same_batches(input_fn):
    spec = TrainSpec(input_fn, epochs=3)
    whole = InputPosition(spec, InputContext(2, 1))
    expected = drain(whole)
    first = InputPosition(spec, InputContext(2, 1))
    head = take(first, 11)  # into the second epoch (9 batches per epoch)
    resumed = InputPosition(spec, InputContext(2, 1), json.loads(json.dumps(first.get_state())))
    assert head + drain(resumed) == expected
    assert Counter(expected) == Counter({i: 3 for i in range(1, NUM_RECORDS, 2)})


@pytest.mark.parametrize("input_fn", [pipeline, generator])
@pytest.mark.parametrize(("old", "new"), [(2, 3), (3, 2), (4, 1), (1, 4), (2, 2)])
@pytest.mark.parametrize("batches_before", [0, 4, 7, 13])
def test_epochs_stay_exact_when_a_restore_changes_the_worker_count(input_fn, old, new, batches_before):
    spec = TrainSpec(input_fn, epochs=3)
    seen, positions = run_until(spec, old, batches_before)
    restored = carry_over(positions, old, new) if old != new else positions
    for w in range(new):
        seen.update(drain(InputPosition(spec, InputContext(new, w), restored.get(f"worker:{w}"))))
    assert seen == Counter({i: 3 for i in range(NUM_RECORDS)})


def test_workers_in_different_epochs_all_finish_the_furthest_one_before_the_new_sharding():
    spec = TrainSpec(pipeline, epochs=4)
    seen: Counter[int] = Counter()
    positions = {}
    for w, count in enumerate([3, 20]):  # worker:0 in epoch 0, worker:1 in epoch 2 (9 batches per epoch)
        position = InputPosition(spec, InputContext(2, w))
        seen.update(take(position, count))
        positions[f"worker:{w}"] = position.get_state()
    restored = carry_over(positions, 2, 3)
    assert {p["epoch"] for p in restored.values()} == {3}
    for w in range(3):
        seen.update(drain(InputPosition(spec, InputContext(3, w), restored[f"worker:{w}"])))
    assert seen == Counter({i: 4 for i in range(NUM_RECORDS)})


def test_a_checkpoint_taken_while_finishing_old_shards_restores_again_exactly_even_onto_another_count():
    spec = TrainSpec(pipeline, epochs=3)
    seen, positions = run_until(spec, 2, 5)
    middle = carry_over(positions, 2, 3)
    # Three workers read a little, still inside the old shards, and a checkpoint is taken.
    again = {}
    for w in range(3):
        position = InputPosition(spec, InputContext(3, w), middle[f"worker:{w}"])
        seen.update(take(position, 2))
        again[f"worker:{w}"] = json.loads(json.dumps(position.get_state()))
    assert any(state.get("carry") for state in again.values())
    for count, restored in ((3, again), (4, carry_over(again, 3, 4))):
        total = seen.copy()
        for w in range(count):
            total.update(drain(InputPosition(spec, InputContext(count, w), restored.get(f"worker:{w}"))))
        assert total == Counter({i: 3 for i in range(NUM_RECORDS)}), count


def test_training_by_steps_continues_with_the_new_sharding_after_the_old_epoch():
    spec = TrainSpec(pipeline, max_steps=100)
    seen, positions = run_until(spec, 2, 4)
    restored = carry_over(positions, 2, 1)
    position = InputPosition(spec, InputContext(1, 0), restored["worker:0"])
    seen.update(take(position, 100))
    # The rest of epoch 0 of both old shards, then whole epochs of the single new shard.
    assert position.epoch >= 1
    assert all(count >= 1 for count in seen.values()) and len(seen) == NUM_RECORDS


@pytest.mark.parametrize("input_fn", [pipeline, generator])
def test_reading_two_batches_ahead_hands_out_the_same_batches_and_resumes_after_those_handed_out(input_fn):
    spec = TrainSpec(input_fn, epochs=1)
    plain = InputPosition(spec, InputContext(2, 1))
    ahead = Lookahead(InputPosition(spec, InputContext(2, 1)), lambda batch: batch)
    second = ahead.peek(2)
    assert second is not None and ahead.peek(2) is second  # read once
    handed = take(ahead, 3)  # type: ignore[arg-type]
    assert handed == take(plain, 3)
    assert ahead.peek(2) is not None and ahead.peek(1) is not None
    state = json.loads(json.dumps(ahead.get_state()))  # where the batches handed out end, not the ones read ahead
    resumed = InputPosition(spec, InputContext(2, 1), state)
    assert take(resumed, 100) == take(ahead, 100)  # type: ignore[arg-type]
    assert ahead.next() is None and ahead.peek(1) is None and ahead.peek(2) is None
