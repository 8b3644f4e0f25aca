"""Entry point of the `shardflow` command: dispatches to the subcommand modules in COMMANDS."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Sequence
from types import ModuleType

from shardflow import __version__
from shardflow.cli import data, export, launch, plan, profile, scale

# Each module has add_arguments(parser) and run(args) -> int, and imports heavy dependencies
# inside run() so that `shardflow --help` stays fast.
COMMANDS: dict[str, ModuleType] = {
    "launch": launch,
    "profile": profile,
    "data": data,
    "plan": plan,
    "scale": scale,
    "export": export,
}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="shardflow",
        description="Parameter-server training, input pipelines and profiling for PyTorch.",
    )
    parser.add_argument("--version", action="version", version=f"shardflow {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, module in COMMANDS.items():
        summary = (module.__doc__ or "").strip().splitlines()[0]
        subparser = subparsers.add_parser(
            name,
            help=summary,
            description=summary,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.add_arguments(subparser)
    args = parser.parse_args(argv)
    try:
        code: int = COMMANDS[args.command].run(args)
        sys.stdout.flush()
    except BrokenPipeError:
        # The reader went away (`shardflow profile top DIR | head -1`): stop quietly, with the status a process
        # killed by SIGPIPE has. stdout goes to devnull so that flushing it at exit does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    return code
