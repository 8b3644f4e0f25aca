"""Run one training script at several cluster sizes and summarize each run: speed, target reached, time spent."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardflow import env
from shardflow.planning.target import Target, first_reached
from shardflow.profile.capture import check_steps


class ScaleRunError(RuntimeError):
    """A run at one cluster size failed or wrote no result; the message names the size and its log."""


@dataclass(frozen=True, kw_only=True)
class ScaleConfig:
    """How every cluster size is run."""

    script: Path
    """The training script, run by `shardflow launch` in every role."""
    script_args: tuple[str, ...] = ()
    """Arguments passed to the script untouched."""
    num_ps: int = 1
    """Parameter servers at every size."""
    out: Path
    """workers-N/ (model dir, result.json, log.txt) per size goes here."""
    profile_steps: tuple[int, int] | None = (50, 150)
    """Global steps [first, last) profiled in every run, for the breakdown; None profiles nothing."""
    timeout_s: float = 600.0
    """A run taking longer than this is stopped and reported."""

    def __post_init__(self) -> None:
        if not self.script.is_file():
            raise ValueError(f"script {str(self.script)!r} does not exist")
        if self.num_ps < 1:
            raise ValueError(f"--ps must be at least 1, e.g. --ps 2; got {self.num_ps}")
        if self.timeout_s <= 0:
            raise ValueError(f"--timeout must be positive, e.g. --timeout 600; got {self.timeout_s}")
        if self.profile_steps is not None:
            check_steps(self.profile_steps, what="--profile-steps")


@dataclass(frozen=True)
class Breakdown:
    """Where the workers' step time went in a run's capture, and the profiler's diagnosis."""

    fractions: dict[str, float]
    """Mean share of a worker step per category (input_wait, compute, communication, apply, other, idle)."""
    busiest_ps: str | None
    ps_busy: float
    """Share of the time the busiest PS receives, applies or replies."""
    diagnosis: str


@dataclass(frozen=True)
class SizeRow:
    """One line of the scale table, derived from one run's result file."""

    num_workers: int
    num_ps: int
    mode: str
    global_step: int
    training_s: float
    sec_per_step: float
    """Mean over workers of training_s / the worker's own steps."""
    global_steps_per_s: float
    target_step: int | None
    target_s: float | None
    final_metric: float | None
    """The target's metric (or the loss, without a target) at the end."""
    result: dict[str, Any]
    breakdown: Breakdown | None


def run_size(config: ScaleConfig, num_workers: int, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Train once with `num_workers` workers in a fresh model dir; returns what the chief wrote."""
    directory = config.out.resolve() / f"workers-{num_workers}"
    result_path, log_path, model_dir = directory / "result.json", directory / "log.txt", directory / "model"
    directory.mkdir(parents=True, exist_ok=True)
    result_path.unlink(missing_ok=True)
    if model_dir.exists():
        raise ScaleRunError(f"{model_dir} exists from an earlier run; pass a new --out or delete it")
    variables = {**os.environ, env.MODEL_DIR: str(model_dir), env.RESULT_JSON: str(result_path)}
    if config.profile_steps is not None:
        variables[env.PROFILE_STEPS] = ",".join(map(str, config.profile_steps))
    command = [sys.executable, "-m", "shardflow", "launch", "--workers", str(num_workers), "--ps", str(config.num_ps)]
    command += [str(config.script), *config.script_args]
    log(f"running {num_workers} worker{'s' if num_workers > 1 else ''}, {config.num_ps} PS ...")
    started = time.monotonic()
    with log_path.open("w") as output:
        process = subprocess.Popen(
            command, env=variables, stdout=output, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            code = process.wait(timeout=config.timeout_s)
        except subprocess.TimeoutExpired:
            _stop(process)
            raise ScaleRunError(
                f"the run with {num_workers} workers took over {config.timeout_s:.0f}s and was stopped; see {log_path}"
            ) from None
        except BaseException:
            _stop(process)
            raise
    if code != 0 or not result_path.exists():
        tail = "".join(log_path.read_text(errors="replace").splitlines(keepends=True)[-15:])
        reason = f"exited with code {code}" if code != 0 else f"wrote no {result_path.name}"
        hint = "" if code != 0 else " (does the script call train_and_evaluate in every role?)"
        raise ScaleRunError(f"the run with {num_workers} workers {reason}{hint}; {log_path} ends with:\n{tail}")
    log(f"  done in {time.monotonic() - started:.1f}s")
    result: dict[str, Any] = json.loads(result_path.read_text())
    if not result.get("profile_dir") and config.profile_steps is not None:
        # A capture that completes while training runs is on disk even when the result does not name it.
        captures = sorted((model_dir / "profile").glob("*/*.trace.json.gz"), key=lambda p: p.stat().st_mtime)
        result["profile_dir"] = str(captures[-1].parent) if captures else None
    return result


def _stop(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM lets `shardflow launch` stop its roles; SIGKILL the group if it does not exit in time."""
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=15)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def summarize(result: dict[str, Any], target: Target | None) -> SizeRow:
    training_s = float(result["training_s"])
    worker_steps = [int(n) for n in result["worker_steps"].values() if n > 0]
    history = result.get("eval_history") or []
    if not history and result.get("metrics"):
        history = [{"global_step": result["global_step"], "elapsed_s": training_s, "metrics": result["metrics"]}]
    reached = first_reached(target, history) if target is not None else None
    metric = target.metric if target is not None else "loss"
    final = result.get("metrics", {}).get(metric)
    profile_dir = result.get("profile_dir")
    return SizeRow(
        num_workers=int(result["num_workers"]),
        num_ps=int(result["num_ps"]),
        mode=str(result["mode"]),
        global_step=int(result["global_step"]),
        training_s=training_s,
        sec_per_step=sum(training_s / n for n in worker_steps) / len(worker_steps) if worker_steps else float("nan"),
        global_steps_per_s=int(result["global_step"]) / training_s if training_s > 0 else float("nan"),
        target_step=reached.global_step if reached else None,
        target_s=reached.elapsed_s if reached else None,
        final_metric=float(final) if final is not None else None,
        result=result,
        breakdown=breakdown(Path(profile_dir)) if profile_dir else None,
    )


def breakdown(capture: Path) -> Breakdown | None:
    """The profiler's per-role step breakdown of one capture, reduced to the workers' mean and the busiest PS."""
    from shardflow.profile.capture import finalize
    from shardflow.profile.diagnose import CATEGORIES, diagnose, steps
    from shardflow.profile.diagnose import summarize as summarize_steps
    from shardflow.profile.events import load

    table = load(finalize(capture))
    summaries = summarize_steps(steps(table))
    workers = [s for s in summaries if s.role.startswith("worker")]
    if not workers:
        return None
    parts = (*CATEGORIES, "idle")
    fractions = {part: sum(s.fraction(part) for s in workers) / len(workers) for part in parts}
    servers = [(s.fraction("apply") + s.fraction("communication"), s.role) for s in summaries if s.role[:2] == "ps"]
    ps_busy, busiest = max(servers) if servers else (0.0, None)
    findings = diagnose(table)
    return Breakdown(fractions, busiest, ps_busy, findings[0].message if findings else "")
