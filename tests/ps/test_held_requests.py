"""Requests a PS holds before answering (sync pushes, ssp pushes, pulls for a later step): bounded in number, each
with a deadline, and a pull for a step no job reaches refused at once; legitimate holds still work."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from shardflow.comm.client import Client
from shardflow.comm.errors import CommError
from shardflow.comm.server import Server
from shardflow.ps import protocol
from shardflow.ps.optimizers import SGD
from shardflow.ps.server import ParameterServer
from shardflow.ps.update_rules import MAX_PULL_AHEAD, ApplyConfig, Gradients, Refused, Updates


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class _Recorded:
    """Updates on a clock the test moves, with its updates and answers recorded."""

    def __init__(self, config: ApplyConfig) -> None:
        self.clock = _Clock()
        self.updates_applied: list[list[str]] = []
        self.answered: list[str] = []
        self.updates: Updates[str] = Updates(config, 0, self.apply, self.answer, clock=self.clock)

    def apply(self, gradients: Gradients, pushes: list[str]) -> None:
        self.updates_applied.append(pushes)

    def answer(self, pending: str, *, stale: bool = False, dropped: bool = False, nonfinite: int = 0) -> None:
        self.answered.append(pending)


def _gradients() -> Gradients:
    return Gradients([torch.ones(2)], [], [])


def test_a_held_pull_past_its_deadline_is_given_back_with_the_step_it_waited_for() -> None:
    recorded = _Recorded(ApplyConfig(num_workers=1, hold_timeout_s=30))
    recorded.updates.pull("pull at 5", min_step=5)
    recorded.clock.now += 29
    assert recorded.updates.expire() == []
    recorded.clock.now += 1
    assert recorded.updates.expire() == [("pull at 5", "held 30s waiting for global step 5; the PS is at 0")]
    recorded.updates.stop()  # nothing is held any more: nothing is answered twice
    assert recorded.answered == []


@pytest.mark.parametrize(
    ("max_steps", "min_step", "problem"),
    [
        (10, 11, "a pull for global step 11 waits for a step after max_steps=10"),
        (None, MAX_PULL_AHEAD + 1, f"waits for more than {MAX_PULL_AHEAD} steps; the PS is at 0"),
    ],
    ids=["after-max-steps", "too-far-ahead"],
)
def test_a_pull_for_a_step_no_job_reaches_is_refused_at_once(
    max_steps: int | None, min_step: int, problem: str
) -> None:
    recorded = _Recorded(ApplyConfig(num_workers=1, max_steps=max_steps))
    with pytest.raises(Refused, match=problem):
        recorded.updates.pull("far pull", min_step=min_step)
    recorded.updates.stop()
    assert recorded.answered == []  # it was never held


def test_one_pull_more_than_the_bound_is_refused_and_the_held_ones_stay() -> None:
    recorded = _Recorded(ApplyConfig(num_workers=1, max_held_requests=2))
    recorded.updates.pull("pull 1", min_step=1)
    recorded.updates.pull("pull 2", min_step=1)
    with pytest.raises(Refused, match=r"this PS holds 2 of its kind already.*max_held_requests"):
        recorded.updates.pull("pull 3", min_step=1)
    recorded.updates.push("push", 0, _gradients())
    assert recorded.answered == ["push", "pull 1", "pull 2"]


def test_the_default_bound_is_four_per_worker_and_sixteen_more() -> None:
    assert ApplyConfig(num_workers=3).held_limit == 28
    assert ApplyConfig(num_workers=3, max_held_requests=5).held_limit == 5


def test_held_pulls_do_not_crowd_out_sync_pushes() -> None:
    recorded = _Recorded(ApplyConfig(mode="sync", num_workers=2, max_held_requests=2))
    for index in range(2):
        recorded.updates.pull(f"pull {index}", min_step=1)
    with pytest.raises(Refused):
        recorded.updates.pull("pull 2", min_step=1)
    for worker in range(2):
        assert recorded.updates.admit(f"push {worker}", base_step=0, worker_index=worker)
        recorded.updates.push(f"push {worker}", worker, _gradients())
    assert recorded.answered == ["push 0", "push 1", "pull 0", "pull 1"]


def test_a_sync_push_beyond_the_bound_is_refused_before_it_is_summed() -> None:
    recorded = _Recorded(ApplyConfig(mode="sync", num_workers=3, max_held_requests=1))
    assert recorded.updates.admit("push 0", base_step=0, worker_index=0)
    recorded.updates.push("push 0", 0, _gradients())
    with pytest.raises(Refused, match="a sync push may have to be held, and this PS holds 1 of its kind already"):
        recorded.updates.admit("push 1", base_step=0, worker_index=1)
    recorded.updates.lost(2)  # the step completes with the replicas left
    assert (recorded.updates.step, recorded.updates_applied) == (0, [])
    recorded.updates.lost(1)
    assert (recorded.updates.step, recorded.updates_applied) == (1, [["push 0"]])


def test_an_expired_sync_push_is_answered_no_more_and_its_gradient_stays_in_its_step() -> None:
    recorded = _Recorded(ApplyConfig(mode="sync", num_workers=2))
    recorded.updates.push("push 0", 0, _gradients())
    recorded.clock.now += 60
    assert [pending for pending, _ in recorded.updates.expire()] == ["push 0"]
    recorded.updates.push("push 1", 1, _gradients())
    # The step averages both gradients and answers only the push still waiting: its worker had its step taken.
    assert (recorded.updates.step, recorded.updates_applied, recorded.answered) == (
        1,
        [["push 0", "push 1"]],
        ["push 1"],
    )


def test_an_expired_sync_push_says_how_many_of_its_step_arrived() -> None:
    recorded = _Recorded(ApplyConfig(mode="sync", num_workers=3, hold_timeout_s=5))
    recorded.updates.push("push 0", 0, _gradients())
    recorded.clock.now += 5
    ((pending, why),) = recorded.updates.expire()
    assert pending == "push 0"
    assert why == (
        "held 5s waiting for the other pushes of global step 1 (1 of 3 arrived; this one's gradient stays in it)"
    )


def test_an_expired_ssp_push_names_the_slowest_worker_it_waited_for() -> None:
    recorded = _Recorded(ApplyConfig(mode="ssp", num_workers=2, max_staleness=1, hold_timeout_s=5))
    for step in range(2):
        recorded.updates.push(f"worker 0 step {step}", 0, _gradients())
    recorded.clock.now += 5
    ((pending, why),) = recorded.updates.expire()
    assert pending == "worker 0 step 1"
    assert why == (
        "held 5s waiting for the slowest active worker (worker:1, at its step 0) to come within max_staleness=1 "
        "of this worker's step 2"
    )
    recorded.updates.push("worker 1 step 0", 1, _gradients())  # the slowest catches up: nothing left to answer
    assert recorded.answered == ["worker 0 step 0", "worker 1 step 0"]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"hold_timeout_s": 0}, "hold_timeout_s must be a positive number"),
        ({"hold_timeout_s": float("inf")}, "hold_timeout_s must be a positive number"),
        ({"max_held_requests": 0}, "max_held_requests must be an int >= 1 or None"),
        ({"max_held_requests": True}, "max_held_requests must be an int >= 1 or None"),
    ],
)
def test_invalid_hold_settings_are_refused_naming_the_field(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=f"ApplyConfig.{message}"):
        ApplyConfig(**kwargs)


# -- a live PS -------------------------------------------------------------------------------------------------


@pytest.fixture
def live_ps() -> Iterator[Client]:
    """A client of a PS serving in a thread (checking deadlines every 50 ms), which the client initialised."""
    ps = ParameterServer(Server("tcp://127.0.0.1:0"), 0)
    stop = threading.Event()
    thread = threading.Thread(target=ps.serve, kwargs={"should_stop": stop.is_set, "poll_s": 0.05}, daemon=True)
    thread.start()
    client = Client("chief")
    client.connect("ps:0", ps.server.address)
    apply = ApplyConfig(num_workers=1, hold_timeout_s=0.5, max_held_requests=2)
    init = protocol.Init(
        dtypes=("float32",), num_tables=0, optimizer=SGD(lr=0.1), apply=apply, step=0, frame_counts=(1,)
    )
    client.request("ps:0", init.header(), [torch.zeros(4)], timeout_s=5)
    yield client
    client.close()
    stop.set()
    thread.join(timeout=5)
    ps.server.close()


def test_a_live_ps_refuses_pulls_beyond_its_bound_answers_held_ones_at_their_deadline_and_keeps_serving(
    live_ps: Client,
) -> None:
    client = live_ps
    held = [client.send("ps:0", protocol.Pull(min_step=5).header()) for _ in range(2)]
    with pytest.raises(CommError, match=r"ps:0 refused 'pull': a pull for global step 5 may have to be held"):
        client.request("ps:0", protocol.Pull(min_step=5).header(), timeout_s=5)
    with pytest.raises(CommError, match=r"ps:0 refused 'pull': .* waits for more than"):
        client.request("ps:0", protocol.Pull(min_step=2**62).header(), timeout_s=5)
    for seq in held:
        with pytest.raises(CommError, match=r"ps:0 gave up on 'pull': held 0.5s waiting for global step 5; the PS"):
            client.recv("ps:0", seq, timeout_s=5)
    status = protocol.StatusReply.decode(client.request("ps:0", protocol.Status().header(), timeout_s=5)[0], "ps:0")
    assert (status.stats["refused"], status.stats["expired"]) == (2, 2)
    # A pull it can answer is answered at once, as ever.
    header, tensors = client.request("ps:0", protocol.Pull(min_step=0).header(), timeout_s=5)
    assert protocol.StepReply.decode(header, "pull", "ps:0").step == 0 and torch.equal(tensors[0], torch.zeros(4))
