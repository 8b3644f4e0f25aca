"""`shardflow plan` against measured loopback runs: each strategy calibrated on one run, every size predicted
(target: within 15%), and the predicted winner against the measured one.

Two models (--model mlp, click or both):
- mlp: the async benchmark's MLP 64-512-512-10 (301k parameters), batch 32, 1 PS, SGD; no sf.nn tables, so
  HybridStrategy refuses it (hybrid = all-reduce).
- click: the click-through model of click_model.py (jobs/click_through.py): sf.nn tables with a 10M-row item table,
  a 40-64-32-1 head, batch 512, Adagrad, 1 PS. The PS and hybrid hold the tables on the PS; all-reduce cannot hold
  them (every worker would all-reduce the 640 MB table's gradient each step): not run, plan's figure shown.

Every strategy runs at every size (--workers, 2,1,4) profiled in the middle of training, and is calibrated on its run
of the first size (planning/calibrate.py reads a PS, all-reduce or hybrid capture): compute per step, bandwidth of
the copies, PS apply, the CPU of every role per step; for all-reduce what gloo's ring costs; for hybrid a worker's
step outside the ring and the wait for the PS, that wait and the ring. The measurement compared is the steady rate
inside each capture (global steps/s); the whole-run rate (start-up ramp included) is shown beside it. "from PS" is
the strategy predicted from the PS run's calibration instead (for click: the rows the PS run's pushes carry beyond
the dense parameters its replies bring back, through the PS; the rest all-reduced over the PS links' bandwidth).

Other programs on a shared machine take cores from the job, and CPU per step measured under contention is what the
job will pay at the other sizes too. So the prediction uses the cores the calibrating run's roles really got (what
`shardflow plan --cores measured` does; a hybrid run's capture holds its PS too, which record their spans at the
workers' global step). "shared" is the prediction on all the machine's cores instead, which
the job's busy roles share with the other programs' demand its calibrating run saw (the scheduler shares cores by
runnable threads, so more workers take more of a shared machine: PlanConfig.contending_roles). Each run waits
(a while) for a quiet machine and reports the cores other processes used while it ran; --repeats N runs every
strategy and size N times in turns and keeps the fastest.

--out DIR keeps every run; --out DIR --replay predicts again from those runs without running anything (to try a
change of the plan model on the same measurements; the load of other programs then shows as 0).

Usage: python benchmarks/plan_validation.py [--quick] [--model mlp|click|both] [--workers 2,1,4] [--ps N]
       [--strategies ps,allreduce,hybrid] [--repeats N] [--out DIR [--replay]]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import psutil
import result_line

JOB_FLAG = "--job"
TARGET_ERROR = 0.15
STRATEGY_CLASSES = {"ps": "ParameterServerStrategy", "allreduce": "AllReduceStrategy", "hybrid": "HybridStrategy"}
HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Model:
    name: str
    batch_size: int
    table_params: float
    """Its sf.nn tables in full (0: none)."""
    steps: int
    quick_steps: int
    skipped: dict[str, str]
    """Strategies not run on it, and why."""


MODELS = {
    "mlp": Model("mlp", 32, 0.0, 6000, 1500, {"hybrid": "= all-reduce (no sf.nn tables)"}),
    "click": Model(
        "click",
        512,
        10_000_000 * 16 + 1_000 * 8 + 10_000 * 8,
        3000,
        1000,
        {"allreduce": "not run: all-reduce cannot hold the table (640 MB of gradient per step in every worker)"},
    ),
}


def job(max_steps: int, strategy_name: str = "ps", num_workers: int = 1, num_ps: int = 1) -> None:
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
        "ps": lambda: sf.ParameterServerStrategy(num_ps=num_ps, mode="async"),
        "allreduce": lambda: sf.AllReduceStrategy(num_workers=num_workers),
        "hybrid": lambda: sf.HybridStrategy(num_ps=num_ps, num_workers=num_workers),
    }[strategy_name]()
    est = sf.Estimator(model_fn, loss_fn, sf.optim.SGD(lr=0.01), strategy, "runs/plan_validation")
    est.train(input_fn, max_steps=max_steps)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer steps per run (mlp 1500, click 1000)")
    parser.add_argument("--model", choices=["mlp", "click", "both"], default="mlp", help="the model(s) swept (mlp)")
    # The first size calibrates. 2 workers and a PS already keep 2 cores busy; the CPU a step costs rises once the
    # roles outnumber the cores (switches, caches), which a 1-worker calibration cannot see.
    parser.add_argument("--workers", default="2,1,4", help="sizes; the first one calibrates (2,1,4)")
    parser.add_argument("--strategies", default="ps", help="of ps, allreduce, hybrid: the strategies swept (ps)")
    parser.add_argument("--ps", type=int, default=1, help="PS of the PS and hybrid runs (1)")
    parser.add_argument("--steps", type=int, help="global steps per run (mlp 6000, click 3000)")
    parser.add_argument("--repeats", type=int, default=1, help="runs per strategy and size; the fastest one counts (1)")
    parser.add_argument("--cores", type=int, default=os.cpu_count() or 1, help="cores the roles share (all)")
    parser.add_argument("--quiet-wait", type=float, default=30.0, help="seconds to wait for a quiet machine (30)")
    parser.add_argument("--out", type=Path, help="where runs and plan_validation.json go (a temporary dir)")
    parser.add_argument(
        "--replay", action="store_true", help="no new runs: predict again from the runs an earlier --out DIR kept"
    )
    args = parser.parse_args(argv)
    if args.replay and args.out is None:
        parser.error("--replay needs --out DIR: the directory an earlier run kept its runs in")
    try:
        args.sizes = [int(n) for n in args.workers.split(",")]
    except ValueError:
        parser.error(f"--workers {args.workers}: expected sizes such as 2,1,4")
    if not args.sizes or min(args.sizes) < 1:
        parser.error(f"--workers {args.workers}: every size must be at least 1, e.g. 2,1,4")
    args.strategy_names = [name.strip() for name in args.strategies.split(",")]
    unknown = [name for name in args.strategy_names if name not in STRATEGY_CLASSES]
    if unknown or "ps" not in args.strategy_names:
        parser.error(f"--strategies: {', '.join(unknown) or 'ps is missing'}; e.g. --strategies ps,allreduce,hybrid")
    args.models = [MODELS[name] for name in (["mlp", "click"] if args.model == "both" else [args.model])]
    return args


def main() -> int:
    args = parse_args()
    if args.out is None:
        with tempfile.TemporaryDirectory(prefix="plan-validation-") as directory:
            return validate(args, Path(directory))
    return validate(args, args.out)


def validate(args: argparse.Namespace, out: Path) -> int:
    """Every model: every strategy at every size, each calibrated on its first size's run; one table."""
    rows: list[dict[str, Any]] = []
    winners: list[dict[str, Any]] = []
    for model in args.models:
        model_rows = validate_model(model, args, out / model.name)
        rows += model_rows
        winners += winner_checks(model, model_rows, args.sizes)
    print_rows(rows)
    print_winners(winners)
    checked = [row for row in rows if row.get("error") is not None and not row["calibration_run"]]
    worst = max((abs(row["error"]) for row in checked), default=0.0)
    print(f"\nworst error of the predicted rows: {worst:.1%} (target {TARGET_ERROR:.0%})")
    report = {"cores": args.cores, "rows": rows, "winners": winners}
    (out / "plan_validation.json").write_text(json.dumps(report, indent=1, default=str))
    result_line.print_result("plan_validation", report, result_rows(rows, winners))
    return 0  # measured: each row of the result says whether it met the target


