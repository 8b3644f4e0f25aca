"""`make faults`: inject each fault into real jobs, several times at random moments, and write RELIABILITY.md.

Every run is tests/integration/jobs/audit.py (2 PS, 2 workers, 1024 records of 8), whose final parameters count how
many times each record's gradient was applied. A fault is a SIGKILL at an exact point (SHARDFLOW_FAULT, see
src/shardflow/faults.py) at a random step, a SIGKILL of a PS from outside at a random moment (as an operator or the
kernel's OOM killer would; shared-memory lanes on and off), or a SIGTERM from outside at a random moment. After each
run: did the job end by itself with exit status 0 at the exact global step (or, for a fault the job cannot survive
alone, did the next run of the same command resume and end so), how many records were applied twice or never, how
many steps were lost, how long until the fault was detected and until training went on.

Times come from the moments lines of output arrive: the fault is when its marker file was written (the process dies
0.1 s later), detection is the launcher's line saying the process exited, recovery is the last line of a rejoining
worker after it.

The all-reduce faults run the same job under sf.AllReduceStrategy (2 workers, no PS; `"mode": "allreduce"`), the
chief's under `shardflow launch`, which restarts it.

Usage: python benchmarks/faults.py [--runs N] [--seed S] [--out RELIABILITY.md] [--only TEXT]
(the issue's "each PS killed from outside, 5 runs each": --runs 5 --only "from outside")
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
from audited_runs import BATCH, NUM_RECORDS, ROOT, Run, audit, fmt, median, write_block
from safetensors.torch import load_file

from shardflow import env as shardflow_env
from shardflow.cluster.zygote import role_of


@dataclass(frozen=True)
class Fault:
    name: str
    mode: str
    role: str = ""
    point: str = ""
    steps: tuple[int, int] = (0, 0)
    """The fault's step is drawn from this range (inclusive)."""
    sigterm: bool = False
    """SIGTERM to the job from outside, 1 to 3 s into training, in place of a fault point."""
    killed_from_outside: bool = False
    """SIGKILL to `role`'s process from outside, 0.2 to 2 s into training, in place of a fault point."""
    launched: bool = False
    """Under `shardflow launch` (which restarts a chief killed by a signal), not `python audit.py`."""
    config: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)


FAULTS = [
    Fault("worker SIGKILLed mid-push (async)", "async", "worker:1", "push", (5, 55)),
    Fault("worker SIGKILLed mid-push (sync)", "sync", "worker:1", "push", (5, 55)),
    Fault(
        "PS SIGKILLed mid-apply (async)",
        "async",
        "ps:1",
        "apply",
        (20, 100),
        config={"save_checkpoints_steps": 16, "step_delay_s": 0.05},
    ),
    Fault(
        "PS SIGKILLed mid-apply (sync)",
        "sync",
        "ps:1",
        "apply",
        (10, 50),
        config={"save_checkpoints_steps": 8, "step_delay_s": 0.05},
    ),
    Fault(
        "chief SIGKILLed inside a checkpoint save",
        "async",
        "chief",
        "checkpoint",
        (1, 6),
        config={"save_checkpoints_steps": 16, "step_delay_s": 0.02},
    ),
    Fault("SIGTERM to the job (preemption)", "async", sigterm=True, config={"step_delay_s": 0.05}),
    *[
        Fault(
            f"{ps} SIGKILLed from outside ({mode}, lanes {lanes})",
            mode,
            ps,
            killed_from_outside=True,
            config={"save_checkpoints_steps": 16, "step_delay_s": 0.04},
            env={shardflow_env.SHARED_MEMORY: lanes},
        )
        for ps in ("ps:0", "ps:1")
        for mode in ("async", "sync")
        for lanes in ("on", "off")
    ],
    # The audit job with an sf.nn.DynamicEmbedding counting records too (rows made on the PS, in checkpoint files).
    *[
        Fault(
            f"{role} SIGKILLed from outside (async, dynamic table)",
            "async",
            role,
            killed_from_outside=True,
            config={"save_checkpoints_steps": 16, "step_delay_s": 0.04, "dynamic": True},
        )
        for role in ("worker:1", "ps:1")
    ],
    # The audit job under sf.AllReduceStrategy: a worker restarted rejoins the group, a chief restarted adopts it.
    *[
        Fault(
            f"{role} SIGKILLed from outside (all-reduce{', shardflow launch' if role == 'chief' else ''})",
            "allreduce",
            role,
            killed_from_outside=True,
            launched=role == "chief",
            config={"save_checkpoints_steps": 8, "step_delay_s": 0.04},
        )
        for role in ("worker:0", "worker:1", "chief")
    ],
    Fault(
        "chief SIGKILLed inside a checkpoint save (all-reduce)",
        "allreduce",
        "chief",
        "checkpoint",
        (1, 6),
        config={"save_checkpoints_steps": 8, "step_delay_s": 0.04},
    ),
    # A NaN loss in one batch of worker:1, with max_nonfinite_updates=2: that batch is refused on every PS and
    # counted, and training goes on; its 8 records are the only ones never applied.
    Fault("NaN loss in one batch", "async", point="nan", steps=(0, 63), config={"max_nonfinite_updates": 2}),
]


