"""A worker of `sf.AllReduceStrategy`: the whole model and its optimizer, a gloo group with the other workers formed
through the chief's control plane, and every step's mean gradient all-reduced and applied alike by every worker.
Every worker steps in lockstep, so each knows the global step; worker:0 hands the chief the states to checkpoint.
A lost worker is restarted and the group formed again with it (allreduce_group.py): the step in progress is dropped
and retried, at the same global step, with every worker's batch of it."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from typing import Any

import torch

from shardflow.cluster import control_keys
from shardflow.cluster.spec import DYNAMIC, ClusterSpec, TaskSpec, host_of
from shardflow.data.torch_edge import to_torch
from shardflow.profile import spans
from shardflow.profile.recorder import SpanRecorder
from shardflow.train import allreduce_group, allreduce_state, job_keys
from shardflow.train.allreduce_gradients import ABORT, EVALUATE, FLAGS, HAD_BATCH, SAVE, STOP, GradientReducer
from shardflow.train.allreduce_group import GroupLostError
from shardflow.train.allreduce_replay import Replay
from shardflow.train.checkpoints import store
from shardflow.train.heartbeat import Heartbeat
from shardflow.train.hooks import StepHooks
from shardflow.train.input import InputPosition, Lookahead
from shardflow.train.job import JobConfig, check_loss, user_code
from shardflow.train.job_keys import InputState, RejoinState, ResumePoint
from shardflow.train.precision import autocast
from shardflow.train.profiling import RoleProfiler
from shardflow.train.role_context import RoleContext
from shardflow.train.specs import InputContext
from shardflow.train.strategy import AllReduceStrategy
from shardflow.train.worker_report import Report
from shardflow.train.worker_step import batch_to_device

log = logging.getLogger(__name__)

_POLL_EVERY_S = 0.5
"""How often worker:0 asks the control plane whether the chief wants training to end."""


class JobAborted(RuntimeError):
    """The chief ended the job (another role failed) while this worker trained."""


def run_allreduce_worker(
    job: JobConfig[AllReduceStrategy], role: RoleContext, trainer: type[_Trainer] | None = None
) -> None:
    """The worker's main: join the group, train to the end of every worker's input or max_steps, hand over the
    final state, and stay until the chief says the job is over. A restarted chief finds again what it needs of
    this worker (allreduce_replay.py) and adopts the group. `trainer`: the run's class (HybridStrategy's looks the
    `sf.nn` tables up on the PS); `_Trainer` by default."""
    control, strategy = role.control, job.strategy
    heartbeat = Heartbeat(role.task.name, control, strategy.heartbeat_timeout_s)
    profiler = RoleProfiler(role.task.name, control)
    replay = Replay(role)
    try:
        start = control.read(
            job_keys.ALLREDUCE_START, waiting_for="the chief to restore the model", timeout_s=strategy.startup_timeout_s
        )
        replay.keep(job_keys.ALLREDUCE_START, start)
        model = job.build_model().to(strategy.worker_device(local_worker_index(role.spec, role.task)))
        optimizer = job.optimizer.build(list(model.parameters()))
        generation = allreduce_group.generation_to_join(role)
        if start.checkpoint is not None and generation == 0:  # a restarted worker gets the state of now from the group
            state, _ = store.load_state(store.directory(job.model_dir) / start.checkpoint)
            allreduce_state.restore(model, optimizer, state)
        restored = control.read_if_set(job_keys.RESTORE_ITERATORS)
        if restored is not None:
            replay.keep(job_keys.RESTORE_ITERATORS, restored)
        position = restored.positions.get(role.task.name) if restored is not None else None
        # Restarted after the others were done, this worker finds the job over while it waits for them to join.
        with contextlib.suppress(allreduce_group.JobOverError):
            (trainer or _Trainer)(job, role, model, optimizer, position, start.step, generation, replay).run(profiler)
        profiler.finish()  # a capture cut short by the end of training: the chief collects it before the end
        # The chief saves and evaluates the final state, then ends the job: wait for it without a deadline, as PS
        # workers do, still beating (the chief fails the job if the wait ends in its error).
        while not control.set_within(control_keys.SHUTDOWN, 1.0, waiting_for="the end of the job"):
            pass
    finally:
        profiler.finish()
        replay.stop()
        heartbeat.stop()


def local_worker_index(spec: ClusterSpec, task: TaskSpec) -> int:
    """Worker `task`'s place among the workers of its machine (torchrun's LOCAL_RANK where it set one; else the
    workers before it at the same host in `spec`; its index where the spec names no host)."""
    if (local_rank := os.environ.get("LOCAL_RANK", "")).isdigit():
        return int(local_rank)
    host = _host(spec.address(task))
    if host is None:
        return task.index
    return sum(_host(spec.address(TaskSpec("worker", other))) == host for other in range(task.index))


def _host(address: str) -> str | None:
    if address == DYNAMIC:
        return None
    return host_of(address) or None


class _Trainer:
    """One worker's training run: its steps, the checkpoints it hands over and its reports."""

    def __init__(
        self,
        job: JobConfig[AllReduceStrategy],
        role: RoleContext,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        start_position: dict[str, Any] | None,
        step: int,
        generation: int,
        replay: Replay,
    ) -> None:
        """`start_position`: this worker's input position at the job's start; `generation`: of the group to join
        (allreduce_group.generation_to_join: a restarted worker's is not 0); `replay`: what it puts for the chief."""
        self.job, self.role, self.model, self.optimizer = job, role, model, optimizer
        self.name, self.index = role.task.name, role.task.index
        self.start_position = start_position
        self.position: InputPosition | Lookahead  # a restarted worker's is where it was (`_resume`)
        if generation == 0:
            self.position = InputPosition(job.train_spec, InputContext(role.num_workers, self.index), start_position)
        self.step = step
        self.leader = self.index == 0
        self.parameters = [p for p in model.parameters() if p.requires_grad]
        self.device = next((p.device for p in self.parameters), torch.device("cpu"))
        """Where the model computes (AllReduceStrategy.device): each batch goes there."""
        self.batches_applied = [0] * role.num_workers
        """Per worker: how many of its batches the global steps of this run applied (each step's flags say)."""
        self.had_batch = [True] * role.num_workers
        """Per worker: whether it had a batch in the last global step."""
        self.retry: list[Any] | None = None
        """The batches of a step dropped when the group broke, to train on again (None or empty: read on)."""
        self.accumulation = job.strategy.gradient_accumulation_steps
        """Batches per worker step, their gradients summed (each loss divided by it) before the all-reduce."""
        self.generation = generation
        self.abandoned: list[GradientReducer] = []
        self.report = Report(role, 0, job.save_summary_steps)
        self.hooks = StepHooks(job.train_spec.hooks, self.name, role.task.index)
        self.checkpoints = 0
        self.hand_over_step, self.hand_over_saves = -1, False
        """The global step of the last hand-over, and whether it was a checkpoint."""
        self.last_checkpoint = self.last_poll = time.monotonic()
        self.stop = self.abort = 0.0
        """worker:0's view of the chief's requests: the last step (preempted), the end of the job (a failure)."""
        self.input_done = False
        eval_spec = None if role.spec.num("evaluator") else job.eval_spec  # a side-car evaluator follows checkpoints
        self.eval_every = eval_spec.every_n_steps if eval_spec is not None else None
        """The chief evaluates the state at every multiple of this global step."""
        self.eval_secs = eval_spec.every_n_secs if eval_spec is not None else None
        """worker:0 hands a state over to evaluate once this long passed since the last one it evaluated."""
        self.last_evaluation = time.monotonic()
        timeout_s = job.strategy.startup_timeout_s if generation == 0 else job.strategy.worker_rejoin_timeout_s
        self.replay = replay
        self.reducer = self._join(generation, restarted=generation > 0, timeout_s=timeout_s)

    def run(self, profiler: RoleProfiler) -> None:
        """Train, with what the run needs around it (a subclass's connections)."""
        self.train(profiler)

    def train(self, profiler: RoleProfiler) -> None:
        """Step until every worker's input ended, max_steps, or the chief's stop; each step's spans recorded."""
        self.report.send()
        profiler.check_requests()
        recorder = profiler.recorder
        max_steps = self.job.train_spec.max_steps
        while max_steps is None or self.step < max_steps:
            step_started = time.perf_counter_ns()
            for param in self.parameters:  # the last step's are views of the reducer's buffers
                param.grad = None
            batches = self._next_batches()
            recorder.end(spans.INPUT_WAIT, self.step, step_started)
            # Each loss divided by the accumulation: the worker's gradient is their mean, as one batch k times larger.
            scale = 1.0 / self.accumulation
            losses = [self._forward_backward(batch, recorder, scale) for batch in batches]
            loss = sum(losses) / len(losses) if losses else None
            step = self.step
            flags = self._reduce(len(batches), recorder)
            if flags is None:  # the group broke and was formed again: the same step, with the same batches
                # unless the others applied it (with them) and this worker took their state (`_catch_up`).
                self.retry = batches if self.step == step else None
                continue
            if flags[ABORT]:
                raise JobAborted(f"{self.name}: the chief ended the job at global step {self.step}")
            if not flags[HAD_BATCH]:
                break  # every worker's input is done: no update, and the global step stays
            self._apply(flags[HAD_BATCH], recorder)
            recorder.end(spans.STEP, self.step - 1, step_started)
            profiler.at_step(self.step)
            for worker in range(self.role.num_workers):
                count = round(flags[len(FLAGS) + worker])  # the batches it accumulated
                self.had_batch[worker] = count > 0
                self.batches_applied[worker] += count
            if loss is not None:
                self.report.step(loss, self.position.epoch, self.step - 1)
                # A hook's stop ends this worker's input: it goes on taking part with nothing, as one whose shard
                # is done, and the others train on (a hook stops one worker, as in the PS strategy).
                self.input_done = self.hooks.after_step(self.report.local_step, self.step, loss) or self.input_done
            if self.report.due():
                self.report.send()
                profiler.check_requests()
            if flags[STOP]:
                break
            every = self.job.save_checkpoints_steps
            save = bool(flags[SAVE]) or bool(every and self.step % every == 0)
            evaluate = bool(flags[EVALUATE]) or bool(self.eval_every and self.step % self.eval_every == 0)
            if save or evaluate:
                self._hand_over(final=False, checkpoint=save, evaluate=evaluate)
        self._trained_to_the_end()
        self.report.send(done=True)  # before the final state: the chief reads every report once it has that
        self._hand_over(final=True, checkpoint=True)

    def _trained_to_the_end(self) -> None:
        """After the last step, before the final hand-over: the user's `end` hooks."""
        self.hooks.end(self.report.local_step, self.step)

    def _next_batches(self) -> list[Any]:
        """This step's batches: up to gradient_accumulation_steps of them, fewer where the input ends."""
        batches: list[Any] = []
        while len(batches) < self.accumulation and (batch := self._next_batch()) is not None:
            batches.append(batch)
        return batches

    def _next_batch(self) -> Any | None:
        if self.retry:  # those of a step dropped, again
            return self.retry.pop(0)
        batch = None if self.input_done else self.position.next()
        self.input_done = batch is None
        return batch

    def _reduce(self, num_batches: int, recorder: SpanRecorder) -> list[float] | None:
        """This step's flags summed over the group (`num_batches`: this worker's), the gradients' sums kept for
        `_apply`; None where the group broke (nothing of the step is applied anywhere) and was formed again."""
        mine = [0.0] * self.role.num_workers
        mine[self.index] = float(num_batches)
        had_batch = num_batches > 0
        try:
            return self._collective(had_batch, mine, recorder)
        except RuntimeError as error:  # gloo's (a peer closed its connection, the deadline passed), or PeerLostError
            log.warning(
                "%s: the all-reduce of global step %d failed (%s); the step is dropped and the group formed again",
                self.name,
                self.step,
                error,
            )
        self._form_again()
        return None

    def _form_again(self) -> None:
        """Form the group anew, from the next generation. A collective given up may still be in flight in gloo until
        its deadline, and the group's destructor waits for it: the old group is kept rather than dropped."""
        self.abandoned.append(self.reducer)
        self.reducer = self._join(
            self.generation + 1, restarted=False, timeout_s=self.job.strategy.worker_rejoin_timeout_s
        )

    def _collective(self, had_batch: bool, mine: list[float], recorder: SpanRecorder) -> list[float]:
        """The step's exchange with the group; a RuntimeError where the group broke."""
        return self.reducer.reduce([float(had_batch), *self._requests(), *mine], recorder, self.step)

    def _join(self, generation: int, *, restarted: bool, timeout_s: float) -> GradientReducer:
        """Form the group from `generation` on (the next one where forming fails) within `timeout_s`, and agree in
        it on the run to go on with; a `restarted` worker takes it over and resumes its input."""
        deadline = time.monotonic() + timeout_s
        strategy = self.job.strategy
        while True:
            try:
                group = allreduce_group.form(strategy, self.role, generation, deadline, self.replay, self._forming)
                mine = None if restarted else self._run()
                agreed = allreduce_group.rejoin(group, self.role, mine, self.model, self.optimizer)
                break
            except GroupLostError:
                raise
            except RuntimeError as error:  # another worker lost while forming: the next generation
                if time.monotonic() > deadline:
                    raise GroupLostError(
                        f"{self.name}: the all-reduce group could not be formed again within {timeout_s:g}s: {error}"
                    ) from None
                log.warning("%s: forming generation %d of the group failed: %s", self.name, generation, error)
                # Where another announced a later one, it waits for this worker there.
                later = error.generation if isinstance(error, allreduce_group.GenerationPassed) else 0
                generation = max(generation + 1, later)
        self.generation = generation
        self.replay.mark_joined()
        if restarted or agreed.step != self.step:
            if restarted:
                self._resume(agreed)
            else:
                self._catch_up(agreed)
            # Lost inside the hand-over at the step the group goes on from: this worker's part of it may be missing,
            # and the chief waits for it.
            saved = self.checkpoints and self.role.control.is_set(job_keys.allreduce_saved(self.checkpoints).name)
            if agreed.hand_over_step == self.step and not saved:
                log.warning("%s does its part of hand-over %d again", self.name, self.checkpoints)
                self._hand_over(final=False, checkpoint=agreed.hand_over_saves, again=True)
        num_flags = len(FLAGS) + self.role.num_workers
        self.peers = allreduce_group.Peers(self.role, strategy.heartbeat_timeout_s, generation)
        return GradientReducer(group, self.parameters, strategy.bucket_bytes, num_flags, self.peers.wait)

    def _forming(self) -> None:
        """Called while the group waits for the other workers to form it; raises to give the wait up."""

    def _run(self) -> RejoinState:
        """Where this worker's run is, for the workers that join the group restarted."""
        return RejoinState(
            step=self.step,
            scalars={},
            hand_overs=self.checkpoints,
            hand_over_step=self.hand_over_step,
            hand_over_saves=self.hand_over_saves,
            batches_applied=list(self.batches_applied),
            had_batch=list(self.had_batch),
        )

    def _resume(self, run: RejoinState) -> None:
        """Go on with `run` restarted: the input read from this worker's last recorded position on past its
        batches applied since (read again otherwise: exactly once)."""
        self.step, self.checkpoints = run.step, run.hand_overs
        self.batches_applied, self.had_batch = list(run.batches_applied), list(run.had_batch)
        self.hand_over_step, self.hand_over_saves = run.hand_over_step, run.hand_over_saves
        self.input_done = not run.had_batch[self.index]
        resume = self.role.control.read_if_set(job_keys.allreduce_resume(self.name))
        position, applied = (resume.position, resume.batches_applied) if resume else (self.start_position, 0)
        self.position = InputPosition(self.job.train_spec, InputContext(self.role.num_workers, self.index), position)
        for read in range(run.batches_applied[self.index] - applied):
            if self.position.next() is None:
                raise GroupLostError(
                    f"{self.name}: its input ended {read} batches past its last recorded position, where the group "
                    f"applied {run.batches_applied[self.index] - applied}: input_fn must yield the same batches when "
                    "called again"
                )
        log.warning("%s joined the all-reduce group at global step %d, restarted", self.name, self.step)

    def _catch_up(self, run: RejoinState) -> None:
        """A survivor one step behind: the others applied the step it gave up, its batch included, and it took
        their state (allreduce_group.rejoin); its input goes on after that batch."""
        log.warning(
            "%s: the others applied global step %d, which it gave up; it took their state and goes on from %d",
            self.name,
            self.step,
            run.step,
        )
        self.step, self.checkpoints = run.step, run.hand_overs
        self.batches_applied, self.had_batch = list(run.batches_applied), list(run.had_batch)
        self.hand_over_step, self.hand_over_saves = run.hand_over_step, run.hand_over_saves

    def _forward_backward(self, batch: Any, recorder: SpanRecorder, scale: float = 1.0) -> float:
        started, cpu = time.perf_counter_ns(), time.thread_time_ns()
        with autocast(self.job.strategy.mixed_precision, self.device.type), user_code("loss_fn", self.name, self.step):
            loss = self.job.loss_fn(self.model, batch_to_device(to_torch(batch), self.device))
        recorder.end(spans.FORWARD, self.step, started, time.thread_time_ns() - cpu)
        check_loss(loss, self.name)
        started, cpu = time.perf_counter_ns(), time.thread_time_ns()
        with user_code("backward of the loss", self.name, self.step):
            (loss * scale if scale != 1.0 else loss).backward()
        recorder.end(spans.BACKWARD, self.step, started, time.thread_time_ns() - cpu)
        return float(loss.detach())

    def _apply(self, contributors: float, recorder: SpanRecorder) -> None:
        """The optimizer's step with the mean gradient, as one process applies it: clipped, at the scheduled
        learning rate of this global step."""
        started = time.perf_counter_ns()
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
        recorder.end(spans.APPLY, self.step, started, self.index, self.reducer.nbytes)
        self.step += 1

    def _requests(self) -> list[float]:
        """worker:0's flags for this step (see allreduce_gradients.py): a time-based checkpoint due, and the
        chief's end of training or of the job, asked for on the control plane."""
        if not self.leader:
            return [0.0] * (len(FLAGS) - 1)
        self.replay.at_step(self.step)
        now = time.monotonic()
        secs = None if self.job.save_checkpoints_steps else self.job.save_checkpoints_secs
        save = float(secs is not None and now - self.last_checkpoint >= secs)
        evaluate = float(self.eval_secs is not None and now - self.last_evaluation >= self.eval_secs)
        if now - self.last_poll >= _POLL_EVERY_S:
            self.last_poll = now
            self.stop = float(self.role.control.is_set(control_keys.ALLREDUCE_STOP))
            self.abort = float(self.role.control.is_set(control_keys.SHUTDOWN))
        return [save, self.stop, self.abort, evaluate]

    def _hand_over(self, *, final: bool, checkpoint: bool, again: bool = False, evaluate: bool = False) -> None:
        """State n of this run, to checkpoint (or only to evaluate): every worker's input position, and worker:0's
        state once the chief handled the one before (one state at a time on the control plane). `again`: the last
        one once more, where this worker was lost inside it (what the chief has already is not sent again).
        `evaluate`: the chief evaluates it, as EvalSpec.every_n_secs asked (at every_n_steps it knows itself)."""
        control = self.role.control
        self.checkpoints += 0 if again else 1
        n = self.checkpoints
        self.hand_over_step, self.hand_over_saves = self.step, checkpoint
        if checkpoint:
            self.last_checkpoint = time.monotonic()
        if evaluate:
            self.last_evaluation = time.monotonic()
        position = self.position.get_state()
        # Through the replay: a restarted chief gets them again (allreduce_replay.py).
        self.replay.put_position(n, InputState(position=position))
        resume = ResumePoint(position=position, batches_applied=self.batches_applied[self.index])
        self.replay.put(job_keys.allreduce_resume(self.name), resume)
        # The chief deletes the notice only once it put `saved`: neither set, the notice was never put.
        if not self.leader or (again and self._sent_whole(n)):
            return
        if n > 1:
            control.read(job_keys.allreduce_saved(n - 1), waiting_for="the chief to save the checkpoint before")
            self.replay.confirmed(n - 1)
        state = allreduce_state.capture(self.model, self.optimizer, self.step)
        self.replay.send_state(n, state, checkpoint=checkpoint, final=final, evaluate=evaluate)
        if final:
            control.read(job_keys.allreduce_saved(n), waiting_for="the chief to save the final checkpoint")

    def _sent_whole(self, n: int) -> bool:
        """Lost inside hand-over `n` and restarted: whether the chief has its whole state, so it is not sent again.
        A notice there says so for a state put before it; for one streamed after it, the chief either read it all
        (and saves it) or gives it up, seeing this worker's new process: wait for either."""
        control = self.role.control
        notice_key, saved_key = job_keys.allreduce_checkpoint(n), job_keys.allreduce_saved(n)
        notice = control.read_if_set(notice_key)
        if notice is None or notice.num_chunks <= allreduce_state.WINDOW:
            return notice is not None
        while control.is_set(notice_key):
            if control.set_within(saved_key.name, 1.0, waiting_for=f"the chief to save or give up state {n}"):
                return True
        return control.is_set(saved_key)
