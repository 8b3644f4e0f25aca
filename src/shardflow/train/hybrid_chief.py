"""The chief of `sf.HybridStrategy`: the all-reduce chief (train/allreduce_chief.py) that also initialises the PS
holding the model's `sf.nn` tables (fresh, or from the latest checkpoint's rows, on any number of PS), saves with
each state worker:0 hands over the rows every PS snapshotted at that step, evaluates with those rows, and ends the
PS with the job."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from shardflow.cluster import control_keys
from shardflow.cluster.launcher import RoleExit
from shardflow.comm.client import Client
from shardflow.comm.errors import CommError
from shardflow.comm.security import job_credentials
from shardflow.nn.modules import table_specs
from shardflow.ps import protocol
from shardflow.ps.admin import PSAdmin
from shardflow.ps.placement import place
from shardflow.ps.update_rules import ApplyConfig
from shardflow.train import job_keys
from shardflow.train.allreduce_chief import _Chief, _Start, _Watch, run_allreduce_chief
from shardflow.train.checkpoints import store
from shardflow.train.checkpoints.model_state import ModelState
from shardflow.train.checkpoints.restore import restore_latest
from shardflow.train.checkpoints.saved_tables import saved_tables
from shardflow.train.checkpoints.servers import TableSetup, init_servers
from shardflow.train.job import JobConfig, RoleFailedError
from shardflow.train.job_keys import HybridRecovery, HybridRestart, StateNotice
from shardflow.train.preemption import Preemption
from shardflow.train.profiling import ChiefProfiler
from shardflow.train.role_context import RoleContext
from shardflow.train.specs import TrainResult
from shardflow.train.strategy import AllReduceStrategy, HybridStrategy

log = logging.getLogger(__name__)


def run_hybrid_chief(
    job: JobConfig[AllReduceStrategy],
    role: RoleContext,
    *,
    failures: Sequence[RoleExit] = (),
    preemption: Preemption | None = None,
) -> TrainResult:
    """Run the job to its end, as the all-reduce chief with the tables on the PS."""
    return run_allreduce_chief(job, role, failures=failures, preemption=preemption, chief_class=_HybridChief)


class _PSLost(Exception):
    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name


class _HybridChief(_Chief):
    """The all-reduce chief, with the PS of the tables: initialised at its start, their snapshots saved and
    evaluated with each state, ended with the job."""

    def __init__(
        self,
        job: JobConfig[AllReduceStrategy],
        role: RoleContext,
        model: torch.nn.Module,
        watch: _Watch,
        start: _Start,
        profiler: ChiefProfiler,
    ) -> None:
        super().__init__(job, role, model, watch, start, profiler)
        strategy = job.strategy
        assert isinstance(strategy, HybridStrategy)

        self.table_specs = tuple(table_specs(model))
        if not self.table_specs:
            raise ValueError("HybridStrategy: the model has no sf.nn tables to put on the PS; use sf.AllReduceStrategy")
        control = role.control
        placement = place([], role.num_ps)  # no dense variable on the PS: the workers all-reduce them
        addresses = [
            control.endpoint(control_keys.ps_endpoint(k), waiting_for=f"ps:{k} to start") for k in range(role.num_ps)
        ]
        client = Client("chief", credentials=job_credentials())
        self.ps_pids: dict[str, str] = {}
        """Each PS's process as its heartbeat names it: another one there is a PS lost and restarted."""
        self.retired_pids: set[str] = set()
        """Processes of PS replaced before a restore reached their successors: their beats are stale."""
        self.admin = PSAdmin(
            client, addresses, placement, model, timeout_s=strategy.request_timeout_s, interrupt=self._raise_if_lost
        )
        self.apply = ApplyConfig(
            mode=strategy.sparse_mode,
            num_workers=role.num_workers,
            max_staleness=strategy.max_staleness,
            max_steps=None,  # the PS count the tables' updates; the workers end training
            hold_timeout_s=strategy.request_timeout_s,
            pushes_carry_global_step=True,
        )
        self.generation = 0
        """How many times every PS was restored after one was lost."""
        self.recovery: tuple[str, float] | None = None
        """While the workers stop after a PS was lost: which one, and since when."""
        self.discarded: ModelState | None = None
        """A state handed over before the PS were restored: neither saved nor evaluated."""
        if start.adopted:
            self._adopt()
        else:
            self._initialise(start.restored)
        control.put(job_keys.PLACEMENT, placement)
        self.manifest.update(num_ps=role.num_ps, sparse_mode=strategy.sparse_mode)
        self.snapshot_held: int | None = None
        """The PS's snapshot of the last state collected, released once the next one is (it was evaluated)."""

    def _adopt(self) -> None:
        """A restarted chief over the live group: the PS hold its tables now, as every PS was last restored."""
        replies = self.admin.status(timeout_s=self.job.strategy.startup_timeout_s)
        self.generation = max(reply.generation for reply in replies)
        lost = [peer for peer, reply in zip(self.admin.peers, replies, strict=True) if not reply.initialized]
        if lost:  # restarted with this chief: as a PS lost alone, every PS and worker go back to the checkpoint
            log.warning("the chief was restarted while %s was too", ", ".join(lost))
            self._begin_recovery(lost[0])
            return
        if self.generation:  # a worker restarted from now on names its snapshots in this generation
            recovery = HybridRecovery(generation=self.generation, lost="a parameter server")
            self.role.control.put(job_keys.HYBRID_RECOVERY, recovery)
        log.warning("the chief was restarted: adopted the live parameter servers (recovery %d)", self.generation)

    def _initialise(self, state: ModelState | None) -> None:
        """Every PS with the tables of `state` (a checkpoint's), or made afresh (None)."""
        # The workers' own step counts of another run mean nothing to this one's (each push carries global step + 1).
        start = dataclasses.replace(state, ps_progress=[]) if state is not None else None
        init_servers(
            self.admin,
            self.job.optimizer,
            self.apply,
            start,
            timeout_s=self.job.strategy.startup_timeout_s,
            generation=self.generation,
            tables=TableSetup.of(self.model, self.job.model_dir, self.job.full_checkpoint_every),
        )
        # The processes it reached: one restarted meanwhile (beating from a new pid since) was initialised by it, and
        # is not lost.
        replies = self.admin.status(timeout_s=self.job.strategy.request_timeout_s)
        reached = {f"ps:{k}": str(reply.pid) for k, reply in enumerate(replies)}
        self.retired_pids |= set(self.ps_pids.values()) - set(reached.values())
        self.ps_pids = reached

    def _collect(self, n: int, notice: StateNotice) -> ModelState | None:
        state = super()._collect(n, notice)
        if state is None:  # worker:0 was lost amid its stream: it sends it again
            return None
        if self.recovery is None:
            try:
                return self._with_tables(n, state)
            except _PSLost as lost:
                self._begin_recovery(lost.name)
        # Of the training before the PS are restored (the final one too: the workers train on from the restore).
        self.discarded = state
        return state

    def _with_tables(self, n: int, state: ModelState) -> ModelState:
        """`state` with the rows every PS snapshotted at its step, for worker:0's hand-over n."""
        control = self.role.control
        key = job_keys.hybrid_snapshot(self.generation, n)
        snapshot = control.read(key, waiting_for="worker:0's snapshot of the sf.nn tables")
        if n > 1:  # every worker has read it: each put its position of state n after
            control.delete(job_keys.hybrid_snapshot(self.generation, n - 1).name)
        replies = self.admin.exchange([protocol.GetState(snapshot_step=snapshot.step)] * len(self.admin.peers))
        for (header, _), peer in zip(replies, self.admin.peers, strict=True):
            reply = protocol.StateReply.decode(header, peer)
            state.table_files += reply.table_files
            if reply.table_error is not None:
                state.table_errors.append(reply.table_error)
            state.stats[peer] = {"step": reply.step, **reply.stats}
        self._release()
        self.snapshot_held = snapshot.step
        return state

    def _release(self) -> None:
        if self.snapshot_held is not None:
            self.admin.release_snapshots(self.snapshot_held)
            self.snapshot_held = None

    def capture_roles(self) -> list[str]:
        """The workers' and the PS's: a PS records its spans at the workers' global step its pushes carry."""
        return [*super().capture_roles(), *self.admin.peers]

    def _save(self, state: ModelState, *, final: bool) -> Path | None:
        return None if state is self.discarded else super()._save(state, final=final)

    def evaluate(self, state: ModelState) -> dict[str, float]:
        if state is self.discarded:
            return {}
        with saved_tables(self.model, state, self.job.model_dir):
            return super().evaluate(state)

    def _watch(self, preemption: Preemption) -> None:
        """As the all-reduce chief's; and a PS lost (restarted, its heartbeat from another process): every worker
        stops, every PS is restored from the latest checkpoint, and the workers go on from it."""
        if self.recovery is None:
            try:
                self._raise_if_lost()
            except _PSLost as lost:
                self._begin_recovery(lost.name)
        if self.recovery is None and self.role.control.is_set(job_keys.hybrid_workers_lost(self.generation)):
            self._begin_recovery("every worker")
        if self.recovery is not None:
            self._restart_when_stopped()
        super()._watch(preemption)

    def _raise_if_lost(self) -> None:
        """Raise _PSLost naming a PS whose heartbeat comes from another process than before."""
        for k in range(self.role.num_ps):
            name = f"ps:{k}"
            beat = self.role.control.get_if_set(control_keys.heartbeat(name))
            pid = (beat or b"").decode().partition(":")[0]
            if pid in self.retired_pids:
                continue  # the last beat of a process replaced before the last restore reached its successor
            if pid and self.ps_pids.setdefault(name, pid) != pid:
                self.ps_pids[name] = pid
                raise _PSLost(name)

    def _begin_recovery(self, lost: str) -> None:
        """Every worker stops where it is (hybrid_worker.py `_roll_back`)."""
        self.generation += 1
        self.recovery = (lost, time.monotonic())
        self.role.control.put(job_keys.HYBRID_RECOVERY, HybridRecovery(generation=self.generation, lost=lost))
        gone = "the dense state" if lost == "every worker" else "its rows"
        log.warning(
            "%s was lost: %s since the latest checkpoint are gone; every worker and every PS go back to it", lost, gone
        )

    def _restart_when_stopped(self) -> None:
        """Once every worker stopped (and no state of before is handed over still): every PS restored from the
        latest checkpoint, and the workers told the state to go on from."""
        assert self.recovery is not None
        lost, since = self.recovery
        control, strategy, n = self.role.control, self.job.strategy, self.awaited
        stopped = job_keys.hybrid_stopped
        missing = [name for name in self.watch.workers if not control.is_set(stopped(self.generation, name))]
        if missing:
            limit_s = strategy.worker_rejoin_timeout_s + strategy.request_timeout_s
            if time.monotonic() - since > limit_s:
                raise RoleFailedError(f"{', '.join(missing)} did not stop within {limit_s:g}s after {lost} was lost")
            return
        if control.is_set(job_keys.allreduce_checkpoint(n).name):
            return  # handed over before the worker stopped: the chief's loop collects (and drops) it first
        for name in self.watch.workers:  # put before some worker stopped, for a state that never came
            control.delete(job_keys.allreduce_position(n, name).name)
        self.snapshot_held = None  # gone with the PS's state
        state = restore_latest(self.job, self.model, self.role)
        latest = store.latest(self.job.model_dir) if state is not None else None
        self._restore(state)
        restart = HybridRestart(
            step=state.step if state else 0,
            checkpoint=latest.name if latest is not None else None,
            positions=state.iterators if state else {},
            next_hand_over=n,
        )
        control.put(job_keys.hybrid_restart(self.generation), restart)
        self.recovery = None
        log.warning("every PS restored to global step %d after %s was lost; the workers go on", restart.step, lost)

    def _restore(self, state: ModelState | None) -> None:
        """Every PS initialised with `state`; again, while one is lost meanwhile (restarted: another process)."""
        control = self.role.control
        while True:
            addresses = [
                control.endpoint(control_keys.ps_endpoint(k), waiting_for=f"ps:{k} to start")
                for k in range(self.role.num_ps)
            ]
            self.admin.reconnect(addresses)  # a restarted PS serves elsewhere
            try:
                self._initialise(state)
                return
            except _PSLost as again:
                log.warning("%s was lost again during the restore; every PS is restored again", again)

    def close(self) -> None:
        try:
            self.admin.shutdown()
        except CommError as error:
            log.info("the parameter servers did not all answer the end of the job: %s", error)
        finally:
            self.admin.client.close()
            super().close()
