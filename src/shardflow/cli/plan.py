"""Predict step time and the bottleneck of a PS cluster from the model size, links and compute; compare all-reduce
and hybrid, and name the fastest."""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from typing import TYPE_CHECKING

from shardflow.cli.tables import print_table

if TYPE_CHECKING:
    from pathlib import Path

    from shardflow.planning.calibrate import Calibration
    from shardflow.planning.plan_model import PlanConfig, Prediction

EPILOG = """\
examples:
  shardflow plan --params 100M --workers 64 --ps 8 --bandwidth 25Gbit --step-compute 120ms
  shardflow plan --calibrate runs/mlp --workers 4 --cores 2       from a profiled run, for a local cluster
  shardflow plan --calibrate runs/mlp --workers 4 --cores measured as many cores as the profiled run got
  shardflow plan --params 100M --sparse-params 90M ... --strategy all    PS, all-reduce and hybrid, and the winner
  shardflow plan --calibrate runs/ps --calibrate-allreduce runs/ar --workers 4 --cores measured
                                       PS from a PS run, all-reduce and hybrid from an all-reduce run
  shardflow plan --calibrate runs/ps --calibrate-hybrid runs/hy --workers 4 --cores measured
                                       PS from a PS run, hybrid from a hybrid run

The model, per worker step (M model bytes, B link bandwidth, n workers, k PS):
  PS communication per direction   max(M/B, n·M/(k·B))   a worker moves M, the busiest PS n·M/k
  all-reduce communication         2(n-1)/n · M/B each way per worker, then every worker applies the update
  hybrid                           sf.nn rows (--sparse-params) through the PS, the rest all-reduced
  step time                        compute + push + pull (+ apply); with overlap, the slowest part
--calibrate reads a PS run's capture or an all-reduce run's. An all-reduce capture measures what gloo's ring costs
  on its machine: all-reduce and hybrid are predicted from that (its wall time and CPU per ring byte), and the PS
  from its compute, its optimizer step and the ring's bandwidth standing in for the links. Each row of the
  strategies' table says which run it was calibrated on. A PS run of a model with sf.nn tables measures the rows
  a step pushes (its pushes less the dense parameters its replies bring back): hybrid sends those through the PS.
--calibrate-hybrid reads an sf.HybridStrategy run's capture: a worker's step outside the all-reduce and the wait
  for the PS, that wait and the ring; hybrid is then predicted from it, the wait growing with the pushes the busiest
  PS takes per round (n/k) and the ring with its bytes (2(n-1)/n of the dense part).
--cores models a local run: moving bytes is then CPU work on both ends, and all roles share the cores.
  With --calibrate it uses the CPU every role measured per step (all threads). That cost rises once the
  roles outnumber the cores (each reloads its caches), which the prediction adds per role beyond the cores;
  calibrate on a run that already keeps the cores busy. --cores measured
  uses the cores that run's roles got: on a machine other programs share, as much as they left it.
The winner has the most batches per second (a round is one batch on every worker).
Units: 100M, 1.5B params; 25Gbit, 25Gbps, 10GB/s; 120ms, 0.3s, 50us.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = EPILOG
    parser.add_argument("--params", metavar="COUNT", help="model parameters, e.g. 100M or 1.5B")
    parser.add_argument("--workers", type=int, metavar="N", help="workers (the calibrated run's)")
    parser.add_argument("--ps", type=int, metavar="K", help="parameter servers (the calibrated run's)")
    parser.add_argument("--bandwidth", metavar="RATE", help="link bandwidth per machine and direction, e.g. 25Gbit")
    parser.add_argument("--step-compute", metavar="TIME", help="forward + backward of one worker step, e.g. 120ms")
    parser.add_argument("--mode", choices=["async", "sync"], default="async", help="(async)")
    parser.add_argument("--bytes-per-param", type=float, default=4.0, metavar="B", help="bytes on the wire (4)")
    parser.add_argument("--ps-apply", metavar="TIME", help="time to apply one update of the whole model on one PS")
    parser.add_argument(
        "--cores",
        metavar="C",
        help="a local run: all roles share C CPU cores ('measured': those the calibrated run got)",
    )
    parser.add_argument("--allreduce", action="store_true", help="show the all-reduce prediction in full")
    parser.add_argument(
        "--strategy",
        choices=["ps", "allreduce", "hybrid", "all"],
        default="all",
        help="the strategies to compare side by side (all)",
    )
    parser.add_argument("--sparse-params", metavar="COUNT", help="of --params, sf.nn table rows a step touches (0)")
    parser.add_argument(
        "--table-params",
        metavar="COUNT",
        help="the sf.nn tables in full, which all-reduce sums (a calibrated run's, else --sparse-params)",
    )
    parser.add_argument("--batch-size", type=int, metavar="N", help="examples per batch, to print examples/s")
    parser.add_argument("--calibrate", metavar="MODEL_DIR", help="measure the inputs from a profiled run's capture")
    parser.add_argument("--capture", metavar="NAME", help="with --calibrate: the capture to use (latest)")
    parser.add_argument(
        "--calibrate-allreduce",
        metavar="MODEL_DIR",
        help="predict all-reduce and hybrid from this all-reduce run's capture (its latest)",
    )
    parser.add_argument(
        "--calibrate-hybrid", metavar="MODEL_DIR", help="predict hybrid from this hybrid run's capture (its latest)"
    )


def run(args: argparse.Namespace) -> int:
    from shardflow.profile.capture import CaptureNotFoundError

    try:
        calibration = _calibration(args)
        ring = _ring(args)
        hybrid = _hybrid(args)
        config = _config(args, calibration)
    except (ValueError, CaptureNotFoundError) as error:
        print(f"shardflow plan: error: {error}", file=sys.stderr)
        return 2
    for measured in (calibration, ring, hybrid):
        if measured is not None:
            _print_calibration(measured)
    if ring is not None:
        config = replace(config, ring=ring.ring)
    if hybrid is not None:
        config = replace(config, hybrid=hybrid.hybrid)
        if args.sparse_params is None:
            config = replace(config, sparse_params=min(config.num_params, hybrid.sparse_bytes / args.bytes_per_param))
        if args.table_params is None and not args.params and not config.table_params:
            config = replace(config, table_params=hybrid.table_bytes / args.bytes_per_param)
    if args.strategy in ("ps", "all"):
        _print_prediction(config, args.allreduce)
        print()
    _print_strategies(config, args.strategy, args.batch_size)
    return 0


def _calibration(args: argparse.Namespace) -> Calibration | None:
    if args.calibrate is None:
        if args.capture is not None:
            raise ValueError("--capture needs --calibrate MODEL_DIR")
        return None
    from shardflow.planning.calibrate import calibrate

    calibration = calibrate(args.calibrate, args.capture)
    if calibration.strategy == "allreduce" and calibration.ring is None:
        raise ValueError(
            f"{calibration.capture} is of an all-reduce run of 1 worker, which all-reduces nothing: calibrate on "
            "one of 2 or more workers"
        )
    return calibration


def _ring(args: argparse.Namespace) -> Calibration | None:
    """The all-reduce run of --calibrate-allreduce, whose ring all-reduce and hybrid are predicted from."""
    return _run_of("--calibrate-allreduce", args.calibrate_allreduce, "ring", "an all-reduce run of 2 or more workers")


def _hybrid(args: argparse.Namespace) -> Calibration | None:
    """The hybrid run of --calibrate-hybrid, whose step hybrid is predicted from."""
    what = "an sf.HybridStrategy run (no worker both all-reduced and pushed to a PS)"
    return _run_of("--calibrate-hybrid", args.calibrate_hybrid, "hybrid", what)


def _run_of(flag: str, model_dir: Path | None, part: str, what: str) -> Calibration | None:
    """The calibration of `model_dir` given with `flag`, which must have `part` (its capture is of `what`)."""
    if model_dir is None:
        return None
    from shardflow.planning.calibrate import calibrate

    calibration = calibrate(model_dir)
    if getattr(calibration, part) is None:
        raise ValueError(f"{flag} {model_dir}: its capture ({calibration.capture}) is not of {what}")
    return calibration


def _config(args: argparse.Namespace, calibration: Calibration | None) -> PlanConfig:
    from shardflow.planning.plan_model import PlanConfig
    from shardflow.planning.units import parse_bandwidth, parse_count, parse_duration

    if calibration is None:
        examples = {
            "--params": "100M",
            "--workers": "4",
            "--ps": "2",
            "--bandwidth": "25Gbit",
            "--step-compute": "120ms",
        }
        missing = [flag for flag in examples if getattr(args, flag[2:].replace("-", "_")) is None]
        if missing:
            raise ValueError(
                f"missing {', '.join(missing)}, e.g. {' '.join(f'{f} {examples[f]}' for f in missing)}; "
                "or measure them with --calibrate MODEL_DIR"
            )
    for flag, value in (("--workers", args.workers), ("--ps", args.ps)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be at least 1, e.g. {flag} 4; got {value}")
    cores = _cores(args.cores, calibration)
    if args.batch_size is not None and args.batch_size < 1:
        raise ValueError(f"--batch-size must be at least 1, e.g. --batch-size 32; got {args.batch_size}")
    if args.bytes_per_param <= 0:
        raise ValueError(f"--bytes-per-param must be positive, e.g. --bytes-per-param 2; got {args.bytes_per_param}")

    def measured(name: str) -> float:
        assert calibration is not None  # every flag without a default is required when nothing was measured
        return float(getattr(calibration, name))

    def given_or_run(text: str | None, flag: str, name: str) -> float:
        """The flag's count, else a calibrated run's rows pushed or tables, unless --params gives another model."""
        if text:
            return parse_count(text, flag)
        return 0.0 if calibration is None or args.params else getattr(calibration, name) / float(args.bytes_per_param)

    return PlanConfig(
        num_params=parse_count(args.params) if args.params else measured("model_bytes") / args.bytes_per_param,
        bytes_per_param=args.bytes_per_param,
        num_workers=args.workers or int(measured("num_workers")),
        num_ps=args.ps or max(1, int(measured("num_ps"))),  # an all-reduce run has none: one, for the PS row
        bandwidth=parse_bandwidth(args.bandwidth) if args.bandwidth else measured("bandwidth"),
        step_compute_s=parse_duration(args.step_compute) if args.step_compute else measured("step_compute_s"),
        mode=args.mode,
        ps_apply_s=parse_duration(args.ps_apply, "--ps-apply") if args.ps_apply else _apply_s(calibration),
        cores=cores,
        # Measured CPU per step only describes the cores it was measured on: a local run.
        step_compute_cpu_s=calibration.step_compute_cpu_s if calibration and cores and not args.step_compute else None,
        worker_cpu_s=calibration.worker_cpu_s if calibration is not None and cores else None,
        ps_cpu_s=calibration.ps_cpu_s if calibration is not None and cores else None,
        other_cores=min(calibration.other_cores, cores / 2) if calibration is not None and cores else 0.0,
        sparse_params=given_or_run(args.sparse_params, "--sparse-params", "sparse_bytes"),
        table_params=given_or_run(args.table_params, "--table-params", "table_bytes"),
        ring=calibration.ring if calibration is not None else None,
        hybrid=calibration.hybrid if calibration is not None else None,
        calibrated_on=calibration.strategy if calibration is not None else None,
        calibrated_roles=calibration.num_workers + calibration.num_ps if calibration is not None and cores else None,
    )


def _cores(text: str | None, calibration: Calibration | None) -> float | None:
    if text is None:
        return None
    if text == "measured":
        if calibration is None or calibration.busy_cores is None:
            raise ValueError("--cores measured needs --calibrate MODEL_DIR with a capture that sampled cpu.cores")
        return calibration.busy_cores
    try:
        cores = float(text)
    except ValueError:
        raise ValueError(f"--cores must be a number or 'measured', e.g. --cores 2; got {text!r}") from None
    if not cores > 0:
        raise ValueError(f"--cores must be positive, e.g. --cores 2; got {text}")
    return cores


def _apply_s(calibration: Calibration | None) -> float:
    return calibration.ps_apply_s if calibration is not None else 0.0


def _print_calibration(c: Calibration) -> None:
    from shardflow.planning.units import format_bandwidth, format_bytes, format_duration

    if c.strategy == "allreduce":
        _print_ring_calibration(c)
        return
    if c.hybrid is not None:
        _print_hybrid_calibration(c)
        return
    print(f"measured in {c.capture} ({_plural(c.num_workers, 'worker')}, {c.num_ps} PS):")
    rows = [
        ["model on the wire", format_bytes(c.model_bytes), "pushed per worker step"],
        ["compute per step", format_duration(c.step_compute_s), "forward + backward, pushes excluded" + _cpu(c)],
        ["effective bandwidth", format_bandwidth(c.bandwidth), "push, PS receive and reply spans"],
        ["PS apply per update", format_duration(c.ps_apply_s), ""],
        *_tables_row(c),
    ]
    if c.worker_cpu_s is not None and c.ps_cpu_s is not None:
        rows.append(
            [
                "CPU per worker step",
                format_duration(c.worker_cpu_s),
                f"in the worker, {format_duration(c.ps_cpu_s)} in the PS (all threads); "
                f"other roles {c.other_cores:.2f} cores",
            ]
        )
    if c.busy_cores is not None:
        rows.append(["cores busy", f"{c.busy_cores:.2f}", "all roles together (--cores measured uses this)"])
    rows.append(
        ["achieved", format_duration(c.worker_step_s), f"per worker step, {c.global_steps_per_s:.1f} global steps/s"]
    )
    print_table(None, ["measured", "value", ""], rows, right={"value"})
    print()


def _tables_row(c: Calibration) -> list[list[str]]:
    """The sf.nn tables in full, where the capture counted them: what all-reduce would sum (--table-params)."""
    from shardflow.planning.units import format_bytes

    row = ["sf.nn tables", format_bytes(c.table_bytes), "in full on the PS; all-reduce would sum them each step"]
    return [row] if c.table_bytes else []


def _cpu(c: Calibration) -> str:
    """The compute's CPU time, where the capture's spans carry it."""
    from shardflow.planning.units import format_duration

    if c.step_compute_cpu_s is None:
        return ""
    return f"; {format_duration(c.step_compute_cpu_s)} of it on a core (CPU time)"


def _print_ring_calibration(c: Calibration) -> None:
    from shardflow.planning.units import format_bandwidth, format_bytes, format_duration

    assert c.ring is not None and c.allreduce_s is not None
    ring = c.ring
    print(f"measured in {c.capture} (all-reduce, {_plural(c.num_workers, 'worker')}):")
    rows = [
        ["model on the wire", format_bytes(c.model_bytes), "all-reduced per worker step"],
        ["compute per step", format_duration(c.step_compute_s), "forward + backward" + _cpu(c)],
        ["all-reduce per step", format_duration(c.allreduce_s), f"of which copies {format_duration(ring.copy_s)}"],
        ["ring bandwidth", format_bandwidth(ring.bandwidth), "2(n-1)/n of the model over the all-reduce less copies"],
        ["optimizer step", format_duration(ring.apply_s), ""],
    ]
    if ring.cpu_per_byte is not None and ring.own_cpu_s is not None:
        per_mb = format_duration(ring.cpu_per_byte * 1e6)
        rows.append(["CPU per worker step", format_duration(ring.own_cpu_s), f"outside the ring; the ring {per_mb}/MB"])
    if c.busy_cores is not None:
        rows.append(["cores busy", f"{c.busy_cores:.2f}", "all roles together (--cores measured uses this)"])
    rows.append(["achieved", format_duration(c.worker_step_s), f"per step, {c.global_steps_per_s:.1f} global steps/s"])
    print_table(None, ["measured", "value", ""], rows, right={"value"})
    print()


def _print_hybrid_calibration(c: Calibration) -> None:
    from shardflow.planning.units import format_bytes, format_duration

    assert c.hybrid is not None
    h = c.hybrid
    print(f"measured in {c.capture} (hybrid, {_plural(c.num_workers, 'worker')}, {c.num_ps} PS):")
    rows = [
        ["table rows pushed", format_bytes(c.sparse_bytes), "per worker step, to the PS"],
        ["dense part", format_bytes(c.model_bytes - c.sparse_bytes), "all-reduced per step"],
        *_tables_row(c),
        ["own part of a step", format_duration(h.own_s), "compute, lookups, apply: outside the waits"],
        ["push and PS wait", format_duration(h.push_wait_s), "until every PS took the rows"],
        ["all-reduce per step", format_duration(h.allreduce_s), f"of which copies {format_duration(h.copy_s)}"],
    ]
    if h.worker_cpu_s is not None:
        per_mb = format_duration(h.ring_cpu_per_byte * 1e6)
        rows.append(["CPU per worker step", format_duration(h.worker_cpu_s), f"all threads; the ring {per_mb}/MB"])
    if c.busy_cores is not None:
        rows.append(["cores busy", f"{c.busy_cores:.2f}", "workers, and the PS as their waits for it"])
    rows.append(["achieved", format_duration(c.worker_step_s), f"per step, {c.global_steps_per_s:.1f} global steps/s"])
    print_table(None, ["measured", "value", ""], rows, right={"value"})
    print()


def _print_prediction(config: PlanConfig, allreduce: bool) -> None:
    from shardflow.planning.plan_model import predict

    prediction = predict(config)
    _print_parts(config, prediction)
    _print_speed(config, prediction)
    _print_bottleneck(config, prediction)
    _print_allreduce(config, prediction, allreduce)


def _print_parts(config: PlanConfig, p: Prediction) -> None:
    """The cluster, then each part of a step with what it is."""
    from shardflow.planning.plan_model import TERMS
    from shardflow.planning.units import format_bandwidth, format_bytes, format_duration

    n, k = config.num_workers, config.num_ps
    cpu_timed = config.cores is not None and config.step_compute_cpu_s is not None
    print(
        f"{config.num_params:.4g} parameters x {config.bytes_per_param:g} B = {format_bytes(config.model_bytes)}; "
        f"{_plural(n, 'worker')}, {k} PS, {config.mode}; links {format_bandwidth(config.bandwidth)}"
        + (f"; {config.cores:g} shared CPU cores" if config.cores else "")
    )
    print()
    explain = {
        "compute": "forward + backward" + (", its CPU time for this run's roles on the cores" if cpu_timed else ""),
        "worker link": "M/B each way: a worker moves the whole model",
        "CPU cores": "the CPU work of every role in one round, over the cores",
        "PS link": "n·M/(k·B) each way: the busiest PS moves n·M/k",
        "PS apply": f"{n if config.mode == 'async' else 1} update(s) per round, each split over the PS",
    }
    print_table(
        None,
        ["part of a step", "time", "what it is"],
        [
            [term, format_duration(p.parts[term]), explain[term]]
            for term in TERMS
            if term != "CPU cores" or config.cores
        ],
        right={"time"},
    )
    if config.cores:
        print("  (local run: a worker's link time adds to its compute, a PS's to its apply, as both are CPU work)")
        reload_s = config.switch_cpu_s(n + k, config.model_bytes)
        if reload_s and config.calibrated_roles is not None:
            more = "more" if reload_s > 0 else "less"
            print(
                f"  ({n + k} roles on {config.cores:.3g} cores, the calibrating run had {config.calibrated_roles}: a"
                f" worker step costs {format_duration(abs(reload_s))} {more} CPU on its worker and as much on the PS,"
                " for the caches the roles evict from each other)"
            )
    print()


def _print_speed(config: PlanConfig, p: Prediction) -> None:
    from shardflow.planning.units import format_duration

    per_round = "every worker update is one" if config.mode == "async" else "one per round of all workers"
    print_table(
        None,
        ["predicted", "value", ""],
        [
            ("step time", format_duration(p.step_s), "compute, then push + pull and apply"),
            ("step time with overlap", format_duration(p.overlap_step_s), "the slowest part"),
            ("global steps/s", f"{p.global_steps_per_s(p.step_s):.4g}", per_round),
            ("global steps/s with overlap", f"{p.global_steps_per_s(p.overlap_step_s):.4g}", ""),
        ],
        right={"value"},
    )


def _print_bottleneck(config: PlanConfig, p: Prediction) -> None:
    """What limits the step and why, and how many PS would stop the PS limiting it."""
    from shardflow.planning.plan_model import num_ps_needed, predict
    from shardflow.planning.units import format_bytes, format_duration

    n, k = config.num_workers, config.num_ps
    why = {
        "compute": "forward and backward take longer than moving the model; with overlap, communication hides",
        "worker link": f"every worker moves the whole model ({format_bytes(config.model_bytes)}) each way per step;"
        " more PS cannot help, fewer bytes (e.g. --bytes-per-param 2) or faster links can",
        "CPU cores": "the roles' CPU work per round exceeds the cores they share; more workers here add no speed",
        "PS link": f"the busiest PS moves n·M/k = {format_bytes(n * config.model_bytes / k)} each way per step; add PS",
        "PS apply": "applying every update takes the PS longer than a step; add PS",
    }
    print(f"bottleneck: {p.bottleneck} ({why[p.bottleneck]})")
    needed = num_ps_needed(config)
    at_needed = predict(replace(config, num_ps=needed))
    if p.bottleneck.startswith("PS"):
        print(f"PS needed: {needed} PS stop the PS being the bottleneck ", end="")
    else:
        print(f"PS needed: {needed} would do; with {k} the PS is not the bottleneck ", end="")
    step, overlap = format_duration(at_needed.step_s), format_duration(at_needed.overlap_step_s)
    print(f"(with {needed}: step {step}, overlap {overlap})")


def _print_allreduce(config: PlanConfig, p: Prediction, allreduce: bool) -> None:
    """Ring all-reduce's step for comparison; with --allreduce, which of the two is faster."""
    from shardflow.planning.plan_model import predict_allreduce
    from shardflow.planning.units import format_duration

    if config.ring is not None:  # from an all-reduce run: the strategies' table below predicts it
        return
    ring = predict_allreduce(config)
    print(
        f"all-reduce (sync, 2(n-1)/n·M/B = {format_duration(ring.communication_s)} per step): "
        f"step {format_duration(ring.step_s)}, with overlap {format_duration(ring.overlap_step_s)}"
    )
    if allreduce:
        faster = "all-reduce" if ring.overlap_step_s < p.overlap_step_s else "the PS"
        print(f"  global steps/s {1 / ring.step_s:.4g} ({1 / ring.overlap_step_s:.4g} with overlap); ", end="")
        print(f"per worker step with overlap, {faster} is faster ({format_duration(ring.overlap_step_s)} vs ", end="")
        print(f"{format_duration(p.overlap_step_s)})")


