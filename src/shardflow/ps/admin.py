"""The chief's requests to every PS: their status, snapshots for checkpoints, a worker lost, the end of training
and of the job. Initialising the PS and collecting their state is in train/checkpoints/servers.py."""

from __future__ import annotations

from shardflow.ps import protocol
from shardflow.ps.connection import PSConnection
from shardflow.ps.protocol import StatusReply

__all__ = ["PSAdmin", "StatusReply"]


class PSAdmin(PSConnection):
    """The chief's connection to every PS."""

    def status(self, timeout_s: float | None = None) -> list[StatusReply]:
        """Every PS's global step, snapshots held and counters, in PS order."""
        replies = self.exchange([protocol.Status()] * len(self.peers), timeout_s=timeout_s)
        return [StatusReply.decode(h, peer) for (h, _), peer in zip(replies, self.peers, strict=True)]

    def snapshot_at_furthest(self) -> int:
        """Every PS snapshots its state at one global step, the furthest PS's now; that step. As in `stop`, each
        first holds the workers' pushes and says its step, so none can pass the step asked for; the others snapshot
        once their held pushes bring them there."""
        step = self._hold()
        self.broadcast(protocol.SnapshotAt(step=step))
        return step

    def release_snapshots(self, through_step: int) -> None:
        """The snapshots up to `through_step` are saved; the PS may drop them."""
        self.broadcast(protocol.ReleaseSnapshots(through_step=through_step))

    def lost(self, worker_index: int) -> None:
        """Steps complete without this worker until it rejoins (lost_worker_policy "continue")."""
        self.broadcast(protocol.Lost(worker_index=worker_index))

    def stop(self) -> int:
        """End training now, at one global step on every PS; that step. Async PS may be a push apart (a worker's
        push reached one, not yet the other): so every PS first holds the workers' pushes and says its step, then
        all end at the furthest one's, the others applying the pushes it had. Then they drop later pushes and tell
        the workers to stop. Without this, each PS's checkpoint would be of another step."""
        step = self._hold()
        self.broadcast(protocol.Stop(step=step))
        return step

    def _hold(self) -> int:
        """Every PS holds the workers' pushes from now (protocol `Hold`): the furthest one's step, which none passes
        until the chief's next request names one step for all."""
        return max(reply.step for reply in self.broadcast(protocol.Hold()))

    def shutdown(self) -> None:
        """The job is over: every PS stops serving."""
        self.broadcast(protocol.Shutdown())
