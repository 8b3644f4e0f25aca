"""`shardflow plan` against measured loopback runs: calibrate on one PS run, predict every size (target: within 15%).

The job is the async benchmark's MLP 64-512-512-10 (301k parameters), batch 32, 1 PS, SGD. Each run is profiled in
the middle of training; the plan model is calibrated from the first size's capture (compute per step, bandwidth of
the copies, PS apply time, the CPU of every role per step, and the cores all roles together kept busy). The
measurement compared is the steady rate inside each capture (ps:0's updates per second); the whole-run rate
(global_step / training_s, start-up ramp included) is shown beside it.

Other programs on a shared machine take cores from the job, and CPU per step measured under contention is what the
job will pay at the other sizes too. So the prediction uses the cores the calibrating run's roles really got (what
`shardflow plan --cores measured` does); the prediction for all the machine's cores is shown beside it. Each run
still waits (a while) for a quiet machine and reports the cores other processes used while it ran.

--strategies adds all-reduce and hybrid rows, predicted from the same PS calibration (planning/strategies.py) and
compared with a run of that strategy (the steady rate inside its capture where it has one, else its whole-run
global steps/s); a strategy this tree does not have yet is reported as not available, never estimated.
--calibrate-allreduce-on N calibrates the all-reduce and hybrid rows on the all-reduce run of N workers instead (what
gloo's ring costs here, in wall time and CPU per byte; planning/calibrate_allreduce.py); the PS-calibrated
prediction is shown beside each.

Usage: python benchmarks/plan_validation.py [--quick] [--workers 2,1,4] [--strategies ps,allreduce,hybrid]
       [--calibrate-allreduce-on N] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import psutil
import result_line

JOB_FLAG = "--job"
TARGET_ERROR = 0.15
STRATEGY_CLASSES = {"ps": "ParameterServerStrategy", "allreduce": "AllReduceStrategy", "hybrid": "HybridStrategy"}


def job(max_steps: int, strategy_name: str = "ps", num_workers: int = 1) -> None:
    """Every role runs this; the model dir, result file and profiled steps come from the scale hooks."""
    import torch

    import shardflow as sf

    torch.set_num_threads(1)  # the roles share the machine's cores; more threads per role only contend

    def model_fn() -> torch.nn.Module:
        return torch.nn.Sequential(
            torch.nn.Linear(64, 512),
            torch.nn.ReLU(),
            torch.nn.Linear(512, 512),
            torch.nn.ReLU(),
            torch.nn.Linear(512, 10),
        )

    def input_fn(ctx: sf.InputContext) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        generator = torch.Generator().manual_seed(ctx.worker_index)
        x, y = torch.rand(4096, 64, generator=generator), torch.randint(0, 10, (4096,), generator=generator)
        while True:
            for i in range(0, 4096, 32):
                yield x[i : i + 32], y[i : i + 32]

    def loss_fn(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(model(batch[0]), batch[1])

    strategy = {
        "ps": lambda: sf.ParameterServerStrategy(num_ps=1, mode="async"),
        "allreduce": lambda: sf.AllReduceStrategy(num_workers=num_workers),
        "hybrid": lambda: sf.HybridStrategy(num_ps=1, num_workers=num_workers),
    }[strategy_name]()
    est = sf.Estimator(model_fn, loss_fn, sf.optim.SGD(lr=0.01), strategy, "runs/plan_validation")
    est.train(input_fn, max_steps=max_steps)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer steps per run (a smoke test)")
    # The first size calibrates. 2 workers and a PS already keep 2 cores busy; the CPU a step costs rises once the
    # roles outnumber the cores (switches, caches), which a 1-worker calibration cannot see.
    parser.add_argument("--workers", default="2,1,4", help="sizes; the first one calibrates (2,1,4)")
    parser.add_argument("--strategies", default="ps", help="of ps, allreduce, hybrid: the strategies swept (ps)")
    parser.add_argument(
        "--calibrate-allreduce-on",
        type=int,
        metavar="N",
        help="calibrate the all-reduce and hybrid rows on the all-reduce run of N workers (one of --workers)",
    )
    parser.add_argument("--steps", type=int, help="global steps per run (6000; 1500 with --quick)")
    parser.add_argument("--repeats", type=int, default=1, help="runs per size; the fastest one counts (1)")
    parser.add_argument("--cores", type=int, default=os.cpu_count() or 1, help="cores the roles share (all)")
    parser.add_argument("--quiet-wait", type=float, default=30.0, help="seconds to wait for a quiet machine (30)")
    parser.add_argument("--out", type=Path, help="where runs and plan_validation.json go (a temporary dir)")
    args = parser.parse_args()
    sizes = [int(n) for n in args.workers.split(",")]
    strategies = [name.strip() for name in args.strategies.split(",")]
    unknown = [name for name in strategies if name not in STRATEGY_CLASSES]
    if unknown or "ps" not in strategies:
        parser.error(f"--strategies: {', '.join(unknown) or 'ps is missing'}; e.g. --strategies ps,allreduce,hybrid")
    ring_on = args.calibrate_allreduce_on
    if ring_on is not None and (ring_on not in sizes or ring_on < 2 or "allreduce" not in strategies):
        parser.error(
            f"--calibrate-allreduce-on {ring_on}: needs 2 or more workers, one of --workers {args.workers}, and "
            "allreduce in --strategies"
        )
    steps = args.steps or (1500 if args.quick else 6000)
    if args.out is None:
        with tempfile.TemporaryDirectory(prefix="plan-validation-") as directory:
            return validate(sizes, strategies, steps, args, Path(directory))
    return validate(sizes, strategies, steps, args, args.out)


def validate(sizes: list[int], strategies: list[str], steps: int, args: argparse.Namespace, out: Path) -> int:
    """Run the PS at every size, calibrate on the first, then every other strategy that exists; one table."""
    # Repeats go round all the sizes in turn, so that a spell of load from other programs hits each size alike.
    tries = [{n: measure(n, steps, "ps", args, out / f"repeat-{r}") for n in sizes} for r in range(args.repeats)]
    runs = {n: fastest([sizes_run[n] for sizes_run in tries]) for n in sizes}
    base = runs[sizes[0]]["calibration"]
    plan = plan_config(base, args.cores)
    print(f"calibrated on {sizes[0]} worker(s): compute {base.step_compute_s * 1e3:.3f} ms/step, bandwidth ", end="")
    print(f"{base.bandwidth / 1e9:.2f} GB/s, PS apply {base.ps_apply_s * 1e3:.3f} ms/update; ", end="")
    print(f"the roles kept {plan.cores:.2f} of {args.cores} cores busy")
    if base.worker_cpu_s is not None and base.ps_cpu_s is not None:
        print(f"CPU per worker step (all threads): worker {base.worker_cpu_s * 1e3:.3f} ms, ", end="")
        print(f"PS {base.ps_cpu_s * 1e3:.3f} ms; chief {base.other_cores:.2f} cores")
    print()
    rows = [ps_row(plan, n, runs[n], args.cores) for n in sizes]
    others = {s: measure_strategy(s, sizes, steps, args, out) for s in strategies[1:]}
    ring_plan = None
    if args.calibrate_allreduce_on is not None:
        ring_base = others["allreduce"][args.calibrate_allreduce_on]["calibration"]
        ring_plan = ring_plan_config(plan, ring_base, args.cores)
        print(f"all-reduce calibrated on {args.calibrate_allreduce_on} workers: ", end="")
        print(describe_ring(ring_base), end="\n\n")
    for strategy, strategy_runs in others.items():
        rows += other_strategy_rows(plan, ring_plan, strategy, strategy_runs, sizes)
    print_rows(rows)
    checked = [row for row in rows if row.get("error") is not None and not row["calibration_run"]]
    worst = max((abs(row["error"]) for row in checked), default=0.0)
    print(f"\nworst error of the predicted rows: {worst:.1%} (target {TARGET_ERROR:.0%})")
    calibration = {**vars(base), "capture": str(base.capture)}
    report = {"steps": steps, "cores": args.cores, "calibration": calibration, "rows": rows}
    (out / "plan_validation.json").write_text(json.dumps(report, indent=1))
    result_line.print_result("plan_validation", report, result_rows(rows, sizes[0]))
    return 0 if worst <= TARGET_ERROR else 1


def plan_config(base: Any, cores: int) -> Any:
    """The model calibrated on `base`, for the cores its roles got (all `cores` where the capture sampled none)."""
    from shardflow.planning.plan_model import PlanConfig

    job_cores = min(base.busy_cores or cores, cores)
    return PlanConfig(
        num_params=base.model_bytes / 4,
        num_workers=base.num_workers,
        num_ps=base.num_ps,
        bandwidth=base.bandwidth,
        step_compute_s=base.step_compute_s,
        ps_apply_s=base.ps_apply_s,
        cores=job_cores,
        worker_cpu_s=base.worker_cpu_s,
        ps_cpu_s=base.ps_cpu_s,
        other_cores=min(base.other_cores, job_cores / 2),
        calibrated_on="ps",
    )


def ring_plan_config(plan: Any, ring_base: Any, cores: int) -> Any:
    """The model for all-reduce and hybrid: the PS calibration's, with the all-reduce run's ring cost, compute and
    the cores its roles got."""
    job_cores = min(ring_base.busy_cores or cores, cores)
    return replace(
        plan,
        step_compute_s=ring_base.step_compute_s,
        cores=job_cores,
        other_cores=min(ring_base.other_cores, job_cores / 2),
        ring=ring_base.ring,
        calibrated_on="allreduce",
    )


def describe_ring(base: Any) -> str:
    """What the all-reduce run measured, in one line."""
    ring = base.ring
    text = f"compute {base.step_compute_s * 1e3:.3f} ms/step, all-reduce {base.allreduce_s * 1e3:.3f} ms/step of "
    text += f"{base.model_bytes / 1e6:.2f} MB (copies {ring.copy_s * 1e3:.3f} ms, ring {ring.bandwidth / 1e9:.3f} "
    text += f"GB/s), optimizer {ring.apply_s * 1e3:.3f} ms"
    if ring.cpu_per_byte is not None and ring.own_cpu_s is not None:
        text += f"; CPU per worker step {ring.own_cpu_s * 1e3:.3f} ms outside the ring, "
        text += f"{ring.cpu_per_byte * 1e9:.3f} ms per MB of the ring"
    return text + f"; the roles kept {base.busy_cores or 0:.2f} cores busy"


def ps_row(plan: Any, n: int, run: dict[str, Any], cores: int) -> dict[str, Any]:
    from shardflow.planning.strategies import predict_strategy

    prediction = predict_strategy(replace(plan, num_workers=n), "ps")
    all_cores = predict_strategy(replace(plan, num_workers=n, cores=cores), "ps")
    steady = run["calibration"].global_steps_per_s
    return {
        "strategy": "ps",
        "workers": n,
        "calibration_run": n == plan.num_workers,
        "predicted": prediction.global_steps_per_s,
        "measured": steady,
        "error": prediction.global_steps_per_s / steady - 1,
        "predicted_all_cores": all_cores.global_steps_per_s,
        "whole_run": run["whole"],
        "bound": prediction.bound,
        "others_cores": run["others_cores"],
        "load_average": run["load_average"],
    }


def measure_strategy(
    strategy: str, sizes: list[int], steps: int, args: argparse.Namespace, out: Path
) -> dict[int, dict[str, Any]]:
    """A run of `strategy` at every size; none where this tree does not have the strategy."""
    import shardflow as sf

    if not hasattr(sf, STRATEGY_CLASSES[strategy]):
        print(f"{strategy}: not available in this tree (no sf.{STRATEGY_CLASSES[strategy]}); no rows", file=sys.stderr)
        return {}
    return {n: measure(n, steps, strategy, args, out / "repeat-0") for n in sizes}


def other_strategy_rows(
    plan: Any, ring_plan: Any, strategy: str, runs: dict[int, dict[str, Any]], sizes: list[int]
) -> list[dict[str, Any]]:
    """Rows of a strategy predicted from its calibration (the all-reduce run's where there is one, else the PS
    run's) against its own runs, or one row saying it is missing."""
    from shardflow.planning.strategies import predict_strategy

    if not runs:
        return [{"strategy": strategy, "workers": None, "calibration_run": False, "error": None, "available": False}]
    rows = []
    for n in sizes:
        run = runs[n]
        prediction = predict_strategy(replace(ring_plan or plan, num_workers=n), strategy)  # type: ignore[arg-type]
        from_ps = predict_strategy(replace(plan, num_workers=n), strategy)  # type: ignore[arg-type]
        steady = run["calibration"].global_steps_per_s if run["calibration"] is not None else run["whole"]
        rows.append(
            {
                "strategy": strategy,
                "workers": n,
                "calibration_run": strategy == "allreduce"
                and ring_plan is not None
                and n == ring_plan.ring.calibrated_workers,
                "calibrated_on": prediction.calibration,
                "predicted": prediction.global_steps_per_s,
                "predicted_from_ps": from_ps.global_steps_per_s,
                "measured": steady,
                "error": prediction.global_steps_per_s / steady - 1,
                "predicted_all_cores": None,
                "whole_run": run["whole"],
                "bound": prediction.bound,
                "others_cores": run["others_cores"],
                "load_average": run["load_average"],
            }
        )
    return rows


def print_rows(rows: list[dict[str, Any]]) -> None:
    header = (
        f"{'strategy':<9}  {'workers':>7}  {'predicted':>9}  {'measured':>8}  {'error':>6}  {'all cores':>9}  "
        f"{'whole run':>9}  {'others':>6}  {'load':>5}  {'bound':<11}  {'calibrated on':<14}  {'from PS':>7}"
    )
    print(header + "\n" + "-" * len(header))
    for row in rows:
        if row.get("available") is False:
            print(f"{row['strategy']:<9}  not available in this tree")
            continue
        all_cores = f"{row['predicted_all_cores']:>9.1f}" if row["predicted_all_cores"] is not None else f"{'':>9}"
        note = "  (calibration run)" if row["calibration_run"] else ""
        from_ps = f"{row['predicted_from_ps']:>7.1f}" if row.get("predicted_from_ps") is not None else f"{'':>7}"
        print(
            f"{row['strategy']:<9}  {row['workers']:>7}  {row['predicted']:>9.1f}  {row['measured']:>8.1f}  "
            f"{row['error']:>+6.1%}  {all_cores}  {row['whole_run']:>9.1f}  {row['others_cores']:>6.2f}  "
            f"{row['load_average']:>5.1f}  "
            f"{row['bound']:<11}  {row.get('calibrated_on', 'PS run'):<14}  {from_ps}{note}"
        )
    print("global steps/s; measured: the steady rate inside the run's capture (the whole run's where it has none);")
    print("all cores: the model given every core of the machine; others: cores other programs used during the run;")
    print("load: the machine's 1-minute load average at its end; from PS: the prediction calibrated on the PS run")


def result_rows(rows: list[dict[str, Any]], calibrated_on: int) -> list[dict[str, Any]]:
    """BENCHMARKS.md's rows: each predicted size against its measured rate (the calibration run is not a test)."""
    return [
        result_line.row(
            f"plan's global steps/s, {size['strategy']}, {size['workers']} worker{'s' if size['workers'] != 1 else ''}"
            f", calibrated on {size.get('calibrated_on', f'PS run with {calibrated_on}')}",
            size["predicted"],
            "measured rate",
            size["measured"],
            target=f"within {TARGET_ERROR:.0%}",
            met=abs(size["error"]) <= TARGET_ERROR,
        )
        for size in rows
        if size.get("error") is not None and not size["calibration_run"]
    ]


def measure(num_workers: int, steps: int, strategy: str, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """One profiled run, with the CPU that other processes used meanwhile (machine busy time minus the job's)."""
    from shardflow.planning.calibrate import calibrate
    from shardflow.planning.scaling import ScaleConfig, run_size

    # Profile the middle of each run: past the start-up ramp, before the first workers finish.
    window = (int(steps * 0.4), int(steps * 0.7))
    config = ScaleConfig(
        script=Path(__file__).resolve(),
        script_args=(JOB_FLAG, str(steps), strategy, str(num_workers)),
        out=out / strategy,
        # Hybrid's capture would mix both kinds of spans, which no calibration reads yet.
        profile_steps=window if strategy in ("ps", "allreduce") else None,
    )
    wait_for_quiet(args.cores, args.quiet_wait)
    machine_before, job_before, started = _busy_s(), _children_cpu_s(), time.monotonic()
    result = run_size(config, num_workers, log=lambda line: print(line, file=sys.stderr))
    wall = time.monotonic() - started
    others = (_busy_s() - machine_before) - (_children_cpu_s() - job_before)
    return {
        "calibration": calibrate(result["profile_dir"]) if strategy in ("ps", "allreduce") else None,
        "whole": result["global_step"] / result["training_s"],
        "others_cores": max(0.0, others / wall),
        # Fair scheduling shares the cores by runnable threads, not by the cores others use: a job of one worker
        # (one runnable thread at a time) is starved by many threads of others that a job of four is not.
        "load_average": psutil.getloadavg()[0],
    }


def fastest(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return max(runs, key=lambda run: run["calibration"].global_steps_per_s)


def wait_for_quiet(cores: int, max_wait_s: float, busy_cores: float = 0.3) -> None:
    deadline = time.monotonic() + max_wait_s
    while (busy := psutil.cpu_percent(interval=1.0) / 100 * cores) > busy_cores and time.monotonic() < deadline:
        print(f"  waiting for a quiet machine ({busy:.2f} cores busy)", file=sys.stderr)


def _busy_s() -> float:
    """CPU seconds the machine spent on any process so far (guest time is already inside user time)."""
    times = psutil.cpu_times()
    return float(sum(getattr(times, field, 0.0) for field in ("user", "nice", "system", "irq", "softirq")))


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


if __name__ == "__main__":
    if sys.argv[1:2] == [JOB_FLAG]:
        job(int(sys.argv[2]), *sys.argv[3:4], *map(int, sys.argv[4:5]))
    else:
        sys.exit(main())
