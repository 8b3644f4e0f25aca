"""A worker of `sf.HybridStrategy`: an all-reduce worker (train/allreduce_worker.py) whose model's `sf.nn` tables
live on the PS. Each step looks its batch's rows up on the PS, pushes their gradients to the PS (and waits for
every PS to take them) before it all-reduces the dense gradients with the other workers: so once a global step's
all-reduce is done, every worker's rows of it are with the PS.

Each push carries the global step + 1 as the worker's local step: a step the group dropped and trains again (a
worker was lost) pushes the same one, and a PS that had it takes it once (ps/server.py `_repeated`). For a
checkpoint, worker:0 has every PS snapshot its tables while no worker pushes past that step (the others wait for
its `hybrid/snapshot/<n>` before their next push); the chief saves those rows with the dense state."""

from __future__ import annotations

import time
from typing import Any

import torch

from shardflow.cluster import control_keys
from shardflow.cluster.control_keys import Key
from shardflow.comm.client import Client
from shardflow.comm.security import job_credentials
from shardflow.data.torch_edge import to_torch
from shardflow.nn import backend
from shardflow.profile.recorder import SpanRecorder
from shardflow.ps import protocol
from shardflow.ps.client import ParameterClient, PushRequest
from shardflow.ps.protocol import StatusReply
from shardflow.train import job_keys
from shardflow.train.allreduce_worker import JobAborted, _Trainer, run_allreduce_worker
from shardflow.train.input import InputPosition, Lookahead
from shardflow.train.job import JobConfig
from shardflow.train.job_keys import TablesSnapshot
from shardflow.train.profiling import RoleProfiler
from shardflow.train.role_context import RoleContext
from shardflow.train.strategy import AllReduceStrategy, HybridStrategy


def run_hybrid_worker(job: JobConfig[AllReduceStrategy], role: RoleContext) -> None:
    """The worker's main, as an all-reduce worker's with its tables on the PS."""
    run_allreduce_worker(job, role, _HybridTrainer)


