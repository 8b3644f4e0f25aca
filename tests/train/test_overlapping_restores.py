"""The chief's recovery from a lost PS converges when another PS is lost while it restores: it restores every PS
again, as many times as it takes, until no PS was restarted since; and before the final checkpoint too."""

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


def _watch_servers(heartbeats: _Heartbeats, recovery: _Recovery) -> int:
    """Run the chief's watch of the PS once; the global step it ends at."""
    loop: Any = ChiefLoop.__new__(ChiefLoop)  # only what _watch_servers reads
    loop.role, loop.heartbeats, loop.recovery = SimpleNamespace(num_ps=NUM_PS), heartbeats, recovery
    loop.global_step, loop.checkpoints = 40, SimpleNamespace(restored=lambda step: None)
    loop._watch_servers()
    return int(loop.global_step)


def test_a_ps_lost_while_the_chief_restores_after_another_is_restored_again():
    recovery = _Recovery(lost_again=1)
    assert _watch_servers(_Heartbeats({"ps:1"}, {"ps:0"}), recovery) == 16
    assert recovery.restored == ["ps:1", "ps:0"] and recovery.generation == 2


def test_a_ps_restarted_just_after_a_restore_is_restored_once_more():
    recovery = _Recovery(lost_again=0)
    assert _watch_servers(_Heartbeats({"ps:1"}, {"ps:0"}), recovery) == 16
    assert recovery.restored == ["ps:1", "ps:0"]


def test_no_ps_restarted_no_restore():
    recovery = _Recovery(lost_again=0)
    assert _watch_servers(_Heartbeats(set()), recovery) == 40
    assert recovery.restored == []


def _status(initialized: bool) -> StatusReply:
    return StatusReply(step=64, stop=True, initialized=initialized, snapshots=(), stats={})


def _final_status(status: Any) -> list[StatusReply] | None:
    loop: Any = ChiefLoop.__new__(ChiefLoop)  # only what _final_status reads
    loop.client = SimpleNamespace(status=status)
    return loop._final_status()


def test_a_ps_restarted_as_the_workers_finish_is_restored_before_the_final_checkpoint():
    def restarted() -> list[StatusReply]:
        raise PSRestarted("ps:1 was restarted while the chief waited for it")

    assert _final_status(restarted) is None
    # Restarted, and answering before the chief saw it beat: it holds nothing, so it is no final state either.
    assert _final_status(lambda: [_status(True), _status(False)]) is None
    assert _final_status(lambda: [_status(True), _status(True)]) == [_status(True), _status(True)]
