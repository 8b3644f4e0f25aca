"""Restoring the PS: from the latest checkpoint when a job starts, and again, on every PS at once, when one PS was
lost and restarted while the job runs.

A PS holds the only copy of its shards and their optimizer slots, so when one is lost the steps since the latest
checkpoint are lost with it; the others cannot go on alone (their shards would part from its restored ones). The
chief restores every PS from that checkpoint, raising the recovery generation. Each PS gets back what it had of
each worker's steps (model_state.py `ps_progress`), the workers drop what they were doing and rejoin
(train/worker.py), and training goes on by itself: exactly the steps since the checkpoint are done again.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from shardflow.cluster import control_keys
from shardflow.ps.admin import PSAdmin
from shardflow.ps.update_rules import ApplyConfig
from shardflow.train import job_keys
from shardflow.train.checkpoints import store
from shardflow.train.checkpoints.model_state import ModelState
from shardflow.train.checkpoints.servers import TableSetup, init_servers
from shardflow.train.input import carry_over
from shardflow.train.job import JobConfig
from shardflow.train.job_keys import RecoveryNotice, RestoredPositions
from shardflow.train.role_context import RoleContext
from shardflow.train.strategy import Strategy

log = logging.getLogger(__name__)


def restore_latest(job: JobConfig[Strategy], model: torch.nn.Module, role: RoleContext) -> ModelState | None:
    """Load the latest checkpoint in model_dir into `model`; tell the workers where their input stood."""
    path = store.latest(job.model_dir)
    if path is None:
        return None
    state, manifest = store.load_state(path)
    model.load_state_dict(state.params)
    old_workers = int(manifest.get("num_workers", role.num_workers))
    if old_workers == role.num_workers and len(state.ps_progress) == role.num_ps:
        # Each PS gets back what it had of each worker's steps; the workers resume from those when they rejoin.
        log.info("restored %s at global step %d", path, state.step)
        return state
    state.ps_progress = []
    if old_workers != role.num_workers and state.iterators:
        state.iterators = carry_over(state.iterators, old_workers, role.num_workers)
        log.info(
            "restored %s written by %d workers into %d: the new workers first finish the old shards where they "
            "stopped, through epoch %d, then read their own shards",
            path,
            old_workers,
            role.num_workers,
            next(iter(state.iterators.values()))["epoch"] - 1,
        )
    role.control.put(job_keys.RESTORE_ITERATORS, RestoredPositions(positions=state.iterators))
    log.info("restored %s at global step %d", path, state.step)
    return state


@dataclass
class Recovery:
    """What the chief needs to restore every PS while the job runs."""

    job: JobConfig
    role: RoleContext
    client: PSAdmin
    model: torch.nn.Module
    apply: ApplyConfig
    initial: ModelState
    """The state the job started from: restored again when no checkpoint was written since."""
    generation: int = 0

    def restore(self, lost: str, global_step: int) -> ModelState:
        """Restore every PS from the latest checkpoint (or the job's start) after `lost` was restarted, at
        about `global_step`; returns the state restored."""
        started = time.monotonic()
        self.generation += 1
        restored = restore_latest(self.job, self.model, self.role)
        state = restored if restored is not None else self.initial
        if restored is None:
            self.model.load_state_dict(state.params)
        # The workers stop waiting for replies that the lost PS will never send, and rejoin once every PS has
        # this generation; a push of the training before is refused by a restored PS.
        self.role.control.put(job_keys.RECOVERY, RecoveryNotice(generation=self.generation, step=state.step, lost=lost))
        strategy = self.job.strategy
        control = self.role.control
        addresses = [
            control.endpoint(control_keys.ps_endpoint(k), waiting_for=f"ps:{k} to serve")
            for k in range(self.role.num_ps)
        ]
        self.client.reconnect(addresses)
        init_servers(
            self.client,
            self.job.optimizer,
            self.apply,
            state,
            timeout_s=strategy.startup_timeout_s,
            generation=self.generation,
            tables=TableSetup.of(self.model, self.job.model_dir, self.job.full_checkpoint_every),
        )
        log.warning(
            "%s was lost and restarted: every PS restored to global step %d (%s); the %d steps since are done "
            "again; restored in %.1fs",
            lost,
            state.step,
            "the latest checkpoint" if restored is not None else "the start of this run",
            max(global_step - state.step, 0),
            time.monotonic() - started,
        )
        return state
