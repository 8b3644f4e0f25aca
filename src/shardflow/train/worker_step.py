"""One step of a worker: forward and backward of its batches, then the push of its gradients to every PS."""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import torch

from shardflow.data.torch_edge import to_torch
from shardflow.profile import spans
from shardflow.profile.recorder import SpanRecorder
from shardflow.ps.client import ParameterClient, Pushed, PushRequest, StepReply
from shardflow.ps.clipping import clip_local_gradients
from shardflow.train.input import InputPosition, Lookahead
from shardflow.train.job import JobConfig, check_loss, user_code
from shardflow.train.precision import autocast
from shardflow.train.worker_report import Report

log = logging.getLogger(__name__)


class NonFiniteUpdateError(RuntimeError):
    """The job's `max_nonfinite_updates` was reached: that many steps held NaN or inf; none was applied."""


class WorkerStep:
    """What every step of a worker's run needs, built once and handed to its loop: the model, the client to the PS,
    the input, the report; `run` does one step, `wait` waits for one's replies."""

    def __init__(
        self,
        name: str,
        job: JobConfig,
        model: torch.nn.Module,
        params: ParameterClient,
        position: InputPosition | Lookahead,
        report: Report,
        recorder: SpanRecorder,
    ) -> None:
        self.name, self.job, self.model, self.params, self.position = name, job, model, params, position
        self.report, self.recorder = report, recorder
        self.parameters = list(model.parameters())
        # An update is one worker's gradient in async and ssp mode, so the worker clips it by its global norm itself;
        # in sync mode the PS clip the mean of the replicas' (ps/clipping.py).
        self.clip_on_worker = job.optimizer.clip_grad_norm if job.strategy.mode != "sync" else None
        changes_gradients = self.clip_on_worker is not None or job.strategy.gradient_accumulation_steps > 1
        self.tables = params.tables
        # An sf.nn table's rows are the first layer's: their gradients come last in backward, with nothing to gain.
        self.push_early = not changes_gradients and self.tables is None
        self.overlapped = job.strategy.mode == "async" and job.strategy.overlap
        """The next step is computed before this one is applied (see worker.py)."""
        self.ride = self.overlapped and self.tables is not None and job.strategy.gradient_accumulation_steps == 1
        """The lookups of the step after next ride on this step's pushes (TableLookups.ride): one request to each PS
        a step, not two. Overlapped only: the reply to a push then comes before the step after next begins."""
        self.lr_from_worker = job.optimizer.schedule is not None and job.optimizer.schedule.from_workers

    def run(self, batch: Any, step: int) -> tuple[float | None, Pushed]:
        """One step on the parameters of global step `step`, `batch` first: its mean loss (None for NaN or inf)
        and its pushes in flight."""
        for param in self.parameters:  # model.zero_grad(set_to_none=True) without walking the modules (~20 us)
            param.grad = None
        # A function of the step: the PS cannot run it, so the push says.
        learning_rate = self.job.optimizer.learning_rate(step) if self.lr_from_worker else None
        input_state = self.position.get_state()
        early = PushRequest(input_state=input_state, learning_rate=learning_rate) if self.push_early else None
        self.params.begin_push(step, early)
        self._look_ahead()
        loss, input_state = self._forward_backward(batch, step, input_state)
        self._ride()
        if loss is None:
            # A NaN or inf loss is not backpropagated: every PS is told, and refuses the step alike.
            request = PushRequest(input_state=input_state, learning_rate=learning_rate, nonfinite_loss=True)
            return None, self.params.push(request)
        if self.clip_on_worker is not None:
            extra = self.tables.gradients() if self.tables is not None else []
            clip_local_gradients(self.model, self.clip_on_worker, extra)
        return loss, self.params.push(early or PushRequest(input_state=input_state, learning_rate=learning_rate))

    def _look_ahead(self) -> None:
        """Send the lookups of the next step's batch, read ahead, while this one computes."""
        if self.tables is None or not isinstance(self.position, Lookahead):
            return
        upcoming = self.position.peek()
        if upcoming is not None:
            self.tables.prefetch(upcoming, self.params.lookup_min_steps(self.overlapped))

    def _ride(self) -> None:
        """Prepare the lookups of the batch after next to ride on this step's pushes (see `ride`)."""
        if not self.ride or self.tables is None or not isinstance(self.position, Lookahead):
            return
        after_next = self.position.peek(2)
        if after_next is not None:
            self.tables.ride(after_next)

    def wait(self, pushed: Pushed, load_params: bool = True) -> StepReply:
        """Every PS's reply to a step's pushes; raises once too many steps were refused for NaN or inf."""
        reply = self.params.wait_push(pushed, load_params=load_params)
        _check_finite(self.name, self.job.strategy.max_nonfinite_updates, pushed, reply)
        return reply

    def _forward_backward(
        self, batch: Any, step: int, input_state: dict[str, Any]
    ) -> tuple[float | None, dict[str, Any]]:
        """Forward and backward of one step's `gradient_accumulation_steps` batches, `batch` first: each loss
        divided by their number, so the summed gradient is that of their mean loss. Returns that mean, or None as
        soon as a loss holds NaN or inf (it is not backpropagated), and the input position after the last batch
        read (`input_state`: after `batch`). When the input ends within the step, the gradient is rescaled to the
        mean over the batches read."""
        model, position, recorder = self.model, self.position, self.recorder
        device = self.params.staging.device
        num_batches = self.job.strategy.gradient_accumulation_steps
        losses: list[float] = []
        while True:
            t, cpu = time.perf_counter_ns(), time.thread_time_ns()
            batch = batch_to_device(to_torch(batch), device)
            if self.tables is not None:
                self.tables.set_batch(batch)
            with autocast(self.job.strategy.mixed_precision, device.type), user_code("loss_fn", self.name, step):
                loss = self.job.loss_fn(model, batch)
            recorder.end(spans.FORWARD, step, t, time.thread_time_ns() - cpu)
            check_loss(loss, self.name)
            value = float(loss.detach())  # one read back (a device sync), which the report needs anyway
            if not math.isfinite(value):
                return None, input_state
            t, cpu = time.perf_counter_ns(), time.thread_time_ns()
            with user_code("backward of the loss", self.name, step):
                (loss / num_batches if num_batches > 1 else loss).backward()
            recorder.end(spans.BACKWARD, step, t, time.thread_time_ns() - cpu)
            losses.append(value)
            if len(losses) == num_batches:
                break
            waited = time.perf_counter_ns()
            batch = position.next()
            self.report.input_waited(time.perf_counter_ns() - waited)
            if batch is None:
                with torch.no_grad():
                    for param in model.parameters():
                        if param.grad is not None:
                            param.grad.mul_(num_batches / len(losses))
                break
            input_state = position.get_state()
        return sum(losses) / len(losses), input_state