def validate_model(model: Model, args: argparse.Namespace, out: Path) -> list[dict[str, Any]]:
    """One model's rows: the strategies it runs, predicted from their own first-size run and from the PS run's."""
    sizes, steps = args.sizes, args.steps or (model.quick_steps if args.quick else model.steps)
    runs = {
        strategy: measure_strategy(model, strategy, sizes, steps, args, out)
        for strategy in args.strategy_names
        if strategy not in model.skipped
    }
    ps_plan = plan_config(model, runs["ps"][sizes[0]], args.cores)
    rows = []
    for strategy in args.strategy_names:
        if strategy in model.skipped:
            rows.append(skipped_row(model, strategy, ps_plan, sizes[0]))
        elif runs[strategy]:
            base = runs[strategy][sizes[0]]
            print(f"{model.name}, {strategy} calibrated on {sizes[0]} workers: {describe(base['calibration'])}")
            plan = plan_config(model, base, args.cores)
            plans = (plan, shared_plan(plan, base["calibration"], args.cores), ps_plan)
            rows += [strategy_row(model, strategy, plans, n, runs[strategy][n]) for n in sizes]
        else:
            rows.append({"model": model.name, "strategy": strategy, "note": "not available in this tree"})
    print()
    return rows


def plan_config(model: Model, run: dict[str, Any], cores: int) -> Any:
    """The plan model calibrated on `run`, for the cores its roles got (all `cores` where the capture sampled none)."""
    from shardflow.planning.plan_model import PlanConfig

    base = run["calibration"]
    job_cores = min(base.busy_cores or cores, cores)
    return PlanConfig(
        num_params=base.model_bytes / 4,
        num_workers=base.num_workers,
        num_ps=max(1, base.num_ps),
        bandwidth=base.bandwidth,
        step_compute_s=base.step_compute_s,
        step_compute_cpu_s=base.step_compute_cpu_s,
        ps_apply_s=base.ps_apply_s,
        cores=job_cores,
        worker_cpu_s=base.worker_cpu_s,
        ps_cpu_s=base.ps_cpu_s,
        other_cores=min(base.other_cores, job_cores / 2),
        sparse_params=base.sparse_bytes / 4,
        table_params=model.table_params,
        ring=base.ring,
        hybrid=base.hybrid,
        calibrated_on=base.strategy,
        calibrated_roles=base.num_workers + base.num_ps,
    )


