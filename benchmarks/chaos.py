"""`make chaos`: kill and hang random roles of real jobs at random moments for a set time; writes its block of
RELIABILITY.md.

Jobs run back to back: tests/integration/jobs/audit.py (1 chief, 2 PS, 2 workers; each record's gradient counted in the
final parameters), the PS strategy async and sync and sf.HybridStrategy (its table on the PS), under `shardflow launch`
(which restarts a worker or PS that dies) or with every role under TF_CONFIG and this driver as their supervisor,
restarting any role that fails, the chief included (benchmarks/chaos_jobs.py). In each job, a few seconds into training,
a seeded random schedule fires 3 to 5 faults, 8 to 15 s apart: SIGKILL a worker, a PS or (under TF_CONFIG) the chief;
SIGSTOP one, for 5 to 15 s or for good; two roles SIGKILLed at once; a role SIGKILLed again during its recovery. Each
job must end by itself before a generous deadline, exit 0, at its exact global step with every record applied once; a
job that does not is killed with its whole process tree, and any process of it still alive after is counted as an
orphan.

Usage: python benchmarks/chaos.py [--minutes 10] [--seed S] [--out RELIABILITY.md] [--log-dir DIR] [--job-deadline S]
       [--modes async,sync,hybrid]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from audited_runs import ROOT, Lines, audit, fmt, median, write_block
from chaos_jobs import ChaosJob, LaunchedJob, SupervisedJob

NUM_RECORDS, BATCH = 8192, 8
JOB_CONFIG = {"num_records": NUM_RECORDS, "batch": BATCH, "step_delay_s": 0.05, "save_checkpoints_steps": 64}
"""About a minute of training when nothing goes wrong: 1024 global steps (async; 512 sync), a checkpoint every 64."""
FLAVOURS = (
    ("async", "launch"),
    ("sync", "TF_CONFIG"),
    ("sync", "launch"),
    ("async", "TF_CONFIG"),
    ("hybrid", "launch"),
    ("hybrid", "TF_CONFIG"),
)
"""Jobs take turns in this order among the modes asked for (--modes): async and sync PS, and sf.HybridStrategy."""
DEFAULT_MODES = ("async", "sync", "hybrid")
MODE_NAMES = {"async": "the PS strategy async", "sync": "sync", "hybrid": "sf.HybridStrategy (its table on the PS)"}
WORKERS, SERVERS = ("worker:0", "worker:1"), ("ps:0", "ps:1")
DEADLINE_S, DEADLINE_PER_FAULT_S = 180.0, 60.0
"""A job not ended by itself after DEADLINE_S + DEADLINE_PER_FAULT_S per fault has failed."""

KILL_WORKER, KILL_PS, KILL_CHIEF = "worker SIGKILLed", "PS SIGKILLed", "chief SIGKILLed, restarted under TF_CONFIG"
KILL_TWO, KILL_AGAIN = "two roles SIGKILLed at once", "a role SIGKILLed again during its recovery"
STALL_WORKER, STALL_PS, STALL_CHIEF = "worker hung 5-15 s", "PS hung 5-15 s", "chief hung 5-15 s (TF_CONFIG)"
HANG_WORKER, HANG_PS = "worker hung for good", "PS hung for good"
KINDS = (
    KILL_WORKER,
    KILL_PS,
    KILL_CHIEF,
    KILL_TWO,
    KILL_AGAIN,
    STALL_WORKER,
    STALL_PS,
    STALL_CHIEF,
    HANG_WORKER,
    HANG_PS,
)
ONLY_TF_CONFIG = (KILL_CHIEF, STALL_CHIEF)
ONLY_LAUNCH = (HANG_WORKER, HANG_PS)
"""Under TF_CONFIG nothing here watches a live but silent process (a cluster manager's liveness probe would)."""


@dataclass(frozen=True)
class Fault:
    kind: str
    roles: tuple[str, ...]
    delay_s: float
    """After training started (the first fault) or after the previous fault fired."""
    stop_s: float | None = None
    """SIGSTOP, then SIGCONT after this long; with kind "hung for good", never."""
    again_after_s: float | None = None
    """SIGKILL again this long after the role's new process appeared."""

    @property
    def stops(self) -> bool:
        return "hung" in self.kind


@dataclass(frozen=True)
class JobPlan:
    index: int
    mode: str
    supervisor: str
    faults: tuple[Fault, ...]


def plan_job(seed: int, index: int, modes: Sequence[str] = DEFAULT_MODES) -> JobPlan:
    """The `index`th job of the soak with this seed: its flavour (of `modes`), and its faults with their moments
    and roles."""
    rng = random.Random(f"chaos/{seed}/{index}")
    flavours = [flavour for flavour in FLAVOURS if flavour[0] in modes]
    mode, supervisor = flavours[index % len(flavours)]
    excluded = ONLY_LAUNCH if supervisor == "TF_CONFIG" else ONLY_TF_CONFIG
    kinds = [kind for kind in KINDS if kind not in excluded]
    faults = []
    for number in range(rng.randint(3, 5)):
        delay_s = rng.uniform(3, 8) if number == 0 else rng.uniform(8, 15)
        faults.append(_draw(rng.choice(kinds), rng, round(delay_s, 1), supervisor))
    return JobPlan(index, mode, supervisor, tuple(faults))


def _draw(kind: str, rng: random.Random, delay_s: float, supervisor: str) -> Fault:
    others = WORKERS + SERVERS + (("chief",) if supervisor == "TF_CONFIG" else ())
    if kind == KILL_TWO:
        return Fault(kind, tuple(sorted(rng.sample(others, 2))), delay_s)
    if kind == KILL_AGAIN:
        return Fault(kind, (rng.choice(WORKERS + SERVERS),), delay_s, again_after_s=round(rng.uniform(0.2, 3), 1))
    role = "chief" if "chief" in kind else rng.choice(WORKERS if kind.startswith("worker") else SERVERS)
    stop_s = round(rng.uniform(5, 15), 1) if "5-15 s" in kind else None
    return Fault(kind, (role,), delay_s, stop_s=stop_s)


@dataclass
class Fired:
    """A fault as it happened: when (time.time()), and the second SIGKILL of KILL_AGAIN."""

    fault: Fault
    at: float
    again_at: float | None = None
    detect_s: float | None = None
    recover_s: float | None = None
    steps_lost: int = 0
    survived: bool = False


@dataclass
class JobOutcome:
    plan: JobPlan
    fired: list[Fired]
    returncode: int | None
    """None: it had not ended by itself at its deadline."""
    started: float
    seconds: float
    exact: bool = False
    twice: int = 0
    never: int = 0
    why: str = ""
    steps_lost: int = 0
    orphans: int = 0

    @property
    def survived(self) -> bool:
        return self.returncode == 0 and self.exact


def run_job(plan: JobPlan, workdir: Path, log: IO[str], deadline_s: float | None = None) -> JobOutcome:
    """Runs one job with its faults to its end (or its deadline: by default DEADLINE_S and DEADLINE_PER_FAULT_S
    per fault), then audits it and cleans its processes up; its output goes to `log` as it comes."""
    config = {**JOB_CONFIG, "model_dir": str(workdir / "model"), "result": str(workdir / "result.json")}
    config["mode"] = plan.mode
    env = {**os.environ, "SHARDFLOW_CLUSTER_SECRET": f"chaos-{plan.index}-{random.getrandbits(64):x}"}
    started = time.time()
    job: ChaosJob = (LaunchedJob if plan.supervisor == "launch" else SupervisedJob)(workdir, config, env)
    job.lines.log = log
    fired: list[Fired] = []
    try:
        if _wait_for_training(job, workdir / "model" / "job.json"):
            for fault in plan.faults:
                if not job.sleep(fault.delay_s) or (one := fire(job, fault)) is None:
                    break
                fired.append(one)
        if deadline_s is None:
            deadline_s = DEADLINE_S + DEADLINE_PER_FAULT_S * len(fired)
        returncode = job.wait(max(0.0, deadline_s - (time.time() - started)))
        if returncode is None:
            job.lines.add(f"[chaos] the job had not ended by itself after {deadline_s:.0f}s: killed")
    finally:
        job.kill()
    outcome = JobOutcome(plan, fired, returncode, started, time.time() - started)
    outcome.orphans = len(job.kill_leftovers())
    outcome.exact, outcome.twice, outcome.never, outcome.why = audit(workdir, plan.mode, NUM_RECORDS, BATCH)
    if returncode is None:
        outcome.why = "did not end by itself; " + outcome.why
    if not outcome.survived and (error := job.lines.last(r"\w+(Error|Exceeded): .*")) is not None:
        # Without the addresses (a run's temporary paths and ports), which say nothing of the fault.
        text = re.sub(r"(ipc|tcp)://[^ ]*[^ :]", r"\1://...", error[1][0])
        outcome.why += f"; last error: {text[:240]}"
    measure(job.lines, outcome, time.time())
    return outcome


def _wait_for_training(job: ChaosJob, job_file: Path, timeout_s: float = 120) -> bool:
    """Once the PS chief wrote its job file, or a chief (all-reduce's, hybrid's) reported a global step."""
    deadline = time.monotonic() + timeout_s
    while not job_file.exists() and job.lines.first(r"\[chief\] global step \d+") is None:
        if job.ended() or time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def fire(job: ChaosJob, fault: Fault) -> Fired | None:
    """Injects `fault` once all its roles run (waiting up to 30 s for a restarting one); None if the job ended."""
    pids = _running(job, fault.roles, timeout_s=30)
    if pids is None:
        return None
    fired = Fired(fault, time.time())
    signum = signal.SIGSTOP if fault.stops else signal.SIGKILL
    for pid in pids:
        _signal(pid, signum)
    job.lines.add(f"[chaos] {fault.kind}: {' + '.join(fault.roles)} (pids {', '.join(map(str, pids))})")
    if fault.stop_s is not None:
        for pid in pids:
            resume = threading.Timer(fault.stop_s, _signal, (pid, signal.SIGCONT))
            resume.daemon = True
            resume.start()
    if fault.again_after_s is not None:
        again = _running(job, fault.roles, timeout_s=60, other_than=pids)
        if again is not None:
            time.sleep(fault.again_after_s)
            fired.again_at = time.time()
            for pid in again:
                _signal(pid, signal.SIGKILL)
            job.lines.add(f"[chaos] SIGKILLed again: {' + '.join(fault.roles)} (pids {', '.join(map(str, again))})")
    return fired


def _running(
    job: ChaosJob, roles: tuple[str, ...], timeout_s: float, other_than: Sequence[int] = ()
) -> list[int] | None:
    deadline = time.monotonic() + timeout_s
    while not job.ended() and time.monotonic() < deadline:
        pids = job.pids()
        if all(pids.get(role) not in (None, *other_than) for role in roles):
            return [pids[role] for role in roles]
        time.sleep(0.1)
    return None


def _signal(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signum)


def _detected(role: str) -> str:
    return rf"\[(launcher|supervisor)\] {role} \(pid \d+\) exited with code -?[1-9]|{role} is lost"


def _recovered(role: str) -> str:
    if role == "chief":
        # With every PS alive it says so; with a PS restarted too, every PS is restored and the workers rejoin.
        # Hybrid's chief adopts the live group and PS.
        return r"the chief was restarted: (resumed from|adopted the live)|rejoins the job"
    if role.startswith("ps"):
        # A chief restarted with it restores every PS as it starts, and says nothing: then a worker rejoining tells.
        restored = rf"{role} was lost and restarted: every PS restored|PS restored to global step \d+ after {role}"
        return rf"{restored}|{role} rejoined|\] worker:\d+ rejoins the job"
    return rf"\[{role}\] .*rejoins the job|{role} rejoined|{role} joined the all-reduce group at global step"


def measure(lines: Lines, outcome: JobOutcome, ended_at: float) -> None:
    """Each fault's detect and recover times and the steps done again after it (before the next fault), from the
    job's lines; whether the job survived it by itself."""
    moments = [one.at for one in outcome.fired[1:]] + [ended_at] if outcome.fired else []
    for one, until in zip(outcome.fired, moments, strict=True):
        detected = [lines.first(_detected(role), one.at - 0.05) for role in one.fault.roles]
        if one.fault.stop_s is not None:
            # A stall is noticed while it lasts or just after (a heartbeat's timeout); a later exit is another story.
            noticed_by = one.at + one.fault.stop_s + 20
            detected = [found if found and found[0] < noticed_by else None for found in detected]
        after = one.again_at or one.at
        if all(detected):
            one.detect_s = max(found[0] for found in detected if found) - one.at
            after = max(after, one.at + one.detect_s)  # back after it was missed, not before
        recovered = [lines.first(_recovered(role), after) for role in one.fault.roles]
        if all(recovered):
            one.recover_s = max(found[0] for found in recovered if found) - one.at
        for at, line in lines.lines:
            if one.at <= at < until and (found := _steps_again(line)) is not None:
                one.steps_lost += found
        # A job that failed failed of its last fault; an earlier one it went on from (or never noticed) is survived.
        noticed = one.detect_s is not None
        one.survived = outcome.survived or (one is not outcome.fired[-1] and (one.recover_s is not None or not noticed))
    outcome.steps_lost = sum(one.steps_lost for one in outcome.fired)


def _steps_again(line: str) -> int | None:
    marker = " steps since are done again"
    if marker not in line:
        return None
    return int(line.split(marker)[0].rsplit(" ", 1)[1])


@dataclass
class Report:
    seed: int
    minutes: float
    seconds: float
    commit: str
    load: list[float]
    """The 1-minute load average at each job's start."""
    jobs: list[JobOutcome] = field(default_factory=list)
    command: str = "make chaos"
    modes: Sequence[str] = DEFAULT_MODES
    date: str = field(default_factory=lambda: datetime.date.today().isoformat())
    cores: int = field(default_factory=lambda: os.cpu_count() or 1)


def render(report: Report) -> str:
    """RELIABILITY.md's chaos block: a row per fault kind, then a line per job."""
    load = f"{min(report.load):.1f} to {max(report.load):.1f}" if report.load else "-"
    lines = [
        "## Chaos: random faults at random moments (`make chaos`)",
        "",
        *textwrap.wrap(
            f"Measured {report.date} by `{report.command}` at commit {report.commit}, seed {report.seed}: "
            f"{report.minutes:g} minutes asked, {report.seconds / 60:.1f} in all, {len(report.jobs)} jobs, on this "
            f"machine ({report.cores} cores, 1-minute load average {load} as the jobs started). Jobs run back to "
            "back, each `tests/integration/jobs/audit.py` (1 chief, 2 PS, 2 workers, "
            f"{NUM_RECORDS} records in batches of {BATCH}, a checkpoint every {JOB_CONFIG['save_checkpoints_steps']} "
            f"steps), in turns {' and '.join(MODE_NAMES[mode] for mode in report.modes)}, under `shardflow launch` "
            "or with every role under TF_CONFIG and the driver "
            "restarting any role that fails (the chief too). Each job gets 3 to 5 faults from a seeded schedule, "
            "8 to 15 s apart. A fault is *survived by itself* when the job went on from it (its roles recovered, or "
            "nothing noticed it) and, if it was the job's last, the job ended by itself, exit 0, at its exact global "
            "step with every record applied once. Detect: from the signal to the supervisor's line that the process "
            "exited or the chief's that it is lost; recover: to the line that the role is back (a worker rejoins, "
            "every PS restored, the chief resumed); for two roles, the later of the two. Steps lost are the global "
            "steps done again after a PS restore, before the next fault. Records twice / never are those of the jobs "
            "the fault was in.",
            width=115,
        ),
        "",
        "| fault | fired | survived by itself | steps lost (median) | detect (median) | recover (median) "
        "| records twice / never (its jobs) |",
        "|---|---|---|---|---|---|---|",
    ]
    for kind in KINDS:
        fired = [one for job in report.jobs for one in job.fired if one.fault.kind == kind]
        if not fired:
            continue
        jobs = [job for job in report.jobs if any(one.fault.kind == kind for one in job.fired)]
        lost = median([one.steps_lost for one in fired])
        lines.append(
            f"| {kind} | {len(fired)} | {sum(one.survived for one in fired)} of {len(fired)} "
            f"| {'-' if lost is None else f'{lost:.0f}'} | {fmt(median([one.detect_s for one in fired]))} "
            f"| {fmt(median([one.recover_s for one in fired]))} "
            f"| {sum(job.twice for job in jobs)} / {sum(job.never for job in jobs)} |"
        )
    lines += ["", *_job_lines(report.jobs)]
    return "\n".join(lines) + "\n"


def _job_lines(jobs: list[JobOutcome]) -> list[str]:
    survived = sum(job.survived for job in jobs)
    lines = [
        f"Every job ({survived} of {len(jobs)} ended by themselves, exact, every record once; orphans are processes",
        "of a job still alive after it ended, killed):",
        "",
        "| job | mode | supervisor | faults (s into the job) | ended | twice / never | steps lost | orphans | why |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for job in jobs:
        faults = "; ".join(
            f"{one.fault.kind}: {' + '.join(one.fault.roles)} at {one.at - job.started:.0f}"
            + ("" if one.survived else " (NOT survived)")
            for one in job.fired
        )
        ended = "killed at its deadline" if job.returncode is None else f"exit {job.returncode}"
        lines.append(
            f"| {job.plan.index} | {job.plan.mode} | {job.plan.supervisor} | {faults or 'none fired'} | {ended} "
            f"| {job.twice} / {job.never} | {job.steps_lost} | {job.orphans} | {job.why.replace('|', '/') or '-'} |"
        )
    return lines


def _commit() -> str:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=False).stdout.strip()

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    return commit + (" with uncommitted changes" if git("status", "--porcelain", "--untracked-files=no") else "")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10.0, help="how long to start jobs for (10)")
    parser.add_argument("--seed", type=int, default=None, help="seed of the schedule (default: random, printed)")
    parser.add_argument("--out", type=Path, default=ROOT / "RELIABILITY.md")
    parser.add_argument("--log-dir", type=Path, default=None, help="keep each job's output here")
    parser.add_argument(
        "--job-deadline",
        type=float,
        default=None,
        metavar="SECONDS",
        help=f"a job not ended by itself after this long failed ({DEADLINE_S:g} + {DEADLINE_PER_FAULT_S:g} a fault)",
    )
    parser.add_argument(
        "--modes", default=",".join(DEFAULT_MODES), help="of async, sync, hybrid: the jobs' modes, in turns (all three)"
    )
    args = parser.parse_args()
    modes = args.modes.split(",")
    if not modes or any(mode not in {flavour[0] for flavour in FLAVOURS} for mode in modes):
        parser.error(f"--modes {args.modes!r}: give some of async, sync, hybrid, comma-separated")
    seed = args.seed if args.seed is not None else random.randrange(2**31)
    command = "make chaos" if args.minutes == 10 else f"python benchmarks/chaos.py --minutes {args.minutes:g}"
    if args.job_deadline is not None:
        command += f" --job-deadline {args.job_deadline:g}"
    if modes != list(DEFAULT_MODES):
        command += f" --modes {args.modes}"
    report = Report(
        seed=seed, minutes=args.minutes, seconds=0.0, commit=_commit(), load=[], command=command, modes=modes
    )
    print(f"chaos for {args.minutes:g} minutes, seed {seed}", flush=True)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="shardflow-chaos-") as tmp:
        while time.monotonic() - started < args.minutes * 60:
            plan = plan_job(seed, len(report.jobs), modes)
            report.load.append(os.getloadavg()[0])
            workdir = Path(tmp) / f"job-{plan.index}"
            workdir.mkdir()
            log_dir = args.log_dir or workdir
            log_dir.mkdir(parents=True, exist_ok=True)
            with open(log_dir / f"job-{plan.index}.log", "w") as log:
                job = run_job(plan, workdir, log, args.job_deadline)
            report.jobs.append(job)
            print(_job_lines([job])[-1], flush=True)
    report.seconds = time.monotonic() - started
    write_block(args.out, "make chaos", render(report))
    print(f"wrote {args.out}")
    return 0 if all(job.survived and not job.orphans for job in report.jobs) else 1


if __name__ == "__main__":
    sys.exit(main())
