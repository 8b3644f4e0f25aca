"""Row-sparse tables (nn.Embedding(sparse=True)) on real parameter servers: only the looked-up rows move, and the
PS applies their gradients as torch.optim does in one process."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from shardflow.comm.errors import CommError
from shardflow.profile.recorder import SpanRecorder, set_recorder
from shardflow.ps.client import ParameterClient, PushRequest, StepReply
from shardflow.ps.optimizers import SGD, Adagrad, Adam, AdamW, OptimizerSpec, RMSprop
from shardflow.ps.placement import Partitioner, place
from shardflow.ps.protocol import Push, Rows
from shardflow.ps.sparse import sparse_variables
from shardflow.ps.update_rules import ApplyConfig
from shardflow.train.checkpoints.servers import fetch_state, init_servers

NUM_ROWS = 40
# Each batch looks up some rows more than once; row 30 and up are never looked up.
BATCHES = [
    torch.tensor([[1, 1, 5], [5, 7, 1]]),
    torch.tensor([[2, 9, 9], [9, 11, 2]]),
    torch.tensor([[1, 20, 20], [7, 7, 7]]),
    torch.tensor([[0, 29, 3], [3, 3, 0]]),
]
TARGETS = torch.tensor([[0.5], [-1.0]])


class Ranker(torch.nn.Module):
    def __init__(self, sparse: bool, num_rows: int = NUM_ROWS, dim: int = 4) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.table = torch.nn.Embedding(num_rows, dim, sparse=sparse)
        self.head = torch.nn.Linear(dim, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.table(ids).mean(dim=1))


def loss(model: torch.nn.Module, ids: torch.Tensor, targets: torch.Tensor = TARGETS) -> torch.Tensor:
    return torch.nn.functional.mse_loss(model(ids), targets)


def start(cluster, optimizer: OptimizerSpec, num_ps: int, mode: str = "async", num_workers: int = 1):
    model = Ranker(sparse=True)
    # Every tensor with enough rows is cut into num_ps slices, so the table spreads over every PS.
    placement = place(model.named_parameters(), num_ps, Partitioner(fixed_shards=num_ps), sparse_variables(model))
    chief = cluster.admin(model, placement)
    init_servers(chief, optimizer, ApplyConfig(mode=mode, num_workers=num_workers))
    return chief, placement


def begin_step(worker: ParameterClient, ids: torch.Tensor, base_step: int, targets: torch.Tensor = TARGETS):
    model = worker.model
    model.zero_grad(set_to_none=True)
    worker.begin_push(base_step)
    loss(model, ids, targets).backward()
    return worker.push(PushRequest())


def step(worker: ParameterClient, ids: torch.Tensor, base_step: int) -> StepReply:
    return worker.wait_push(begin_step(worker, ids, base_step))


def single_process(optimizers, batches: list[torch.Tensor], sparse: bool) -> torch.nn.Module:
    model = Ranker(sparse=sparse)
    built = optimizers(model)
    for ids in batches:
        for optimizer in built:
            optimizer.zero_grad()
        loss(model, ids).backward()
        for optimizer in built:
            optimizer.step()
    return model


def assert_trained_like(chief: ParameterClient, expected: torch.nn.Module) -> None:
    trained = fetch_state(chief).params
    for name, value in expected.state_dict().items():
        torch.testing.assert_close(trained[name], value, atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.parametrize("num_ps", [2, 3])
@pytest.mark.parametrize(
    ("spec", "dense"),
    [
        (SGD(lr=0.5), lambda params: torch.optim.SGD(params, lr=0.5)),
        (Adagrad(lr=0.3), lambda params: torch.optim.Adagrad(params, lr=0.3)),
    ],
    ids=["SGD", "Adagrad"],
)
def test_sparse_apply_equals_the_dense_apply_of_a_dense_table(start_cluster, num_ps, spec, dense):
    cluster = start_cluster(num_ps)
    chief, placement = start(cluster, spec, num_ps)
    assert len({p.ps for p in placement.pieces if p.name == "table.weight"}) == num_ps
    worker = cluster.client(Ranker(sparse=True), placement)
    for base_step, ids in enumerate(BATCHES):
        assert step(worker, ids, base_step).step == base_step + 1

    # A dense table with the dense optimizer: rows never looked up have zero gradients, which change nothing.
    expected = single_process(lambda m: [dense(m.parameters())], BATCHES, sparse=False)
    assert_trained_like(chief, expected)
    untouched = fetch_state(chief).params["table.weight"][30:]
    assert torch.equal(untouched, Ranker(sparse=True).table.weight.detach()[30:])


def test_adam_is_lazy_on_a_table_like_sparse_adam(start_cluster):
    cluster = start_cluster(2)
    chief, placement = start(cluster, Adam(lr=0.1), 2)
    worker = cluster.client(Ranker(sparse=True), placement)
    tables = []
    for base_step, ids in enumerate(BATCHES):
        step(worker, ids, base_step)
        tables.append(fetch_state(chief).params["table.weight"])

    def optimizers(model: torch.nn.Module) -> list[torch.optim.Optimizer]:
        net: Any = model
        return [torch.optim.SparseAdam([net.table.weight], lr=0.1), torch.optim.Adam(net.head.parameters(), lr=0.1)]

    assert_trained_like(chief, single_process(optimizers, BATCHES, sparse=True))
    # Row 5 was looked up in the first batch only: its moments are not decayed later, so it never moves again
    # (dense Adam would keep moving it on its first moment).
    assert not torch.equal(tables[0][5], Ranker(sparse=True).table.weight[5])
    assert all(torch.equal(table[5], tables[0][5]) for table in tables[1:])


def test_rows_looked_up_twice_in_a_batch_get_both_gradients(start_cluster):
    cluster = start_cluster(2)
    chief, placement = start(cluster, SGD(lr=1.0), 2)
    model = Ranker(sparse=True)
    worker = cluster.client(model, placement)
    before = model.table.weight.detach().clone()
    model.zero_grad(set_to_none=True)
    worker.begin_push(0)
    model.table(torch.tensor([3, 3, 3, 25])).sum().backward()
    worker.wait_push(worker.push(PushRequest()))
    after = fetch_state(chief).params["table.weight"]
    torch.testing.assert_close(after[3], before[3] - 3.0)
    torch.testing.assert_close(after[25], before[25] - 1.0)
    assert torch.equal(after[4], before[4])


def test_sync_sums_the_rows_of_both_workers_and_averages_like_one_large_batch(start_cluster):
    cluster = start_cluster(3)
    chief, placement = start(cluster, Adagrad(lr=0.3), 3, mode="sync", num_workers=2)
    workers = [cluster.client(Ranker(sparse=True), placement, worker_index=w) for w in range(2)]
    for base_step in range(2):
        # Both workers look up rows 1 and 5; each has its half of a batch of 4.
        halves = BATCHES[2 * base_step], BATCHES[2 * base_step + 1]
        requests = [begin_step(w, ids, base_step) for w, ids in zip(workers, halves, strict=True)]
        assert [w.wait_push(r).step for w, r in zip(workers, requests, strict=True)] == [base_step + 1] * 2

    model = Ranker(sparse=False)
    optimizer = torch.optim.Adagrad(model.parameters(), lr=0.3)
    for base_step in range(2):
        optimizer.zero_grad()
        ids = torch.cat([BATCHES[2 * base_step], BATCHES[2 * base_step + 1]])
        loss(model, ids, torch.cat([TARGETS, TARGETS])).backward()
        optimizer.step()
    assert_trained_like(chief, model)


def test_pulls_leave_the_table_out_and_a_step_moves_only_its_rows(start_cluster):
    cluster = start_cluster(2)
    model = Ranker(sparse=True, num_rows=10_000, dim=16)
    placement = place(model.named_parameters(), 2, Partitioner(fixed_shards=2), sparse_variables(model))
    init_servers(cluster.admin(model, placement), Adagrad(), ApplyConfig())
    worker = cluster.client(Ranker(sparse=True, num_rows=10_000, dim=16), placement)
    recorder = SpanRecorder("worker:0")
    set_recorder(recorder)
    try:
        worker.pull()
        step(worker, torch.tensor([[1, 2, 3], [9_000, 9_001, 1]]), 0)
    finally:
        set_recorder(None)
    spans = recorder.events(0, 1)
    pulled = sum(e["args"].get("bytes", 0) for e in spans if e["name"] == "pull_wait")
    pushed = sum(e["args"].get("bytes", 0) for e in spans if e["name"] == "push")
    # Pull and step: the head (17 floats) twice and 5 rows of 16 floats; the push adds 5 row numbers.
    assert pulled == 2 * 17 * 4 + 5 * 16 * 4
    assert pushed == 17 * 4 + 5 * 16 * 4 + 5 * 8
    # The pull, the rows (1-3 from one PS, 9000-9001 from the other) and the push's reply: each from both PS.
    assert sorted(e["args"]["ps"] for e in spans if e["name"] == "pull_wait") == [0, 0, 0, 1, 1, 1]


def test_a_restored_table_and_its_slots_are_cut_for_another_number_of_ps(start_cluster):
    two = start_cluster(2)
    chief, placement = start(two, Adagrad(lr=0.3), 2)
    worker = two.client(Ranker(sparse=True), placement)
    for base_step, ids in enumerate(BATCHES[:2]):
        step(worker, ids, base_step)
    saved = fetch_state(chief)
    assert set(saved.slots["sum"]) == {"table.weight", "head.weight", "head.bias"}

    three = start_cluster(3)
    model = Ranker(sparse=True)
    model.load_state_dict(saved.params)
    resharded = place(model.named_parameters(), 3, Partitioner(fixed_shards=3), sparse_variables(model))
    restored_chief = three.admin(model, resharded)
    init_servers(restored_chief, Adagrad(lr=0.3), ApplyConfig(), restore=saved)
    restored = fetch_state(restored_chief)
    assert restored.step == 2
    for key, by_name in saved.slots.items():
        for name, value in by_name.items():
            assert torch.equal(restored.slots[key][name], value), (key, name)

    # Training goes on as if never interrupted.
    step(worker, BATCHES[2], 2)
    new_worker = three.client(Ranker(sparse=True), resharded)
    new_worker.pull()
    step(new_worker, BATCHES[2], 2)
    for name, value in fetch_state(chief).params.items():
        torch.testing.assert_close(fetch_state(restored_chief).params[name], value, atol=1e-6, rtol=0, msg=name)


@pytest.mark.parametrize(
    ("spec", "named"),
    [
        (SGD(lr=0.1, momentum=0.9), "SGD with momentum=0.9"),
        (AdamW(), "AdamW"),
        (RMSprop(), "RMSprop"),
        (Adam(weight_decay=0.01), "Adam with weight_decay=0.01"),
        (Adagrad(weight_decay=0.01), "Adagrad with weight_decay=0.01"),
    ],
)
def test_an_optimizer_without_a_sparse_form_is_refused_at_start_naming_the_variable(cluster, spec, named):
    model = Ranker(sparse=True)
    placement = place(model.named_parameters(), 3, sparse=sparse_variables(model))
    with pytest.raises(ValueError, match=f"'table.weight' is row-sparse .* but {named} cannot apply sparse"):
        init_servers(cluster.admin(model, placement), spec, ApplyConfig())


def test_a_ps_answers_rows_outside_its_table_with_an_error(cluster):
    model = Ranker(sparse=True)
    placement = place(model.named_parameters(), 3, Partitioner(fixed_shards=3), sparse_variables(model))
    chief = cluster.admin(model, placement)
    init_servers(chief, SGD(), ApplyConfig())
    (table,) = placement.tables(0)
    num_rows = table.row_end - table.row_start
    with pytest.raises(CommError, match=f"row numbers from 0 to {num_rows} do not fit a table of {num_rows} rows"):
        chief.client.request("ps:0", Rows(table_indices=(0,)).header(), [torch.tensor([0, num_rows])], timeout_s=5)
    # The PS is still serving.
    assert chief.global_step() == 0


def test_a_push_with_rows_outside_the_table_is_refused_and_nothing_applied(start_cluster):
    cluster = start_cluster(1)
    chief, _ = start(cluster, SGD(), 1)
    head = [torch.zeros(4), torch.zeros(1)]  # head.weight and head.bias, the dense buffer's pieces
    rows, values = torch.tensor([0, NUM_ROWS]), torch.zeros(2, 4)
    header = Push(worker_index=0, local_step=1, base_step=0, frame_counts=(2,)).header()
    with pytest.raises(CommError, match=f"row numbers from 0 to {NUM_ROWS} do not fit a table of {NUM_ROWS} rows"):
        chief.client.request("ps:0", header, [*head, rows, values], timeout_s=5)
    assert chief.global_step() == 0
