"""`make bench`: every benchmark, each running its peer side by side; figures go to BENCHMARKS.md by hand.

Usage: python benchmarks/run_all.py [--quick] [NAME ...]   (names: the script names without .py)
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent
# Quickest first; each prints a table and one `RESULT {json}` line.
BENCHMARKS = [
    "comm_roundtrip",
    "ps_training",
    "profiler_overhead",
    "profiler",
    "input_formats",
    "input_pipeline",
    "plan_validation",
]
QUICK_FLAGS = {
    "ps_training": ["--steps", "1000", "--repeats", "1"],
    "profiler_overhead": ["--steps", "1000", "--repeats", "1"],
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    parser.add_argument("names", nargs="*", metavar="NAME", help=f"some of: {', '.join(BENCHMARKS)}")
    args = parser.parse_args()
    unknown = sorted(set(args.names) - set(BENCHMARKS))
    if unknown:
        parser.error(f"unknown benchmark {', '.join(unknown)}; choose from {', '.join(BENCHMARKS)}")
    failed = []
    for name in args.names or BENCHMARKS:
        script = HERE / f"{name}.py"
        if not script.exists():
            print(f"== {name}: missing", flush=True)
            failed.append(name)
            continue
        flags = QUICK_FLAGS.get(name, ["--quick"]) if args.quick else []
        print(f"== {name} {' '.join(flags)}", flush=True)
        started = time.monotonic()
        code = subprocess.run([sys.executable, str(script), *flags]).returncode
        print(f"== {name}: exit {code} after {time.monotonic() - started:.0f}s\n", flush=True)
        if code:
            failed.append(name)
    if failed:
        print(f"failed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