def shared_plan(plan: Any, base: Any, cores: int) -> Any:
    """`plan` on all the machine's cores, which the job's busy roles share with the other programs' demand that
    the calibrating run saw (in roles: PlanConfig.contending_roles), instead of the cores that run got."""
    return replace(
        plan, cores=cores, other_cores=min(base.other_cores, cores / 2), contending_roles=base.contending_roles
    )


def describe(base: Any) -> str:
    """What a calibrating run measured, in one line."""
    text = f"compute {base.step_compute_s * 1e3:.3f} ms/step, {base.model_bytes / 1e3:.1f} kB per worker step"
    if base.sparse_bytes:
        text += f" ({base.sparse_bytes / 1e3:.1f} kB of table rows)"
    if base.hybrid is not None:
        h = base.hybrid
        text += f"; per step: own {h.own_s * 1e3:.3f} ms, push and wait for the PS {h.push_wait_s * 1e3:.3f} ms, "
        text += f"all-reduce {h.allreduce_s * 1e3:.3f} ms"
    elif base.ring is not None:
        text += f"; all-reduce {base.allreduce_s * 1e3:.3f} ms, ring {base.ring.bandwidth / 1e6:.1f} MB/s"
    else:
        text += f"; bandwidth {base.bandwidth / 1e9:.2f} GB/s, PS apply {base.ps_apply_s * 1e3:.3f} ms"
    if base.worker_cpu_s is not None:
        text += f"; worker CPU {base.worker_cpu_s * 1e3:.3f} ms/step"
    return text + f"; {base.global_steps_per_s:.1f} global steps/s"


def skipped_row(model: Model, strategy: str, ps_plan: Any, calibrated_on: int) -> dict[str, Any]:
    """A strategy not run on this model: why, and what plan predicts for it from the PS run."""
    from shardflow.planning.strategies import predict_strategy

    predicted = predict_strategy(replace(ps_plan, num_workers=calibrated_on), strategy)  # type: ignore[arg-type]
    return {
        "model": model.name,
        "strategy": strategy,
        "note": model.skipped[strategy],
        "predicted_from_ps": predicted.global_steps_per_s,
        "workers": calibrated_on,
    }


def strategy_row(
    model: Model, strategy: str, plans: tuple[Any, Any, Any], n: int, run: dict[str, Any]
) -> dict[str, Any]:
    """`plans`: the strategy's own calibration, the same on the machine's cores shared with the other programs'
    demand (shared_plan), and the PS run's."""
    plan, shared_plan, ps_plan = plans
    from shardflow.planning.strategies import predict_strategy

    prediction = predict_strategy(replace(plan, num_workers=n), strategy)  # type: ignore[arg-type]
    shared = predict_strategy(replace(shared_plan, num_workers=n), strategy)  # type: ignore[arg-type]
    from_ps = predict_strategy(replace(ps_plan, num_workers=n), strategy)  # type: ignore[arg-type]
    steady = run["calibration"].global_steps_per_s if run["calibration"] is not None else run["whole"]
    batches_per_step = 1 if strategy == "ps" else n  # async PS: every worker's batch is a global step
    return {
        "model": model.name,
        "strategy": strategy,
        "workers": n,
        "calibration_run": n == plan.num_workers,
        "calibrated_workers": plan.num_workers,
        "calibrated_on": prediction.calibration,
        "predicted": prediction.global_steps_per_s,
        "predicted_from_ps": from_ps.global_steps_per_s,
        "predicted_shared": shared.global_steps_per_s,
        "measured": steady,
        "error": prediction.global_steps_per_s / steady - 1,
        "predicted_examples": prediction.batches_per_s * model.batch_size,
        "measured_examples": steady * batches_per_step * model.batch_size,
        "whole_run": run["whole"],
        "bound": prediction.bound,
        "others_cores": run["others_cores"],
        "load_average": run["load_average"],
    }


