"""The command line's start-up: `shardflow --version` and `--help`, wall time, and `import shardflow.cli.main`.

Each command runs as a fresh process, as a user types it, alternating with a bare `python -c pass`, the floor under
any Python tool; the import is timed by `python -X importtime`, beside `import torch`, what every command paid when
the entry point imported it. Medians are kept.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

from result_line import print_result, row

TARGET_S = 0.3
"""What `shardflow --version` and `--help` may take, wall time."""


def shardflow_command() -> list[str]:
    """The installed `shardflow` script beside this interpreter, as a user runs it; `python -m shardflow` without."""
    script = Path(sys.executable).parent / "shardflow"
    return [str(script)] if script.exists() else [sys.executable, "-m", "shardflow"]


def wall_s(command: list[str]) -> float:
    started = time.perf_counter()
    subprocess.run(command, stdout=subprocess.DEVNULL, check=True)
    return time.perf_counter() - started


def import_ms(module: str) -> float:
    """The cumulative import time of `module` in a fresh interpreter, from -X importtime."""
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", f"import {module}"], capture_output=True, text=True, check=True
    )
    (cumulative,) = re.findall(rf"^import time:\s+\d+ \|\s+(\d+) \| {re.escape(module)}$", done.stderr, re.MULTILINE)
    return int(cumulative) / 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=15, help="runs of each command, alternating (15)")
    parser.add_argument("--quick", action="store_true", help="3 runs of each")
    args = parser.parse_args()
    repeats = 3 if args.quick else args.repeats
    shardflow = shardflow_command()
    commands = {
        "version": [*shardflow, "--version"],
        "help": [*shardflow, "--help"],
        "python": [sys.executable, "-c", "pass"],
    }
    wall: dict[str, list[float]] = {name: [] for name in commands}
    imports: dict[str, list[float]] = {"shardflow.cli.main": [], "torch": []}
    for _ in range(repeats):
        for name, command in commands.items():
            wall[name].append(wall_s(command))
        imports["shardflow.cli.main"].append(import_ms("shardflow.cli.main"))
    for _ in range(max(1, repeats // 5)):  # a second or two each
        imports["torch"].append(import_ms("torch"))
    median = {name: statistics.median(times) for name, times in {**wall, **imports}.items()}
    for name, value in median.items():
        print(f"{name:20} median {value:.3f} {'ms' if name in imports else 's'}")
    rows = [
        row(
            f"`shardflow --{name}`, wall s (median)",
            median[name],
            "`python -c pass`",
            median["python"],
            target=f"shardflow's time <= {TARGET_S} s",
            met=median[name] <= TARGET_S,
        )
        for name in ("version", "help")
    ]
    rows.append(
        row(
            "`import shardflow.cli.main`, ms (-X importtime)",
            median["shardflow.cli.main"],
            "`import torch`",
            median["torch"],
        )
    )
    print_result("cli_startup", {"command": " ".join(shardflow), "repeats": repeats, "median": median}, rows)


if __name__ == "__main__":
    main()
