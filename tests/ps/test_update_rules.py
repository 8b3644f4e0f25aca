"""The update rule: declared once for the strategy and the PS, and applied by ps/update_rules.py's Updates."""

from __future__ import annotations

import pytest
import torch

from shardflow.ps.client import PushRequest
from shardflow.ps.optimizers import SGD
from shardflow.ps.placement import place
from shardflow.ps.update_rules import ApplyConfig, Gradients, UpdateRule, Updates
from shardflow.train.checkpoints.servers import fetch_state, init_servers
from shardflow.train.strategy import ParameterServerStrategy


@pytest.mark.parametrize("config", [ParameterServerStrategy, ApplyConfig])
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"mode": "eventually"}, "mode must be one of"),
        ({"replicas_to_aggregate": 0}, "replicas_to_aggregate must be an int >= 1"),
        ({"max_staleness": -1}, "max_staleness must be an int >= 0"),
        ({"max_staleness": True}, "max_staleness must be an int >= 0"),
    ],
)
def test_an_invalid_update_rule_is_refused_naming_the_class_it_was_given_to(config, kwargs, message):
    with pytest.raises(ValueError, match=f"^{config.__name__}.{message}"):
        config(**kwargs)


def test_the_strategy_and_the_apply_config_are_the_same_update_rule():
    strategy = ParameterServerStrategy(num_ps=2, mode="ssp", max_staleness=3)
    assert isinstance(strategy, UpdateRule) and issubclass(ApplyConfig, UpdateRule)
    assert (strategy.mode, strategy.replicas_to_aggregate, strategy.max_staleness) == ("ssp", None, 3)


def test_apply_config_round_trips_through_json():
    config = ApplyConfig(mode="sync", num_workers=3, replicas_to_aggregate=2, max_steps=9, snapshot_every_n_steps=3)
    assert ApplyConfig.from_json(config.to_json()) == config


class _Recorded:
    """Updates' two callbacks, recorded: the pushes of each update, and each answer with its flags."""

    def __init__(self, config: ApplyConfig, step: int = 0) -> None:
        self.updates_applied: list[list[str]] = []
        self.answers: list[tuple[str, bool, bool]] = []
        self.refusals: list[tuple[str, int]] = []
        self.updates: Updates[str] = Updates(config, step, self.apply, self.answer)

    def apply(self, gradients: Gradients, pushes: list[str]) -> None:
        self.updates_applied.append(pushes)

    def answer(self, pending: str, *, stale: bool = False, dropped: bool = False, nonfinite: int = 0) -> None:
        if nonfinite:
            self.refusals.append((pending, nonfinite))
        else:
            self.answers.append((pending, stale, dropped))


def _gradients() -> Gradients:
    return Gradients([torch.ones(2)], [], [])


def test_a_refused_push_is_answered_at_once_counted_per_worker_and_is_not_a_replica():
    recorded = _Recorded(ApplyConfig(mode="sync", num_workers=2))
    updates = recorded.updates
    updates.push("w0", 0, _gradients())
    updates.refuse("w1-nan", 1)
    updates.refuse("w1-nan-again", 1)
    assert (updates.step, recorded.updates_applied) == (0, [])
    assert recorded.refusals == [("w1-nan", 1), ("w1-nan-again", 2)]
    updates.push("w1", 1, _gradients())
    assert (updates.step, recorded.updates_applied) == (1, [["w0", "w1"]])
    assert (updates.stats["applied"], updates.stats["nonfinite"], updates.stats["nonfinite/worker:1"]) == (1, 2, 2)


def test_sync_applies_one_update_once_enough_replicas_pushed_and_drops_a_stale_one():
    recorded = _Recorded(ApplyConfig(mode="sync", num_workers=3, replicas_to_aggregate=2))
    updates = recorded.updates
    for worker in range(2):
        assert updates.admit(f"push {worker}", base_step=0, worker_index=worker)
        updates.push(f"push {worker}", worker, _gradients())
    assert not updates.admit("late push 2", base_step=0, worker_index=2)
    assert recorded.updates_applied == [["push 0", "push 1"]]
    assert recorded.answers == [("push 0", False, False), ("push 1", False, False), ("late push 2", True, False)]
    assert (updates.step, updates.stats["dropped_stale"]) == (1, 1)


def test_ssp_holds_a_worker_too_far_ahead_until_the_slowest_catches_up():
    recorded = _Recorded(ApplyConfig(mode="ssp", num_workers=2, max_staleness=1))
    updates = recorded.updates
    for step in range(2):
        updates.push(f"worker 0 step {step}", 0, _gradients())
    assert [pending for pending, _, _ in recorded.answers] == ["worker 0 step 0"]
    updates.push("worker 1 step 0", 1, _gradients())
    assert [pending for pending, _, _ in recorded.answers] == ["worker 0 step 0", "worker 0 step 1", "worker 1 step 0"]


def test_a_pull_waits_for_its_min_step_and_stop_answers_it():
    recorded = _Recorded(ApplyConfig(mode="async", num_workers=1))
    recorded.updates.pull("pull at 2", min_step=2)
    recorded.updates.push("push", 0, _gradients())
    assert [pending for pending, _, _ in recorded.answers] == ["push"]
    recorded.updates.stop()
    assert recorded.answers[-1] == ("pull at 2", False, False)
    assert not recorded.updates.admit("push after stop", base_step=1, worker_index=0)
    assert recorded.answers[-1] == ("push after stop", False, True)


def test_fetch_state_returns_the_state_and_leaves_the_model_as_it_is(cluster):
    model = torch.nn.Linear(2, 1)
    placement = place(model.named_parameters(), 3)
    chief = cluster.admin(model, placement)
    init_servers(chief, SGD(lr=1.0), ApplyConfig(num_workers=1))
    worker_model = torch.nn.Linear(2, 1)
    worker = cluster.client(worker_model, placement)
    worker.pull()
    worker.begin_push(0)
    worker_model(torch.ones(1, 2)).sum().backward()
    worker.wait_push(worker.push(PushRequest()))
    before = {name: p.detach().clone() for name, p in model.named_parameters()}

    state = fetch_state(chief)

    for name, param in model.named_parameters():
        assert torch.equal(param.detach(), before[name]), name
        torch.testing.assert_close(state.params[name], before[name] - 1.0)
    assert state.step == 1