def measure_strategy(
    model: Model, strategy: str, sizes: list[int], steps: int, args: argparse.Namespace, out: Path
) -> dict[int, dict[str, Any]]:
    """The fastest of --repeats runs of `strategy` at every size; none where this tree does not have it."""
    import shardflow as sf

    if not hasattr(sf, STRATEGY_CLASSES[strategy]):
        print(f"{strategy}: not available in this tree (no sf.{STRATEGY_CLASSES[strategy]}); no rows", file=sys.stderr)
        return {}
    # Repeats go round all the sizes in turn, so that a spell of load from other programs hits each size alike.
    tries = [
        {n: measure(model, n, steps, strategy, args, out / f"repeat-{r}") for n in sizes} for r in range(args.repeats)
    ]
    return {n: fastest([sizes_run[n] for sizes_run in tries]) for n in sizes}


def winner_checks(model: Model, rows: list[dict[str, Any]], sizes: list[int]) -> list[dict[str, Any]]:
    """At every size, the strategy with the most examples/s as predicted and as measured."""
    checks = []
    for n in sizes:
        ran = [row for row in rows if row.get("workers") == n and row.get("measured") is not None]
        if len(ran) < 2:
            continue
        predicted = max(ran, key=lambda row: row["predicted_examples"])["strategy"]
        measured = max(ran, key=lambda row: row["measured_examples"])["strategy"]
        checks.append(
            {
                "model": model.name,
                "workers": n,
                "predicted": predicted,
                "measured": measured,
                "match": predicted == measured,
            }
        )
    return checks


def print_rows(rows: list[dict[str, Any]]) -> None:
    header = (
        f"{'model':<5}  {'strategy':<9}  {'workers':>7}  {'predicted':>9}  {'measured':>8}  {'error':>6}  "
        f"{'pred ex/s':>9}  {'meas ex/s':>9}  {'whole run':>9}  {'others':>6}  {'load':>5}  {'bound':<11}  "
        f"{'calibrated on':<14}  {'from PS':>7}  {'shared':>7}"
    )
    print(header + "\n" + "-" * len(header))
    for row in rows:
        if row.get("measured") is None:
            from_ps = row.get("predicted_from_ps")
            plan = f" (plan from the PS run, {row['workers']} workers: {from_ps:.1f})" if from_ps is not None else ""
            print(f"{row['model']:<5}  {row['strategy']:<9}  {row['note']}{plan}")
            continue
        note = "  (calibration run)" if row["calibration_run"] else ""
        print(
            f"{row['model']:<5}  {row['strategy']:<9}  {row['workers']:>7}  {row['predicted']:>9.1f}  "
            f"{row['measured']:>8.1f}  {row['error']:>+6.1%}  {row['predicted_examples']:>9,.0f}  "
            f"{row['measured_examples']:>9,.0f}  {row['whole_run']:>9.1f}  {row['others_cores']:>6.2f}  "
            f"{row['load_average']:>5.1f}  {row['bound']:<11}  {row['calibrated_on']:<14}  "
            f"{row['predicted_from_ps']:>7.1f}  {row['predicted_shared']:>7.1f}{note}"
        )
    print("global steps/s (async PS: one per worker batch; all-reduce and hybrid: one per round of all workers);")
    print("measured: the steady rate inside the run's capture; ex/s: examples/s; others: cores other programs used")
    print("during the run; load: the 1-minute load average at its end; from PS: predicted from the PS run instead;")
    print("shared: predicted with the machine's cores shared by busy roles with the others' demand the run saw")


def print_winners(winners: list[dict[str, Any]]) -> None:
    print("\nwinner (most examples/s), predicted against measured:")
    for w in winners:
        verdict = "match" if w["match"] else "MISMATCH"
        print(
            f"  {w['model']:<5} {w['workers']} workers: predicted {w['predicted']}, measured {w['measured']}: {verdict}"
        )


