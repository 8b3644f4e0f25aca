"""What the chief does while the workers train: watch them, checkpoint, evaluate, capture, summarise."""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any

import torch

from shardflow.cluster.rendezvous import ControlPlane
from shardflow.ps.checkpointing import ModelState, fetch_state
from shardflow.ps.client import ParameterClient
from shardflow.train import checkpoint
from shardflow.train.profiling import REQUEST, ChiefProfiler
from shardflow.train.progress import ProgressDisplay
from shardflow.train.specs import EvalSpec, TrainSpec
from shardflow.train.summaries import Summaries

if TYPE_CHECKING:
    from shardflow.train.estimator import Estimator
    from shardflow.train.roles import RoleContext

_POLL_S = 0.05
_PS_POLL_S = 0.25
_SLOW_POLL_S = 1.0


class WorkerFailedError(RuntimeError):
    """A worker reported a failure, or stopped reporting, while the job ran."""


class ChiefLoop:
    """Runs until every worker is done; everything periodic the chief does meanwhile lives here."""

    def __init__(
        self,
        est: Estimator,
        spec: TrainSpec,
        eval_spec: EvalSpec | None,
        role: RoleContext,
        client: ParameterClient,
        model: torch.nn.Module,
        profiler: ChiefProfiler,
        manifest: dict[str, Any],
        start_step: int,
    ) -> None:
        self.est, self.spec, self.role, self.client, self.model = est, spec, role, client, model
        self.profiler = profiler
        self.manifest = manifest
        self.control: ControlPlane = role.control
        self.workers = [f"worker:{i}" for i in range(role.num_workers)]
        self.capture_roles = [t.name for t in role.spec.tasks() if t.type in ("chief", "ps", "worker")]
        # A side-car evaluator follows checkpoints; otherwise the chief evaluates inline.
        self.eval_spec = None if role.spec.num("evaluator") else eval_spec
        self.started = time.monotonic()
        self.global_step = start_step
        self.progress: dict[str, dict[str, Any]] = {}
        self.eval_history: list[dict[str, Any]] = []
        self.stopped_early = False
        self.last_snapshot_step = start_step
        self.requested_snapshot: int | None = None
        self.last_checkpoint_time = time.monotonic()
        self.last_eval_time = time.monotonic()
        self.summaries = Summaries(est.model_dir)
        self.display = ProgressDisplay(spec.max_steps, spec.epochs, start_step)
        self._ps_stats: list[dict[str, Any]] = []

    def run(self) -> None:
        self.started = time.monotonic()  # evaluation times count from the start of training, not start-up
        last_seen = dict.fromkeys(self.workers, time.monotonic())
        next_ps_poll = next_slow = time.monotonic()
        try:
            while True:
                done = self._watch_workers(last_seen)
                now = time.monotonic()
                if done:
                    # Snapshots taken since the last poll are still saved, before the final checkpoint.
                    self._save_snapshots(self.client.broadcast({"op": "step"}))
                    return
                if now >= next_ps_poll:
                    next_ps_poll = now + _PS_POLL_S
                    self._poll_servers()
                if now >= next_slow:
                    next_slow = now + _SLOW_POLL_S
                    self._pick_up_capture()
                    self.profiler.collect(self.capture_roles, timeout_s=10.0)
                    self.summaries.training(self.global_step, self.progress, self._ps_stats)
                    self.display.update(self.global_step, self.progress)
                time.sleep(_POLL_S)
        finally:
            # The workers' final reports, however short the run.
            self.summaries.training(self.global_step, self.progress, self._ps_stats)
            self.display.update(self.global_step, self.progress)
            self.display.close()

    # -- workers ----------------------------------------------------------------------------------

    def _watch_workers(self, last_seen: dict[str, float]) -> bool:
        """Read progress reports; fail on a reported failure or a silent worker; True once all are done."""
        timeout_s = self.est.strategy.heartbeat_timeout_s
        if self.est._role_failures:
            raise WorkerFailedError(f"{self.est._role_failures[0].describe()}; the job was stopped")
        # Read the count before the reports: a worker sets its final report before it counts itself done, so once
        # all are counted, the reports read below are the final ones.
        all_done = self.control.add("workers_done", 0) >= len(self.workers)
        for name in self.workers:
            if self.control.is_set(f"failed/{name}"):
                raise WorkerFailedError(f"{name} failed: {self.control.get(f'failed/{name}', waiting_for=name)}")
            if self.control.is_set(f"progress/{name}"):
                report = json.loads(self.control.get(f"progress/{name}", waiting_for=name))
                if report != self.progress.get(name):
                    last_seen[name] = time.monotonic()
                self.progress[name] = report
            if self.progress.get(name, {}).get("done"):
                continue
            if time.monotonic() - last_seen[name] > timeout_s:
                raise WorkerFailedError(f"{name} has not reported for {timeout_s:.0f}s")
        return all_done

    # -- checkpoints and evaluation ---------------------------------------------------------------

    def _poll_servers(self) -> None:
        replies = self.client.broadcast({"op": "step"})
        self.global_step = int(replies[0]["step"])
        self._ps_stats = [r["stats"] for r in replies]
        by_time = self.est.save_checkpoints_secs is not None and not self.est.save_checkpoints_steps
        if self._save_snapshots(replies):
            pass
        elif by_time and time.monotonic() - self.last_checkpoint_time >= (self.est.save_checkpoints_secs or 0):
            self._request_snapshot(max(int(r["step"]) for r in replies))
        self._evaluate_if_due()

    def _save_snapshots(self, replies: list[dict[str, Any]]) -> bool:
        """Checkpoint and evaluate, oldest first, every snapshot all PS hold that is not handled yet: so both
        happen at exact multiples of their step counts, however late the chief looks."""
        common = set.intersection(*(set(r["snapshots"]) for r in replies))
        ready = sorted(s for s in common if s > self.last_snapshot_step)
        every_checkpoint = self.est.save_checkpoints_steps
        every_eval = self.eval_spec.every_n_steps if self.eval_spec is not None else None
        for step in ready:
            state = fetch_state(self.client, step)
            if (every_checkpoint and step % every_checkpoint == 0) or step == self.requested_snapshot:
                self._save(state)
            if every_eval is not None and step % every_eval == 0 and not self.stopped_early:
                self._evaluate_and_maybe_stop(step)
            self.last_snapshot_step = step
        if ready:
            self.client.broadcast({"op": "release_snapshots", "step": ready[-1]})
        return bool(ready)

    def _request_snapshot(self, highest_step: int) -> None:
        # Ahead of every PS, so each snapshots exactly this step (async PS may be a few updates apart).
        target = highest_step + (1 if self.est.strategy.mode == "sync" else len(self.workers) + 1)
        self.client.broadcast({"op": "snapshot_at", "step": target})
        self.requested_snapshot = target
        self.last_checkpoint_time = time.monotonic()

    def _save(self, state: ModelState) -> str:
        with self.profiler.recorder.span("checkpoint", state.step):
            path = checkpoint.save_state(self.est.model_dir, state, self.manifest, keep=self.est.keep_checkpoint_max)
        self.last_checkpoint_time = time.monotonic()
        return str(path)

    def _evaluate_if_due(self) -> None:
        """Time-based evaluation, of the parameters as they are now (step-based ones use exact snapshots)."""
        spec = self.eval_spec
        if spec is None or spec.every_n_secs is None or self.stopped_early:
            return
        if time.monotonic() - self.last_eval_time >= spec.every_n_secs:
            self._evaluate_and_maybe_stop(fetch_state(self.client).step)

    def _evaluate_and_maybe_stop(self, step: int) -> None:
        assert self.eval_spec is not None
        self.evaluate(step)
        stopping = self.eval_spec.early_stopping
        if stopping is not None:
            values = [e["metrics"][stopping.metric] for e in self.eval_history]
            if stopping.should_stop(values):
                self.stopped_early = True
                self.client.broadcast({"op": "stop"})

    def evaluate(self, step: int) -> dict[str, float]:
        """Evaluate the parameters now loaded in the chief's model, and record the result."""
        assert self.eval_spec is not None
        self.last_eval_time = time.monotonic()
        with self.profiler.recorder.span("eval", step):
            metrics = self.est.evaluate_model(self.model, self.eval_spec)
        self.eval_history.append(
            {"global_step": step, "elapsed_s": time.monotonic() - self.started, "metrics": metrics}
        )
        self.summaries.evaluation(step, metrics)
        return metrics

    # -- captures -----------------------------------------------------------------------------------

    def _pick_up_capture(self) -> None:
        """A tool asked for a capture of the running job through the control plane."""
        if not self.control.is_set(REQUEST):
            return
        request = json.loads(self.control.get(REQUEST, waiting_for="the capture request"))
        known = any(p["name"] == request["name"] for p in self.profiler.pending)
        if not known and not self.control.is_set(f"capture/{request['name']}/done"):
            self.profiler.request(
                request["first"], request["last"], ops=request.get("ops", False), name=request["name"]
            )
