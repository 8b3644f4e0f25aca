"""What the chief does while the workers train: watch them, checkpoint, evaluate, capture, summarise."""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any

import torch

from shardflow.cluster.rendezvous import ControlPlane
from shardflow.ps.checkpointing import fetch_state
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
        self.last_checkpoint_step = start_step
        self.last_checkpoint_time = time.monotonic()
        self.next_eval_step = self._next_multiple(start_step, eval_spec.every_n_steps if eval_spec else None)
        self.last_eval_time = time.monotonic()
        self.summaries = Summaries(est.model_dir)
        self.display = ProgressDisplay(spec.max_steps, spec.epochs, start_step)
        self._ps_stats: list[dict[str, Any]] = []

    @staticmethod
    def _next_multiple(step: int, every: int | None) -> int | None:
        return None if every is None else (step // every + 1) * every

    def run(self) -> None:
        last_seen = dict.fromkeys(self.workers, time.monotonic())
        next_ps_poll = next_slow = time.monotonic()
        try:
            while True:
                done = self._watch_workers(last_seen)
                now = time.monotonic()
                if done:
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
            self.display.update(self.global_step, self.progress)
            self.display.close()

    # -- workers ----------------------------------------------------------------------------------

    def _watch_workers(self, last_seen: dict[str, float]) -> bool:
        """Read progress reports; fail on a reported failure or a silent worker; True once all are done."""
        timeout_s = self.est.strategy.heartbeat_timeout_s
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
        return self.control.add("workers_done", 0) >= len(self.workers)

    # -- checkpoints and evaluation ---------------------------------------------------------------

    def _poll_servers(self) -> None:
        replies = self.client.broadcast({"op": "step"})
        self.global_step = int(replies[0]["step"])
        self._ps_stats = [r["stats"] for r in replies]
        common = set.intersection(*(set(r["snapshots"]) for r in replies))
        ready = [s for s in common if s > self.last_checkpoint_step]
        by_time = self.est.save_checkpoints_secs is not None and not self.est.save_checkpoints_steps
        if ready:
            self.save_checkpoint(max(ready))
        elif by_time and time.monotonic() - self.last_checkpoint_time >= (self.est.save_checkpoints_secs or 0):
            self._request_snapshot(max(int(r["step"]) for r in replies))
        self._evaluate_if_due()

    def _request_snapshot(self, highest_step: int) -> None:
        # Ahead of every PS, so each snapshots exactly this step (async PS may be a few updates apart).
        target = highest_step + (1 if self.est.strategy.mode == "sync" else len(self.workers) + 1)
        self.client.broadcast({"op": "snapshot_at", "step": target})
        self.last_checkpoint_time = time.monotonic()

    def save_checkpoint(self, snapshot: int | None) -> str:
        state = fetch_state(self.client, snapshot)
        with self.profiler.recorder.span("checkpoint", state.step):
            path = checkpoint.save_state(self.est.model_dir, state, self.manifest, keep=self.est.keep_checkpoint_max)
        self.last_checkpoint_step = state.step
        self.last_checkpoint_time = time.monotonic()
        return str(path)

    def _evaluate_if_due(self) -> None:
        spec = self.eval_spec
        if spec is None:
            return
        by_steps = self.next_eval_step is not None and self.global_step >= self.next_eval_step
        by_time = spec.every_n_secs is not None and time.monotonic() - self.last_eval_time >= spec.every_n_secs
        if not (by_steps or by_time):
            return
        self.next_eval_step = self._next_multiple(self.global_step, spec.every_n_steps)
        self.evaluate(fetch_state(self.client).step)
        stopping = spec.early_stopping
        if stopping is not None and not self.stopped_early:
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
