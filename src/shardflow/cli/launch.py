"""Start a local cluster: one process per role, all running the same training script."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

from shardflow.cluster.liveness import HUNG_TIMEOUT_S

EPILOG = """\
example:
  shardflow launch --workers 4 --ps 2 train.py --lr 0.1

Every role runs `python train.py --lr 0.1`; the environment variable SHARDFLOW_CLUSTER tells
each process its role. Output lines are prefixed with the role, e.g. "[worker:0] ...".
A worker, PS or evaluator that dies, a chief killed by a signal, or any role that hangs (its
liveness file untouched for --hung-timeout seconds from its start: it is killed), is restarted
(--max-restarts times, after a back-off that doubles from --restart-backoff seconds, and starts over
after a minute's healthy run); a restarted worker resumes its input after the last step every PS
applied, a restarted PS makes every PS reload the latest checkpoint, and a restarted chief resumes
from the live PS, so no record is applied twice or lost. If a role fails for good (the chief exits
with an error, a role raises, or the restarts run out), the others are stopped and the exit code is
1; Ctrl-C stops all roles (130).
The roles share a fresh secret made for this job (unless SHARDFLOW_CLUSTER_SECRET is set): no
other process can push to, pull from, stop, or write a control key of the job.
SIGTERM, as a cluster manager sends on preemption, goes to the chief: it checkpoints at the current
step and ends the job, every role exits, and the exit code is 143; launching again resumes there. (0 if the
job had ended before SIGTERM reached its chief: there is nothing to resume.)
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = EPILOG
    parser.add_argument("--workers", type=_count(minimum=1), default=1, metavar="N", help="number of workers (1)")
    parser.add_argument("--ps", type=_count(minimum=0), default=1, metavar="M", help="number of PS (1)")
    parser.add_argument("--evaluator", action="store_true", help="also start an evaluator")
    parser.add_argument(
        "--grace",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="how long roles get to exit after SIGTERM before SIGKILL (5)",
    )
    parser.add_argument(
        "--termination-grace",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="on SIGTERM, how long the chief gets to checkpoint and every role to exit before they are stopped; "
        "as the script's ParameterServerStrategy.termination_grace_s (30)",
    )
    parser.add_argument(
        "--max-restarts",
        type=_count(minimum=0),
        default=3,
        metavar="N",
        help="how many times each worker, PS or evaluator that dies, or chief killed by a signal, is restarted (3)",
    )
    parser.add_argument(
        "--restart-backoff",
        type=float,
        default=1.0,
        metavar="SECONDS",
        help="wait before a role's first restart, doubled for each further one, at most 30 (1)",
    )
    parser.add_argument(
        "--hung-timeout",
        type=float,
        default=HUNG_TIMEOUT_S,
        metavar="SECONDS",
        help="a role whose liveness file stays untouched this long from its start is killed and restarted, while it "
        f"has restarts left; as the script's ParameterServerStrategy.hung_timeout_s ({HUNG_TIMEOUT_S:g})",
    )
    parser.add_argument("script", help="the Python training script every role runs")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments passed to the script untouched")


def run(args: argparse.Namespace) -> int:
    if not os.path.exists(args.script):
        print(
            f"shardflow launch: error: script {args.script!r} does not exist (looked in {os.getcwd()})",
            file=sys.stderr,
        )
        return 2
    # Here, not at the top: the launcher brings torch and ZeroMQ, which `shardflow --help` need not wait for.
    from shardflow.cluster.local_job import run_local
    from shardflow.cluster.spec import ClusterSpec, release_local_ports

    spec = ClusterSpec.local(args.workers, args.ps, evaluator=args.evaluator)
    command = [sys.executable, args.script, *args.script_args]
    try:
        return run_local(
            spec,
            command,
            grace_s=args.grace,
            termination_grace_s=args.termination_grace,
            max_restarts=args.max_restarts,
            restart_backoff_s=args.restart_backoff,
            hung_timeout_s=args.hung_timeout,
        )
    finally:
        release_local_ports(spec)


def _count(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    parse.__name__ = "integer"  # argparse names the type in its "invalid ... value" message
    return parse
