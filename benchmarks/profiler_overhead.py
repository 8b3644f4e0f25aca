"""The always-on span recorder in a real run, and capture + merge of a 7-process job.

1. Async MLP 64-512-512-10, batch 32, 1 PS + 2 workers, with the recorder on and off (SHARDFLOW_RECORDER=off),
   alternating runs; reports global steps/s of each and the overhead (target <= 2% of step time).
2. A 7-process job (chief, 2 PS, 4 workers) capturing 5 steps: time to collect the role traces and merge them.

Usage: python benchmarks/profiler_overhead.py [--steps N] [--repeats R]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).parent


def run_job(workers: int, ps: int, steps: int, env: dict[str, str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        env = {**os.environ, "SHARDFLOW_MODEL_DIR": str(Path(tmp) / "model"), **env}
        subprocess.run(
            [sys.executable, str(HERE / "jobs" / "mlp_async.py"), str(out), str(workers), str(ps), str(steps)],
            check=True,
            timeout=900,
            stdout=subprocess.DEVNULL,
            env=env,
        )
        result = json.loads(out.read_text())
        if result.get("profile_dir"):
            result["capture"] = json.loads((Path(result["profile_dir"]) / "capture.json").read_text())
        return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--repeats", type=int, default=4)
    args = parser.parse_args()

    on, off = [], []
    for _ in range(args.repeats):
        off.append(run_job(2, 1, args.steps, {"SHARDFLOW_RECORDER": "off"})["steps_per_s"])
        on.append(run_job(2, 1, args.steps, {})["steps_per_s"])
    best_on, best_off = max(on), max(off)
    overhead = best_off / best_on - 1  # extra step time with the recorder
    print(f"recorder off: {best_off:.0f} steps/s (runs {', '.join(f'{r:.0f}' for r in off)})")
    print(f"recorder on:  {best_on:.0f} steps/s (runs {', '.join(f'{r:.0f}' for r in on)})")
    print(f"step-time overhead of the always-on recorder: {overhead:+.1%} (target <= 2%)")

    capture = run_job(4, 2, 400, {"SHARDFLOW_PROFILE_STEPS": "300,305"})
    timing = capture.get("capture", {})
    print(
        f"capture of 5 steps on 7 processes: collect {timing.get('collect_s', float('nan')):.2f}s, "
        f"merge {timing.get('merge_s', float('nan')):.2f}s"
    )
    print(
        "RESULT "
        + json.dumps(
            {
                "recorder_on_steps_per_s": best_on,
                "recorder_off_steps_per_s": best_off,
                "recorder_overhead": overhead,
                **{f"capture_{k}": v for k, v in timing.items()},
            }
        )
    )


if __name__ == "__main__":
    main()
