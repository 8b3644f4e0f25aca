"""PS training of this tree against the tree at an earlier commit, alternating: async and sync, 2 workers + 1 PS.

The same job script (benchmarks/jobs/mlp_async.py, public API only) runs on shardflow's source from this checkout
and from `git archive REVISION`, one after the other, `--repeats` times; the medians are compared. A refactor that
claims "throughput unchanged" is measured with it.

Usage: python benchmarks/ps_against_commit.py REVISION [--steps N] [--repeats R]
"""

from __future__ import annotations

import argparse
import io
import statistics
import subprocess
import tarfile
import tempfile
from pathlib import Path

from ps_training import shardflow_job
from result_line import print_result, row

ROOT = Path(__file__).resolve().parents[1]


def extract_source(revision: str, into: Path) -> Path:
    """shardflow's src/ at `revision`, extracted under `into`; returns the directory to put on PYTHONPATH."""
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", "--format=tar", revision, "src"], check=True, capture_output=True
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    return into / "src"


def alternate(revision: str, steps: int, repeats: int, mode: str, source: Path) -> tuple[list[float], list[float]]:
    """Steps/s of this tree and of `revision`'s, one run each per repeat, this tree first in odd repeats."""
    here, there = [], []
    for repeat in range(repeats):
        order = [("here", ROOT / "src"), ("there", source)]
        for which, path in order if repeat % 2 == 0 else reversed(order):
            result = shardflow_job(2, 1, steps, mode=mode, env={"PYTHONPATH": str(path)})
            if result["global_step"] != steps:
                raise RuntimeError(f"the {mode} job of {which} ended at global step {result['global_step']}")
            (here if which == "here" else there).append(result["steps_per_s"])
    print(f"{mode} 2w+1PS, this tree, steps/s: {', '.join(f'{v:.0f}' for v in here)}")
    print(f"{mode} 2w+1PS, {revision}, steps/s: {', '.join(f'{v:.0f}' for v in there)}")
    return here, there


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("revision", help="the commit to compare with (anything git names a commit by)")
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--repeats", type=int, default=4)
    args = parser.parse_args()
    figures: dict[str, object] = {"revision": args.revision}
    rows = []
    with tempfile.TemporaryDirectory() as directory:
        source = extract_source(args.revision, Path(directory))
        for mode in ("async", "sync"):
            here, there = alternate(args.revision, args.steps, args.repeats, mode, source)
            figures[f"{mode}_here_steps_per_s"], figures[f"{mode}_there_steps_per_s"] = here, there
            measure = f"{mode} 2 workers + 1 PS, global steps/s (medians of {args.repeats})"
            rows.append(row(measure, statistics.median(here), f"the tree at {args.revision}", statistics.median(there)))
            print(f"{mode}: this tree / {args.revision} = {rows[-1]['ratio']:.2f}x (medians)")
    print_result("ps_against_commit", figures, rows)


if __name__ == "__main__":
    main()
