"""A lookup of `sf.nn` table rows riding on a push (Push.lookup): real PS on loopback, driven through ParameterClient
and its TableLookups as an overlapped async worker drives them."""

from __future__ import annotations

import pytest
import torch

import shardflow as sf
from shardflow.comm.errors import CommError
from shardflow.nn import backend
from shardflow.ps import protocol
from shardflow.ps.client import PushRequest
from shardflow.ps.placement import place
from shardflow.ps.update_rules import ApplyConfig
from shardflow.train.checkpoints.servers import TableSetup, fetch_state, init_servers

ROWS, DIM = 50, 4


class Ranker(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.items = sf.nn.Embedding(ROWS, DIM, optimizer=sf.nn.sgd(1.0))
        self.head = torch.nn.Linear(DIM, 1)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.head(self.items(batch["ids"])).sum()


def _setup(start_cluster, num_ps: int, max_steps: int | None = None):
    cluster = start_cluster(num_ps)
    model = Ranker()
    placement = place(model.named_parameters(), num_ps)
    chief = cluster.client(model, placement)
    apply = ApplyConfig(num_workers=1, max_steps=max_steps)
    init_servers(chief, sf.optim.SGD(lr=0.1), apply, tables=TableSetup.of(model, None))
    worker = cluster.client(model, placement)
    assert worker.tables is not None
    return model, worker, worker.tables


def _rows(worker, ids: torch.Tensor) -> torch.Tensor:
    """The rows of `ids` as every PS holds them now, through a `Lookup` of their own."""
    tables = worker.tables
    looked = tables._send([tables._prepare(0, ids)], [0] * tables.num_ps)
    tables._collect(looked)
    return looked.wanted[0].rows.clone()


@pytest.mark.parametrize("num_ps", [1, 2])
def test_the_rows_a_lookup_rode_on_a_push_for_are_those_after_that_push(start_cluster, num_ps):
    model, worker, tables = _setup(start_cluster, num_ps)
    first = {"ids": torch.tensor([1, 2, 3, 2])}
    after_next = {"ids": torch.tensor([2, 3, 7, 8, 9])}
    before = _rows(worker, after_next["ids"])
    worker.pull()
    with backend.installed(tables):
        worker.begin_push(0)
        tables.set_batch(first)
        model(first).backward()  # learns where the batch's ids are
        tables.ride(after_next)
        pushed = worker.push(PushRequest())
        worker.wait_push(pushed)
    now = _rows(worker, after_next["ids"])
    assert not torch.equal(now[:2], before[:2]) and torch.equal(now[2:], before[2:])  # ids 2 and 3 were updated
    lookups = _lookups(worker)
    # The next step's prefetch of that batch takes the rows that came with the push's reply: nothing is sent.
    with backend.installed(tables):
        worker.begin_push(1)
        tables.prefetch(after_next, [0] * num_ps)
        worker.begin_push(2)
        tables.set_batch(after_next)
        looked = model.items(after_next["ids"])
    assert torch.equal(looked.detach(), now)
    assert _lookups(worker) == lookups
    assert tables.not_prefetched == 1  # the first batch's only


def _lookups(worker) -> float:
    """The lookups every PS answered so far, with a `Lookup` of their own or riding on a push."""
    return sum(stats["lookups"] for stats in fetch_state(worker).stats.values())


def test_a_push_dropped_after_the_last_step_still_brings_the_rows_that_rode_on_it(start_cluster):
    model, worker, tables = _setup(start_cluster, 2, max_steps=1)
    batch = {"ids": torch.tensor([4, 5])}
    worker.pull()
    with backend.installed(tables):
        for step in range(2):  # the second push comes after the last step: dropped, not applied
            worker.begin_push(step)
            tables.set_batch(batch)
            model(batch).backward()
            tables.ride(batch)
            reply = worker.wait_push(worker.push(PushRequest()))
        assert reply.step == 1
        tables.prefetch(batch, [0, 0])
        worker.begin_push(2)
        tables.set_batch(batch)
        looked = model.items(batch["ids"])
    assert torch.equal(looked.detach(), _rows(worker, batch["ids"]))


def test_a_push_whose_lookup_frames_are_not_ids_is_refused_naming_the_field():
    limits = protocol.Limits(num_workers=1, buffers=((torch.float32, 3),), num_tables=0, embedding_tables=2)
    dense = [torch.zeros(3)]
    tables = [torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64), torch.zeros(0, 4)] * 2
    ids = torch.tensor([1, 2])

    def push(lookup: tuple[int, ...], *frames: torch.Tensor) -> protocol.PSRequest:
        message = protocol.Push(worker_index=0, local_step=1, base_step=0, frame_counts=(1,), lookup=lookup)
        return protocol.decode_request(message.header(), [*dense, *tables, *frames], limits, "worker:0")

    with pytest.raises(protocol.PSProtocolError, match=r"lookup of ids must be 1-D int64"):
        push((0, 1), ids, torch.tensor([0.5]))
    with pytest.raises(protocol.PSProtocolError, match=r"lookup must hold ints in \[0, 2\)"):
        push((0, 2), ids, ids)
    with pytest.raises(protocol.PSProtocolError, match=r"frame_counts must group 8 frames into 1 dense buffers and 8"):
        push((0, 1), ids)
    good = push((0, 1), ids, ids)
    assert isinstance(good, protocol.Push) and good.lookup == (0, 1)


def test_a_push_whose_riding_ids_are_not_in_the_table_is_refused_before_it_is_applied(start_cluster, monkeypatch):
    model, worker, tables = _setup(start_cluster, 2)
    batch = {"ids": torch.tensor([1, 2])}
    worker.pull()
    with backend.installed(tables):
        worker.begin_push(0)
        tables.set_batch(batch)
        model(batch).backward()
        monkeypatch.setattr(tables, "riding", lambda ps: ((0,), [torch.tensor([ROWS + 5])]))
        refused = rf"'push' from worker:0#\w+ of ps:\d for table 'items'.* got id {ROWS + 5}"
        with pytest.raises(CommError, match=refused):
            worker.wait_push(worker.push(PushRequest()))
    assert [stats["applied"] for stats in fetch_state(worker).stats.values()] == [0, 0]
