"""InputContext.epoch: input_fn is told which epoch it produces, so it can call DistributedSampler.set_epoch."""

from __future__ import annotations

import json

import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from shardflow.train.input import InputPosition
from shardflow.train.specs import InputContext, TrainSpec

NUM_RECORDS = 12


def test_input_context_epoch_defaults_to_the_first() -> None:
    assert InputContext(2, 1).epoch == 0
    assert InputContext(2, 1, epoch=3).epoch == 3


def sampled_input_fn(calls: list[InputContext]):
    """A torch input pipeline: a DistributedSampler over this worker's replica, reshuffled per epoch."""

    def input_fn(ctx: InputContext) -> DataLoader:
        calls.append(ctx)
        records = TensorDataset(torch.arange(NUM_RECORDS))
        sampler: DistributedSampler[int] = DistributedSampler(
            records, num_replicas=ctx.num_workers, rank=ctx.worker_index, shuffle=True, seed=0
        )
        sampler.set_epoch(ctx.epoch)
        return DataLoader(records, batch_size=2, sampler=sampler)

    return input_fn


def drain(position: InputPosition) -> list[list[int]]:
    batches = []
    while (batch := position.next()) is not None:
        (records,) = batch
        batches.append(records.tolist())
    return batches


def test_input_fn_is_called_with_each_epoch_it_produces() -> None:
    calls: list[InputContext] = []
    spec = TrainSpec(sampled_input_fn(calls), epochs=3)
    per_worker = [drain(InputPosition(spec, InputContext(2, worker_index))) for worker_index in range(2)]
    assert [(ctx.epoch, ctx.worker_index) for ctx in calls] == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1)]
    # 3 batches of 2 per worker and epoch: together the workers read every record once per epoch, in a new order.
    epochs = [
        [record for batches in per_worker for batch in batches[3 * e : 3 * e + 3] for record in batch] for e in range(3)
    ]
    assert all(sorted(records) == list(range(NUM_RECORDS)) for records in epochs)
    assert len({tuple(records) for records in epochs}) == 3


def test_a_restored_position_calls_input_fn_with_the_epoch_it_resumes() -> None:
    spec = TrainSpec(sampled_input_fn([]), epochs=3)
    first = InputPosition(spec, InputContext(2, 0))
    for _ in range(4):  # into the second epoch (3 batches per epoch)
        first.next()
    calls: list[InputContext] = []
    resumed = InputPosition(
        TrainSpec(sampled_input_fn(calls), epochs=3), InputContext(2, 0), json.loads(json.dumps(first.get_state()))
    )
    rest = drain(resumed)
    assert [ctx.epoch for ctx in calls] == [1, 2]
    assert rest == drain(InputPosition(spec, InputContext(2, 0)))[4:]