@dataclass
class Outcome:
    fault: str
    step: int | None
    survived: bool
    how: str
    twice: int
    never: int
    steps_lost: int | None
    detect_s: float | None
    recover_s: float | None


def run_once(fault: Fault, rng: random.Random, workdir: Path) -> Outcome:
    config = {
        "model_dir": str(workdir / "model"),
        "result": str(workdir / "result.json"),
        "mode": fault.mode,
        "restart_backoff_s": 0.5,
        "step_log": str(workdir / "steps.log"),
        **fault.config,
    }
    env = {**os.environ, **fault.env}
    marker = workdir / "fault.fired"
    step = None
    if fault.point == "nan":
        batch = 2 * rng.randint(*fault.steps) + 1  # worker:1 reads batches 1, 3, 5, ...
        config["nan_at"] = [1, batch * BATCH]
        step = batch
    elif not fault.sigterm and not fault.killed_from_outside:
        step = rng.randint(*fault.steps)
        if fault.point == "checkpoint":
            step *= int(fault.config["save_checkpoints_steps"])
        env["SHARDFLOW_FAULT"] = json.dumps(
            {"role": fault.role, "point": fault.point, "step": step, "marker": str(marker)}
        )
    run = Run(workdir, config, env, _launch(fault)) if fault.launched else Run(workdir, config, env)
    fired_at: float | None = None
    if fault.sigterm:
        fired_at = _sigterm_during_training(run, workdir, rng)
    if fault.killed_from_outside:
        fired_at = _kill_during_training(run, workdir, rng, fault.role)
    returncode = run.wait()
    if marker.exists():
        fired_at = marker.stat().st_mtime + 0.1  # the process sleeps 0.1 s, then SIGKILLs itself
    how = "by itself"
    steps_lost = None
    detect_s = recover_s = None
    if fired_at is not None and not fault.sigterm:
        detected = run.first(r"\[launcher\] .* exited with code -9", fired_at - 0.5)
        detect_s = detected[0] - fired_at if detected else None
        # A worker restored to the start of the run (no checkpoint yet) has no steps to rejoin with.
        rejoined = run.last(
            r"rejoins the job|restored; rejoining|joined the all-reduce group at|adopted the live all-reduce", fired_at
        )
        recover_s = rejoined[0] - fired_at if rejoined else None
        lost = run.first(r"the (\d+) steps since are done again")
        # A worker's fault, or a chief restarted into the running job, loses no step.
        nothing_lost = fault.role.startswith("worker") or fault.launched
        steps_lost = int(lost[1][1]) if lost else (0 if nothing_lost else None)
    if returncode != 0:
        # Not survived alone: run the same command again, as a user or a cluster manager would.
        how = f"exit {returncode}; the next run resumed"
        rerun = Run(workdir, config, {k: v for k, v in os.environ.items() if k != "SHARDFLOW_FAULT"})
        if rerun.wait() != 0:
            return Outcome(fault.name, step, False, f"exit {returncode}, rerun failed", 0, 0, None, detect_s, None)
        # Training went on when the re-run's workers rejoined at the checkpoint's positions.
        rejoined = rerun.last(r"rejoins the job")
        recover_s = rejoined[0] - fired_at if rejoined and fired_at is not None else None
        resumed = json.loads((workdir / "result.json").read_text())
        if fault.sigterm:
            how = f"exit {returncode} (checkpoint at step {resumed['start_step']}); the next run resumed there"
            steps_lost = 0
        elif step is not None:
            # Killed while saving `step`: the re-run starts from the checkpoint before (at least these are lost).
            how = f"exit {returncode}; the next run resumed from step {resumed['start_step']}"
            steps_lost = step - int(resumed["start_step"])
    if fault.point == "nan":
        return _refused_batch(fault, step, workdir, returncode, run.text)
    exact, twice, never, why = audit(workdir, fault.mode)
    if not exact:
        how += f"; audit failed: {why}"
    return Outcome(fault.name, step, exact, how, twice, never, steps_lost, detect_s, recover_s)


