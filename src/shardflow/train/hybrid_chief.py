"""The chief of `sf.HybridStrategy`: the all-reduce chief (train/allreduce_chief.py) that also initialises the PS
holding the model's `sf.nn` tables (fresh, or from the latest checkpoint's rows, on any number of PS), saves with
each state worker:0 hands over the rows every PS snapshotted at that step, evaluates with those rows, and ends the
PS with the job."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

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
from shardflow.train.allreduce_chief import _Chief, _Watch, run_allreduce_chief
from shardflow.train.checkpoints.model_state import ModelState
from shardflow.train.checkpoints.saved_tables import saved_tables
from shardflow.train.checkpoints.servers import TableSetup, init_servers
from shardflow.train.job import JobConfig, RoleFailedError
from shardflow.train.job_keys import StateNotice
from shardflow.train.preemption import Preemption
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


class _HybridChief(_Chief):
    """The all-reduce chief, with the PS of the tables: initialised at its start, their snapshots saved and
    evaluated with each state, ended with the job."""

    def __init__(
        self,
        job: JobConfig[AllReduceStrategy],
        role: RoleContext,
        model: torch.nn.Module,
        watch: _Watch,
        start_step: int,
        start_chunks: int,
        restored: ModelState | None,
    ) -> None:
        super().__init__(job, role, model, watch, start_step, start_chunks, restored)
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
        self.admin = PSAdmin(client, addresses, placement, model, timeout_s=strategy.request_timeout_s)
        apply = ApplyConfig(
            mode=strategy.sparse_mode,
            num_workers=role.num_workers,
            max_staleness=strategy.max_staleness,
            max_steps=None,  # the PS count the tables' updates; the workers end training
            hold_timeout_s=strategy.request_timeout_s,
        )
        # The workers' own step counts of another run mean nothing to this one's (each push carries global step + 1).
        start = dataclasses.replace(restored, ps_progress=[]) if restored is not None else None
        init_servers(
            self.admin,
            job.optimizer,
            apply,
            start,
            timeout_s=strategy.startup_timeout_s,
            tables=TableSetup.of(model, job.model_dir, job.full_checkpoint_every),
        )
        control.put(job_keys.PLACEMENT, placement)
        self.manifest.update(num_ps=role.num_ps, sparse_mode=strategy.sparse_mode)
        self.snapshot_held: int | None = None
        """The PS's snapshot of the last state collected, released once the next one is (it was evaluated)."""
        self.ps_pids: dict[str, str] = {}

    def _collect(self, n: int, notice: StateNotice) -> ModelState:
        state = super()._collect(n, notice)
        control = self.role.control
        snapshot = control.read(job_keys.hybrid_snapshot(n), waiting_for="worker:0's snapshot of the sf.nn tables")
        if n > 1:  # every worker has read it: each put its position of state n after
            control.delete(job_keys.hybrid_snapshot(n - 1).name)
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

    def evaluate(self, state: ModelState) -> dict[str, float]:
        with saved_tables(self.model, state, self.job.model_dir):
            return super().evaluate(state)

    def _watch(self, preemption: Preemption) -> None:
        """As the all-reduce chief's, and a PS restarted (its heartbeat from another process) fails the job: its
        rows since the last checkpoint are gone, and this strategy does not restore the PS yet."""
        for k in range(self.role.num_ps):
            name = f"ps:{k}"
            beat = self.role.control.get_if_set(control_keys.heartbeat(name))
            pid = (beat or b"").decode().partition(":")[0]
            if pid and self.ps_pids.setdefault(name, pid) != pid:
                raise RoleFailedError(
                    f"{name} was lost and restarted: HybridStrategy does not restore the parameter servers after a "
                    "loss yet; run the job again to resume from its last checkpoint"
                )
        super()._watch(preemption)

    def close(self) -> None:
        try:
            self.admin.shutdown()
        except CommError as error:
            log.info("the parameter servers did not all answer the end of the job: %s", error)
        finally:
            self.admin.client.close()
            super().close()
