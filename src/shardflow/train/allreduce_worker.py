"""A worker of `sf.AllReduceStrategy`: the whole model and its optimizer, a gloo group with the other workers formed
through the chief's control plane, and every step's mean gradient all-reduced and applied alike by every worker.
Every worker steps in lockstep, so each knows the global step; worker:0 hands the chief the states to checkpoint."""

from __future__ import annotations

import time
from typing import Any

import torch
from torch._C._distributed_c10d import ProcessGroupGloo

from shardflow.cluster import control_keys
from shardflow.cluster.dist_store import ControlPlaneStore, gloo_group
from shardflow.data.torch_edge import to_torch
from shardflow.train import allreduce_state, job_keys
from shardflow.train.allreduce_gradients import ABORT, HAD_BATCH, SAVE, STOP, GradientReducer
from shardflow.train.heartbeat import Heartbeat
from shardflow.train.hooks import StepHooks
from shardflow.train.input import InputPosition
from shardflow.train.job import JobConfig, UserCodeError
from shardflow.train.job_keys import InputState, StateNotice
from shardflow.train.role_context import RoleContext
from shardflow.train.specs import InputContext
from shardflow.train.strategy import AllReduceStrategy
from shardflow.train.worker_report import Report

GROUP = "workers"
_POLL_EVERY_S = 0.5
"""How often worker:0 asks the control plane whether the chief wants training to end."""


class GroupBrokenError(RuntimeError):
    """A collective of the workers' group failed: a worker died or stopped answering; names the silent ones."""


def _silent_workers(role: RoleContext, wait_s: float = 2.5) -> list[str]:
    """The other workers whose heartbeat (one a second) did not change in `wait_s`: the lost ones."""
    others = [f"worker:{index}" for index in range(role.num_workers) if index != role.task.index]
    before = {name: role.control.get_if_set(control_keys.heartbeat(name)) for name in others}
    time.sleep(wait_s)
    return [name for name in others if role.control.get_if_set(control_keys.heartbeat(name)) == before[name]]


class JobAborted(RuntimeError):
    """The chief ended the job (another role failed) while this worker trained."""


def run_allreduce_worker(job: JobConfig[AllReduceStrategy], role: RoleContext) -> None:
    """The worker's main: join the group, train to the end of every worker's input or max_steps, hand over the
    final state, and stay until the chief says the job is over."""
    control, strategy = role.control, job.strategy
    heartbeat = Heartbeat(role.task.name, control)
    try:
        start = control.read(
            job_keys.ALLREDUCE_START, waiting_for="the chief to restore the model", timeout_s=strategy.startup_timeout_s
        )
        model = job.build_model()
        optimizer = job.optimizer.build(list(model.parameters()))
        if start.num_chunks:
            state = allreduce_state.receive(
                control,
                "start",
                start.num_chunks,
                step=start.step,
                scalars=start.scalars,
                waiting_for="the chief's restored state",
                delete=False,
            )
            allreduce_state.restore(model, optimizer, state)
        restored = control.read_if_set(job_keys.RESTORE_ITERATORS)
        position = InputPosition(
            job.train_spec,
            InputContext(role.num_workers, role.task.index),
            restored.positions.get(role.task.name) if restored is not None else None,
        )
        _Trainer(job, role, model, optimizer, position, start.step).train()
        # The chief saves and evaluates the final state, then ends the job: wait for it without a deadline, as PS
        # workers do, still beating (the chief fails the job if the wait ends in its error).
        while not control.set_within(control_keys.SHUTDOWN, 1.0, waiting_for="the end of the job"):
            pass
    finally:
        heartbeat.stop()


def _form_group(job: JobConfig[AllReduceStrategy], role: RoleContext) -> ProcessGroupGloo:
    strategy = job.strategy
    members = [f"worker:{index}" for index in range(role.num_workers)]
    store = ControlPlaneStore(role.control, GROUP, 0, members, timeout_s=strategy.startup_timeout_s)
    host = role.spec.address(role.task).rpartition(":")[0].strip("[]")
    return gloo_group(store, role.task.index, role.num_workers, host, timeout_s=strategy.request_timeout_s)