def _sigterm_during_training(run: Run, workdir: Path, rng: random.Random) -> float:
    """SIGTERM to the job at a random moment once training has started; returns that moment."""
    _wait_for_training(run, workdir)
    time.sleep(rng.uniform(0.5, 2.5))  # of about 3 s of training
    fired_at = time.time()
    run.proc.send_signal(signal.SIGTERM)
    return fired_at


def _kill_during_training(run: Run, workdir: Path, rng: random.Random, role: str) -> float | None:
    """SIGKILL to `role`'s process at a random moment once training has started; returns that moment (None: the
    job ended before it could be killed)."""
    _wait_for_training(run, workdir)
    time.sleep(rng.uniform(0.2, 2.0))  # of about 2.5 s of training
    while run.proc.poll() is None:
        for child in psutil.Process(run.proc.pid).children(recursive=True):
            try:
                if role_of(child) == role:
                    fired_at = time.time()
                    os.kill(child.pid, signal.SIGKILL)
                    return fired_at
            except (psutil.Error, ProcessLookupError):
                continue
        time.sleep(0.02)  # between two runs of it
    return None


def _launch(fault: Fault) -> list[str]:
    """The `shardflow launch` command line before audit.py, for a fault run under it."""
    num_ps = "0" if fault.mode == "allreduce" else "2"
    return [sys.executable, "-m", "shardflow", "launch", "--workers", "2", "--ps", num_ps, "--restart-backoff", "0.5"]


def _wait_for_training(run: Run, workdir: Path, timeout_s: float = 120) -> None:
    """Until a worker computed its first batch (the job's step log), the job ended, or `timeout_s` passed."""
    deadline = time.monotonic() + timeout_s
    while not (workdir / "steps.log").exists() and run.proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)


def _refused_batch(fault: Fault, batch: int | None, workdir: Path, returncode: int, out: str) -> Outcome:
    """Survived: exit 0, one refusal counted, the bad batch's records never applied, every other one once."""
    result = json.loads((workdir / "result.json").read_text())
    seen = load_file(str(Path(result["checkpoint"]) / "model.safetensors"))["seen"]
    applied = seen.round().long()
    twice, never = int((applied >= 2).sum()), int((applied == 0).sum())
    assert batch is not None
    bad = slice(batch * BATCH, (batch + 1) * BATCH)
    refused = sum(int(stats.get("nonfinite", 0)) for stats in result["ps_stats"].values() if isinstance(stats, dict))
    exact = (
        returncode == 0
        and bool((applied[bad] == 0).all())
        and never == BATCH
        and twice == 0
        and result["global_step"] == NUM_RECORDS // BATCH - 1
    )
    named = "worker:1 computed a NaN or inf loss" in out
    how = f"exit {returncode}; refused on {refused} PS, named in the log: {named}"
    return Outcome(fault.name, batch, exact and named, how, twice, never, 1, None, None)