def batch_to_device(batch: Any, device: torch.device) -> Any:
    """`batch` with its tensors on `device`, inside dicts, tuples (named ones too) and lists; other values as they
    are. On the CPU the tensors themselves: no copy."""
    if isinstance(batch, torch.Tensor):
        # Overlaps the host only from pinned memory (as_torch(pin_memory=True)); the step's kernels queue after it.
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {key: batch_to_device(value, device) for key, value in batch.items()}
    if isinstance(batch, tuple):
        items = [batch_to_device(value, device) for value in batch]
        return type(batch)(*items) if hasattr(batch, "_fields") else tuple(items)
    if isinstance(batch, list):
        return [batch_to_device(value, device) for value in batch]
    return batch


def _check_finite(name: str, max_nonfinite_updates: int, pushed: Pushed, reply: StepReply) -> None:
    """Raise once the PS have refused `max_nonfinite_updates` non-finite steps in all; this step's refusal was
    the count the PS reply with. The error reaches the chief through this worker's failure key."""
    if not reply.nonfinite:
        return
    found = "computed a NaN or inf loss" if pushed.nonfinite == "loss" else "pushed NaN or inf gradients"
    line = f"{name} {found} at global step {pushed.base_step} ({reply.nonfinite} of at most {max_nonfinite_updates})"
    if reply.nonfinite >= max_nonfinite_updates:
        raise NonFiniteUpdateError(f"{line}; none were applied")
    log.warning("%s; not applied, training goes on", line)
