"""`shardflow launch`'s local run of every role (LocalLauncher), and the threads each role of a machine gets."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Sequence

from shardflow import env
from shardflow.cluster import liveness
from shardflow.cluster.interrupts import Interrupted, ignore_interrupts, install_interrupt_handlers, restore_handlers
from shardflow.cluster.launcher import PREEMPTED_EXIT_CODE, LocalLauncher
from shardflow.cluster.spec import ClusterSpec


def local_threads(spec: ClusterSpec) -> dict[str, str]:
    """The environment that shares this machine's cores among the roles: otherwise every worker starts one
    torch thread per core and they oversubscribe the machine many times over. A value the user set is kept. A PS
    counts as a role even when it idles between pushes: a worker given its core (SHARDFLOW_LOCAL_THREADS=2, 1w+1PS
    on 2 loaded cores) waited at every op for a descheduled thread, 0.08x one process for the MLP, 0.23x for rec.
    Where the cores per worker are more, the workers may take them (SHARDFLOW_WORKER_THREADS_UP_TO): each times
    its steps with both counts and keeps the faster (train/thread_tuning.py)."""
    if env.get(env.LOCAL_THREADS) is not None:
        return {}
    cores = os.cpu_count() or 1
    share = max(1, cores // max(spec.num("worker") + spec.num("ps"), 1))
    up_to = max(1, cores // max(spec.num("worker"), 1))
    return {env.LOCAL_THREADS: str(share)} | ({env.WORKER_THREADS_UP_TO: str(up_to)} if up_to > share else {})


def run_local(
    spec: ClusterSpec,
    command: Sequence[str],
    grace_s: float = 5.0,
    termination_grace_s: float = 30.0,
    max_restarts: int = 0,
    restart_backoff_s: float = 1.0,
    hung_timeout_s: float | None = liveness.HUNG_TIMEOUT_S,
) -> int:
    """Runs all tasks of `spec` locally until all exit or one fails (`shardflow launch`); a worker, PS or evaluator
    that dies, a chief killed by a signal, or any of them hung for `hung_timeout_s`, is restarted up to
    `max_restarts` times. SIGTERM preempts the job: the chief checkpoints and every task gets `termination_grace_s`
    to exit; the exit status is then 143."""
    launcher = LocalLauncher(
        spec,
        command,
        env=local_threads(spec),
        max_restarts=max_restarts,
        restart_backoff_s=restart_backoff_s,
        hung_timeout_s=hung_timeout_s,
    )
    previous = install_interrupt_handlers()
    try:
        launcher.start()
        failure = launcher.wait()
        if failure is None:
            return 0
        if failure.task.type == "chief" and failure.returncode == PREEMPTED_EXIT_CODE:
            # A role was preempted and the chief ended the job; the others are on their way out.
            print("shardflow launch: the job was preempted; stopping all roles", file=sys.stderr, flush=True)
            launcher.preempt(termination_grace_s)
            return PREEMPTED_EXIT_CODE
        print(
            f"shardflow launch: {failure.describe()}; stopping the other roles",
            file=sys.stderr,
            flush=True,
        )
        return 1
    except Interrupted as interrupted:
        if interrupted.signum != signal.SIGTERM:
            print("shardflow launch: interrupted; stopping all roles", file=sys.stderr, flush=True)
            return 130
        print(
            f"shardflow launch: SIGTERM; the chief checkpoints and every role exits within {termination_grace_s:g}s",
            file=sys.stderr,
            flush=True,
        )
        try:
            chief = launcher.preempt(termination_grace_s)
        except Interrupted:  # a second signal: stop now
            print("shardflow launch: interrupted; stopping all roles", file=sys.stderr, flush=True)
            return PREEMPTED_EXIT_CODE
        if chief == 0:  # training had ended (its final checkpoint written) when SIGTERM reached the chief
            print("shardflow launch: the job had ended before SIGTERM reached the chief; it is done", file=sys.stderr)
            return 0
        return PREEMPTED_EXIT_CODE
    finally:
        ignore_interrupts(previous)
        launcher.stop(grace_s)
        restore_handlers(previous)