def write_report(outcomes: list[Outcome], path: Path, command: str, seconds: float) -> None:
    today = datetime.date.today().isoformat()
    lines = [
        f"Measured {today} by `{command}` on this machine (2 cores), {seconds / 60:.0f} minutes in all.",
        "Every run is `tests/integration/jobs/audit.py`: 2 PS (none with all-reduce), 2 workers, 1024 records in",
        "batches of 8, one epoch, whose final parameters count how many times each record's gradient was applied.",
        "*Survived* means the job ended at its exact global step with every record applied exactly once: by",
        "itself, or (where the job cannot go on alone) when the same command was run again. Times are from the",
        "fault to the launcher's line that the process exited (detect) and to the last worker's line that it",
        "rejoined training, or the restarted chief's that it adopted the job (recover);",
        "for faults survived by a re-run, recover is the time until that re-run's workers went on (the re-run is",
        "started as soon as the job exits, as a cluster manager's restart policy would). Steps lost are the",
        "global steps done again: after a PS restore, or (chief) from the checkpoint the re-run resumed to the",
        "step whose save was killed, at least.",
        "",
        "## Summary",
        "",
        "| fault | runs | survived | records twice / never | steps lost (median) | detect (median) "
        "| recover (median) |",
        "|---|---|---|---|---|---|---|",
    ]
    for fault in FAULTS:
        runs = [o for o in outcomes if o.fault == fault.name]
        if not runs:
            continue
        lost = median([o.steps_lost for o in runs])
        lines.append(
            f"| {fault.name} | {len(runs)} | {sum(o.survived for o in runs)} of {len(runs)} "
            f"| {sum(o.twice for o in runs)} / {sum(o.never for o in runs)} "
            f"| {'-' if lost is None else f'{lost:.0f}'} | {fmt(median([o.detect_s for o in runs]))} "
            f"| {fmt(median([o.recover_s for o in runs]))} |"
        )
    lines += [
        "",
        "## Every run",
        "",
        "| fault | at step (NaN: batch) | survived | how | twice / never | steps lost | detect | recover |",
    ]
    lines.append("|---|---|---|---|---|---|---|---|")
    for o in outcomes:
        lines.append(
            f"| {o.fault} | {'random moment' if o.step is None else o.step} | {'yes' if o.survived else 'NO'} "
            f"| {o.how} | {o.twice} / {o.never} | {'-' if o.steps_lost is None else o.steps_lost} "
            f"| {fmt(o.detect_s)} | {fmt(o.recover_s)} |"
        )
    lines += [
        "",
        "What the job does after each fault is described in docs/reliability-and-faults.md. With `python audit.py`",
        "the chief is the launcher's own process: a killed chief ends the job, and the next run resumes from the",
        "newest intact checkpoint. Under `shardflow launch` it is restarted and adopts the running job.",
        "",
    ]
    write_block(path, "make faults", "\n".join(lines))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3, help="runs of each fault (3)")
    parser.add_argument("--seed", type=int, default=None, help="seed of the random moments (default: random)")
    parser.add_argument("--out", type=Path, default=ROOT / "RELIABILITY.md")
    parser.add_argument("--only", default="", help="run only the faults whose name contains this")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    started = time.monotonic()
    outcomes = []
    for fault in FAULTS:
        if args.only not in fault.name:
            continue
        for attempt in range(args.runs):
            with tempfile.TemporaryDirectory(prefix="shardflow-fault-") as tmp:
                outcome = run_once(fault, rng, Path(tmp))
            outcomes.append(outcome)
            print(
                f"{fault.name} #{attempt + 1}: step {outcome.step}, survived {outcome.survived} ({outcome.how}), "
                f"twice {outcome.twice}, never {outcome.never}, lost {outcome.steps_lost}, "
                f"detect {fmt(outcome.detect_s)}, recover {fmt(outcome.recover_s)}",
                flush=True,
            )
    command = (
        "make faults" if args.runs == 3 and not args.only else " ".join(["python benchmarks/faults.py", *sys.argv[1:]])
    )
    write_report(outcomes, args.out, command, time.monotonic() - started)
    print(f"wrote {args.out}")
    return 0 if all(o.survived for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
