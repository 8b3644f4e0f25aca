"""The chief's recovery from a lost PS converges when another PS is lost while it restores: it restores every PS
again, as many times as it takes, until no PS was restarted since; and during the final checkpoint too. A restore
tells the PS again what it does not carry: that training stopped, which workers are lost."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from shardflow.ps.replies import StatusReply
from shardflow.train.chief_loop import ChiefLoop
from shardflow.train.heartbeat import PSRestarted

NUM_PS = 2


class _Heartbeats:
    """Each round of checks (of ps:0, then ps:1) finds the PS of its set restarted."""

    def __init__(self, *rounds: set[str]) -> None:
        self.rounds = list(rounds)

    def check(self, name: str) -> bool:
        restarted = bool(self.rounds) and name in self.rounds[0]
        if name == f"ps:{NUM_PS - 1}" and self.rounds:
            self.rounds.pop(0)
        return restarted


class _Recovery:
    """Restores; the first `lost_again` restores end in PSRestarted, as when a PS dies during the chief's Init."""

    def __init__(self, lost_again: int) -> None:
        self.lost_again = lost_again
        self.generation = 0
        self.restored: list[str] = []

    def restore(self, lost: str, global_step: int) -> Any:
        self.generation += 1
        self.restored.append(lost)
        if self.lost_again:
            self.lost_again -= 1
            raise PSRestarted("ps:0 was restarted while the chief waited for it")
        return SimpleNamespace(step=16)


def _watch_servers(heartbeats: _Heartbeats, recovery: _Recovery, **state: Any) -> Any:
    """Run the chief's watch of the PS once, on a loop with `state` (preempted, lost workers); the loop after it."""
    loop: Any = ChiefLoop.__new__(ChiefLoop)  # only what _watch_servers reads
    loop.role, loop.heartbeats, loop.recovery = SimpleNamespace(num_ps=NUM_PS), heartbeats, recovery
    loop.global_step, loop.checkpoints = 40, SimpleNamespace(restored=lambda step: None)
    loop.workers, loop.told = ["worker:0", "worker:1"], []
    loop.preempted, loop.stopped_early = state.get("preempted", False), False
    heartbeats.lost = dict.fromkeys(state.get("lost", ()), 0.0)  # type: ignore[attr-defined]
    policy = "continue" if heartbeats.lost else "wait"  # type: ignore[attr-defined]
    loop.job = SimpleNamespace(strategy=SimpleNamespace(lost_worker_policy=policy))
    loop.client = SimpleNamespace(stop=lambda: loop.told.append("stop"), lost=lambda k: loop.told.append(f"lost {k}"))
    loop._watch_servers()
    return loop


def test_a_ps_lost_while_the_chief_restores_after_another_is_restored_again():
    recovery = _Recovery(lost_again=1)
    assert _watch_servers(_Heartbeats({"ps:1"}, {"ps:0"}), recovery).global_step == 16
    assert recovery.restored == ["ps:1", "ps:0"] and recovery.generation == 2


def test_a_ps_restarted_just_after_a_restore_is_restored_once_more():
    recovery = _Recovery(lost_again=0)
    assert _watch_servers(_Heartbeats({"ps:1"}, {"ps:0"}), recovery).global_step == 16
    assert recovery.restored == ["ps:1", "ps:0"]


def test_no_ps_restarted_no_restore():
    recovery = _Recovery(lost_again=0)
    assert _watch_servers(_Heartbeats(set()), recovery).global_step == 40
    assert recovery.restored == []


def test_a_restore_tells_every_ps_again_that_training_stopped_and_which_workers_are_lost():
    loop = _watch_servers(_Heartbeats({"ps:1"}), _Recovery(lost_again=0), preempted=True, lost=["worker:1", "ps:0"])
    assert loop.told == ["stop", "lost 1"]


def _status(initialized: bool) -> StatusReply:
    return StatusReply(step=64, stop=True, initialized=initialized, snapshots=(), stats={})


def _save_final(status: Any, save_final: Any = lambda preempted: ("state", "path")) -> Any:
    loop: Any = ChiefLoop.__new__(ChiefLoop)  # only what _save_final reads
    loop.client, loop.started, loop.preempted = SimpleNamespace(status=status), 0.0, False
    loop.checkpoints = SimpleNamespace(save_snapshots=lambda replies, evaluate: False, save_final=save_final)
    return loop._save_final()


def _restarted(*_: Any) -> Any:
    raise PSRestarted("ps:1 was restarted while the chief waited for it")


def test_a_ps_restarted_as_the_workers_finish_is_restored_before_the_final_checkpoint():
    assert _save_final(_restarted) is None
    # Restarted, and answering before the chief saw it beat: it holds nothing, so it is no final state either.
    assert _save_final(lambda: [_status(True), _status(False)]) is None
    assert _save_final(lambda: [_status(True), _status(True)]) == ("state", "path")


def test_a_ps_restarted_during_the_final_checkpoint_is_restored_and_the_checkpoint_saved_again_later():
    assert _save_final(lambda: [_status(True), _status(True)], save_final=_restarted) is None