def result_rows(rows: list[dict[str, Any]], winners: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """BENCHMARKS.md's rows: each predicted size against its measured rate (a calibration run is not a test)."""
    figures = [
        result_line.row(
            f"plan's global steps/s, {row['model']}, {row['strategy']}, {row['workers']} "
            f"worker{'s' if row['workers'] != 1 else ''}, calibrated on the {row['calibrated_on']} of "
            f"{row['calibrated_workers']}",
            row["predicted"],
            "measured rate",
            row["measured"],
            target=f"within {TARGET_ERROR:.0%}",
            met=abs(row["error"]) <= TARGET_ERROR,
        )
        for row in rows
        if row.get("error") is not None and not row["calibration_run"]
    ]
    return figures + [
        result_line.row(
            f"plan's winner, {w['model']}, {w['workers']} workers: {w['predicted']} (measured: {w['measured']})",
            1.0 if w["match"] else 0.0,
            "the measured winner",
            1.0,
            met=w["match"],
        )
        for w in winners
    ]


def measure(
    model: Model, num_workers: int, steps: int, strategy: str, args: argparse.Namespace, out: Path
) -> dict[str, Any]:
    """One profiled run, with the CPU that other processes used meanwhile (machine busy time minus the job's)."""
    from shardflow.planning.calibrate import calibrate
    from shardflow.planning.scaling import ScaleConfig, ScaleRunError, run_size

    directory = out.resolve() / strategy
    if args.replay:
        return replayed(directory, num_workers)
    if model.name == "click":
        mode = {"ps": "async", "hybrid": "hybrid", "allreduce": "allreduce"}[strategy]
        result_json = directory / f"workers-{num_workers}" / "click.json"
        script, script_args = (
            HERE / "jobs" / "click_through.py",
            (str(result_json), str(num_workers), str(args.ps), str(steps), mode),
        )
    else:
        job_args = (JOB_FLAG, str(steps), strategy, str(num_workers), str(args.ps))
        script, script_args = Path(__file__).resolve(), job_args
    # Profile the middle of each run: past the start-up ramp, before the first workers finish.
    window = (int(steps * 0.4), int(steps * 0.7))
    config = ScaleConfig(script=script, script_args=script_args, out=directory, profile_steps=window)
    wait_for_quiet(args.cores, args.quiet_wait)
    machine_before, job_before, started = _busy_s(), _children_cpu_s(), time.monotonic()
    try:
        result = run_size(config, num_workers, log=lambda line: print(line, file=sys.stderr))
    except ScaleRunError as error:
        # Other people's jobs on a shared machine can take the port a role picked between its pick and its bind.
        if "Address already in use" not in str(error):
            raise
        print(f"  a role's port was taken; running again: {str(error).splitlines()[0]}", file=sys.stderr)
        config = replace(config, out=directory / "again")
        result = run_size(config, num_workers, log=lambda line: print(line, file=sys.stderr))
    wall = time.monotonic() - started
    others = (_busy_s() - machine_before) - (_children_cpu_s() - job_before)
    calibration = calibrate(result["profile_dir"])
    # The click model's checkpoints hold its 10M-row table (1.3 GB a run): only the capture is read again (--replay).
    model_dir = Path(result["profile_dir"]).parents[1]
    for written in ("checkpoints", "tables"):
        shutil.rmtree(model_dir / written, ignore_errors=True)
    return {
        "calibration": calibration,
        "whole": result["global_step"] / result["training_s"],
        "others_cores": max(0.0, others / wall),
        # Fair scheduling shares the cores by runnable threads, not by the cores others use: a job of one worker
        # (one runnable thread at a time) is starved by many threads of others that a job of four is not.
        "load_average": psutil.getloadavg()[0],
    }


def replayed(directory: Path, num_workers: int) -> dict[str, Any]:
    """A run kept by an earlier --out, calibrated again (its other processes' load is not known any more)."""
    from shardflow.planning.calibrate import calibrate

    kept = [directory / "again" / f"workers-{num_workers}", directory / f"workers-{num_workers}"]
    found = next((path / "result.json" for path in kept if (path / "result.json").is_file()), None)
    if found is None:
        raise SystemExit(f"--replay: no run of {num_workers} workers kept in {directory} (no workers-N/result.json)")
    result = json.loads(found.read_text())
    whole = result["global_step"] / result["training_s"]
    return {"calibration": calibrate(result["profile_dir"]), "whole": whole, "others_cores": 0.0, "load_average": 0.0}


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
        job(int(sys.argv[2]), *sys.argv[3:4], *map(int, sys.argv[4:6]))
    else:
        sys.exit(main())