def _print_strategies(config: PlanConfig, which: str, batch_size: int | None) -> None:
    """The chosen strategies side by side and, of two or more, the winner with its reason."""
    from shardflow.planning.strategies import NAMES, STRATEGIES, describe, predict_all, winner

    chosen = STRATEGIES if which == "all" else tuple(s for s in STRATEGIES if s == which)
    predictions = predict_all(config, chosen)
    header = [
        "strategy",
        "global steps/s",
        "batches/s",
        *(["examples/s"] if batch_size else []),
        "busiest link, bound",
        "calibrated on",
    ]
    rows = [
        [
            NAMES[p.strategy],
            _rate(p.global_steps_per_s),
            _rate(p.batches_per_s),
            *([_rate(p.batches_per_s * batch_size)] if batch_size else []),
            describe(p),
            p.calibration,
        ]
        for p in predictions
    ]
    print_table(None, header, rows, right={"global steps/s", "batches/s", "examples/s"})
    # Without tables hybrid is all-reduce under another name; a tie between the two would name no real choice.
    contenders = [p for p in predictions if p.strategy != "hybrid" or config.sparse_params > 0]
    if config.sparse_params == 0 and "hybrid" in chosen:
        print("  (no --sparse-params: hybrid has no sf.nn rows for the PS and is all-reduce)")
    if len(contenders) > 1:
        _, reason = winner(contenders)
        print(f"winner: {reason}")


def _rate(per_s: float) -> str:
    return f"{per_s:,.0f}" if per_s >= 100 else f"{per_s:.3g}"


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"