class _Trainer:
    """One worker's training run: its steps, the checkpoints it hands over and its reports."""

    def __init__(
        self,
        job: JobConfig[AllReduceStrategy],
        role: RoleContext,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        position: InputPosition,
        step: int,
    ) -> None:
        self.job, self.role, self.model, self.optimizer, self.position = job, role, model, optimizer, position
        self.name = role.task.name
        self.step = step
        self.leader = role.task.index == 0
        self.parameters = [p for p in model.parameters() if p.requires_grad]
        self.reducer = GradientReducer(_form_group(job, role), self.parameters, job.strategy.bucket_bytes)
        self.report = Report(role, 0, job.save_summary_steps)
        self.hooks = StepHooks(job.train_spec.hooks, self.name, role.task.index)
        self.checkpoints = 0
        self.last_checkpoint = self.last_poll = time.monotonic()
        self.stop = self.abort = 0.0
        """worker:0's view of the chief's requests: the last step (preempted), the end of the job (a failure)."""
        self.input_done = False
        eval_spec = job.eval_spec
        self.eval_every = eval_spec.every_n_steps if eval_spec is not None else None
        """The chief evaluates the state at every multiple of this global step."""

    def train(self) -> None:
        self.report.send()
        max_steps = self.job.train_spec.max_steps
        while max_steps is None or self.step < max_steps:
            for param in self.parameters:  # the last step's are views of the reducer's buffers
                param.grad = None
            batch = None if self.input_done else self.position.next()
            self.input_done = batch is None
            loss = self._forward_backward(batch) if batch is not None else None
            flags = self._reduce([float(batch is not None), *self._requests()])
            if flags[ABORT]:
                raise JobAborted(f"{self.name}: the chief ended the job at global step {self.step}")
            if not flags[HAD_BATCH]:
                break  # every worker's input is done: no update, and the global step stays
            self._apply(flags[HAD_BATCH])
            if loss is not None:
                self.report.step(loss, self.position.epoch, self.step - 1)
                # A hook's stop ends this worker's input: it goes on taking part with nothing, as one whose shard
                # is done, and the others train on (a hook stops one worker, as in the PS strategy).
                self.input_done = self.hooks.after_step(self.report.local_step, self.step, loss) or self.input_done
            if self.report.due():
                self.report.send()
            if flags[STOP]:
                break
            every = self.job.save_checkpoints_steps
            save = bool(flags[SAVE]) or bool(every and self.step % every == 0)
            evaluate = bool(self.eval_every and self.step % self.eval_every == 0)
            if save or evaluate:
                self._hand_over(final=False, checkpoint=save)
        self.hooks.end(self.report.local_step, self.step)
        self.report.send(done=True)  # before the final state: the chief reads every report once it has that
        self._hand_over(final=True, checkpoint=True)

    def _reduce(self, flags: list[float]) -> list[float]:
        try:
            return self.reducer.reduce(flags)
        except RuntimeError as error:  # gloo's: a peer closed its connection, or the collective's deadline passed
            lost = _silent_workers(self.role)
            who = f"{', '.join(lost)} stopped its heartbeat" if lost else "no other worker stopped its heartbeat"
            raise GroupBrokenError(
                f"{self.name}: the all-reduce of global step {self.step} failed ({who}): {error}; the group is not "
                "re-formed in this version"
            ) from None

    def _forward_backward(self, batch: Any) -> float:
        try:
            loss = self.job.loss_fn(self.model, to_torch(batch))
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise TypeError(f"loss_fn must return a scalar tensor, got {type(loss).__name__}")
            loss.backward()
        except Exception as error:
            if type(error).__module__.startswith("shardflow."):
                raise
            raise UserCodeError(
                f"{self.name}: loss_fn or its backward raised at global step {self.step}: {type(error).__name__}: "
                f"{error}"
            ) from error
        return float(loss.detach())

    def _apply(self, contributors: float) -> None:
        """The optimizer's step with the mean gradient, as one process applies it: clipped, at the scheduled
        learning rate of this global step."""
        self.reducer.apply(contributors)
        spec = self.job.optimizer
        if spec.clip_grad_value is not None:
            torch.nn.utils.clip_grad_value_(self.parameters, spec.clip_grad_value)
        if spec.clip_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.parameters, spec.clip_grad_norm)
        if spec.schedule is not None:
            for group in self.optimizer.param_groups:
                group["lr"] = spec.learning_rate(self.step)
        self.optimizer.step()
        self.step += 1

    def _requests(self) -> list[float]:
        """worker:0's flags for this step (see allreduce_gradients.py): a time-based checkpoint due, and the
        chief's end of training or of the job, asked for on the control plane."""
        if not self.leader:
            return [0.0, 0.0, 0.0]
        now = time.monotonic()
        secs = None if self.job.save_checkpoints_steps else self.job.save_checkpoints_secs
        save = float(secs is not None and now - self.last_checkpoint >= secs)
        if now - self.last_poll >= _POLL_EVERY_S:
            self.last_poll = now
            self.stop = float(self.role.control.is_set(control_keys.ALLREDUCE_STOP))
            self.abort = float(self.role.control.is_set(control_keys.SHUTDOWN))
        return [save, self.stop, self.abort]

    def _hand_over(self, *, final: bool, checkpoint: bool) -> None:
        """State n of this run, to checkpoint (or only to evaluate): every worker's input position, and worker:0's
        state once the chief handled the one before (one state at a time on the control plane)."""
        self.checkpoints += 1
        n, control = self.checkpoints, self.role.control
        if checkpoint:
            self.last_checkpoint = time.monotonic()
        control.put(job_keys.allreduce_position(n, self.name), InputState(position=self.position.get_state()))
        if not self.leader:
            return
        if n > 1:
            control.read(job_keys.allreduce_saved(n - 1), waiting_for="the chief to save the checkpoint before")
        state = allreduce_state.capture(self.model, self.optimizer, self.step)
        num_chunks = allreduce_state.send(control, f"checkpoint/{n}", state)
        notice = StateNotice(
            step=self.step, num_chunks=num_chunks, scalars=state.scalars, checkpoint=checkpoint, final=final
        )
        control.put(job_keys.allreduce_checkpoint(n), notice)
        if final:
            control.read(job_keys.allreduce_saved(n), waiting_for="the chief to save the final checkpoint")