class _HybridTrainer(_Trainer):
    """An all-reduce worker's run whose `sf.nn` lookups and row gradients go to the PS."""

    def __init__(
        self,
        job: JobConfig[AllReduceStrategy],
        role: RoleContext,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        start_position: dict[str, Any] | None,
        step: int,
        generation: int,
    ) -> None:
        assert isinstance(job.strategy, HybridStrategy)
        self.sync = job.strategy.sparse_mode == "sync"
        self.told_done = False
        self.snapshot_due: Key[TablesSnapshot] | None = None
        """A non-leader's: the snapshot of the last hand-over, to wait for before its next push."""
        """Whether the PS were told this worker's input is done (sync: they no longer wait for its rows)."""
        self.params = _connect(job, role, model, self._interrupt)
        try:
            super().__init__(job, role, model, optimizer, start_position, step, generation)
        except BaseException:
            self.params.close()
            raise
        # Read one batch ahead: its rows are looked up while this step computes.
        if isinstance(self.position, InputPosition):
            self.position = Lookahead(self.position, to_torch)

    def run(self, profiler: RoleProfiler) -> None:
        try:
            assert self.params.tables is not None
            with backend.installed(self.params.tables):
                self.train(profiler)
        finally:
            self.params.close()

    def _interrupt(self) -> None:
        """Between slices of a wait for a PS: the job ended, or a worker of the group was lost (sync: the PS wait
        for its rows of the step, which it pushes again once restarted and the group formed again)."""
        if self.role.control.is_set(control_keys.SHUTDOWN):
            raise JobAborted(f"{self.name}: the chief ended the job while this worker waited for a parameter server")
        peers = getattr(self, "peers", None)
        if peers is not None:
            peers.check("the parameter servers to take its table rows")

    def _forward_backward(self, batch: Any, recorder: SpanRecorder) -> float:
        params = self.params
        params.local_step = self.step  # begin_push counts this step's: global step + 1, the same when trained again
        if self.sync:
            params.assume_steps(self.step)
        params.begin_push(self.step)
        tables = params.tables
        assert tables is not None
        tables.set_batch(batch)
        upcoming = self.position.peek() if isinstance(self.position, Lookahead) else None
        if upcoming is not None:
            # Sync: the rows once this step's are applied; async: as they are when the lookup arrives.
            tables.prefetch(upcoming, [self.step + 1 if self.sync else 0] * len(params.peers))
        return super()._forward_backward(batch, recorder)

    def _collective(self, had_batch: bool, mine: list[float], recorder: SpanRecorder) -> list[float]:
        """The rows' gradients to every PS, taken, before the dense all-reduce. A worker without a batch pushes
        nothing; in sync mode it tells the PS once that its input is done, so that they apply the others' rows."""
        if had_batch:
            self._await_snapshot()
            schedule = self.job.optimizer.schedule
            learning_rate = self.job.optimizer.learning_rate(self.step) if schedule and schedule.from_workers else None
            pushed = self.params.push(PushRequest(learning_rate=learning_rate))
            self.params.wait_push(pushed, load_params=False)
        elif self.sync and not self.told_done:
            self.params.done()
            self.told_done = True
        return super()._collective(had_batch, mine, recorder)

    def _hand_over(self, *, final: bool, checkpoint: bool, again: bool = False) -> None:
        """As an all-reduce worker's, with the tables' rows of the same step: worker:0 has every PS snapshot them
        first, and the others push again only once they are."""
        n = self.checkpoints + (0 if again else 1)
        key = job_keys.hybrid_snapshot(n)
        control = self.role.control
        if self.leader and not control.is_set(key.name):
            control.put(key, TablesSnapshot(step=_snapshot(self.params)))
        super()._hand_over(final=final, checkpoint=checkpoint, again=again)
        if not self.leader:
            self.snapshot_due = key

    def _await_snapshot(self) -> None:
        """Wait for worker:0's snapshot of the last hand-over before pushing past it; a worker of the group lost
        meanwhile raises PeerLostError (the group is formed again, and a restarted worker:0 takes the snapshot)."""
        key, self.snapshot_due = self.snapshot_due, None
        if key is None:
            return
        strategy = self.job.strategy
        limit_s = strategy.worker_rejoin_timeout_s + strategy.request_timeout_s
        deadline = time.monotonic() + limit_s
        while not self.role.control.set_within(key.name, 0.5, waiting_for="worker:0's snapshot of the sf.nn tables"):
            self.snapshot_due = key  # still due if the group breaks here
            self._interrupt()
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} waited {limit_s:g}s for worker:0's snapshot of the sf.nn tables")
        self.snapshot_due = None


def _connect(
    job: JobConfig[AllReduceStrategy], role: RoleContext, model: torch.nn.Module, interrupt: Any
) -> ParameterClient:
    """A client to every PS for the model's `sf.nn` tables only (the chief places no dense variable on them)."""
    control = role.control
    placement = control.read(job_keys.PLACEMENT, waiting_for="the chief to initialise the parameter servers")
    addresses = [
        control.endpoint(control_keys.ps_endpoint(k), waiting_for=f"ps:{k} to start") for k in range(placement.num_ps)
    ]
    params = ParameterClient(
        Client(role.task.name, credentials=job_credentials()),
        addresses,
        placement,
        model,
        timeout_s=job.strategy.request_timeout_s,
        worker_index=role.task.index,
        interrupt=interrupt,
    )
    if params.tables is None:
        params.close()
        raise ValueError("HybridStrategy: the model has no sf.nn tables; train it with sf.AllReduceStrategy")
    return params


def _snapshot(params: ParameterClient) -> int:
    """Every PS snapshots its tables now (no worker pushes meanwhile); their step, alike on every PS."""
    replies = params.exchange([protocol.Status()] * len(params.peers))
    steps = {StatusReply.decode(header, peer).step for (header, _), peer in zip(replies, params.peers, strict=True)}
    if len(steps) != 1:
        raise RuntimeError(f"the parameter servers are at different steps {sorted(steps)} with no push in flight")
    step = steps.pop()
    params.broadcast(protocol.SnapshotAt(step=step))
    return step
