"""Predict step time and the bottleneck of a PS cluster from the model size, links and compute; compare all-reduce."""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from typing import TYPE_CHECKING

from shardflow.cli.tables import print_table

if TYPE_CHECKING:
    from shardflow.planning.calibrate import Calibration
    from shardflow.planning.plan_model import PlanConfig, Prediction

EPILOG = """\
examples:
  shardflow plan --params 100M --workers 64 --ps 8 --bandwidth 25Gbit --step-compute 120ms
  shardflow plan --calibrate runs/mlp --workers 4 --cores 2       from a profiled run, for a local cluster

The model, per worker step (M model bytes, B link bandwidth, n workers, k PS):
  PS communication per direction   max(M/B, n·M/(k·B))   a worker moves M, the busiest PS n·M/k
  all-reduce communication         2(n-1)/n · M/B
  step time                        compute + push + pull (+ apply); with overlap, the slowest part
--cores models a local run: moving bytes is then CPU work on both ends, and all roles share the cores.
  With --calibrate it uses the CPU every role measured per step (all threads). That cost rises once the
  roles outnumber the cores, so calibrate on a run that already keeps the cores busy.
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
    parser.add_argument("--cores", type=float, metavar="C", help="a local run: all roles share C CPU cores")
    parser.add_argument("--allreduce", action="store_true", help="show the all-reduce prediction in full")
    parser.add_argument("--calibrate", metavar="MODEL_DIR", help="measure the inputs from a profiled run's capture")
    parser.add_argument("--capture", metavar="NAME", help="with --calibrate: the capture to use (latest)")


def run(args: argparse.Namespace) -> int:
    from shardflow.profile.capture import CaptureNotFoundError

    try:
        calibration = _calibration(args)
        config = _config(args, calibration)
    except (ValueError, CaptureNotFoundError) as error:
        print(f"shardflow plan: error: {error}", file=sys.stderr)
        return 2
    if calibration is not None:
        _print_calibration(calibration)
    _print_prediction(config, args.allreduce)
    return 0


def _calibration(args: argparse.Namespace) -> Calibration | None:
    if args.calibrate is None:
        if args.capture is not None:
            raise ValueError("--capture needs --calibrate MODEL_DIR")
        return None
    from shardflow.planning.calibrate import calibrate

    return calibrate(args.calibrate, args.capture)


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
    if args.cores is not None and not args.cores > 0:
        raise ValueError(f"--cores must be positive, e.g. --cores 2; got {args.cores}")
    if args.bytes_per_param <= 0:
        raise ValueError(f"--bytes-per-param must be positive, e.g. --bytes-per-param 2; got {args.bytes_per_param}")

    def measured(name: str) -> float:
        assert calibration is not None  # every flag without a default is required when nothing was measured
        return float(getattr(calibration, name))

    return PlanConfig(
        num_params=parse_count(args.params) if args.params else measured("model_bytes") / args.bytes_per_param,
        bytes_per_param=args.bytes_per_param,
        num_workers=args.workers or int(measured("num_workers")),
        num_ps=args.ps or int(measured("num_ps")),
        bandwidth=parse_bandwidth(args.bandwidth) if args.bandwidth else measured("bandwidth"),
        step_compute_s=parse_duration(args.step_compute) if args.step_compute else measured("step_compute_s"),
        mode=args.mode,
        ps_apply_s=parse_duration(args.ps_apply, "--ps-apply") if args.ps_apply else _apply_s(calibration),
        cores=args.cores,
        # Measured CPU per step only describes the cores it was measured on: a local run.
        worker_cpu_s=calibration.worker_cpu_s if calibration is not None and args.cores else None,
        ps_cpu_s=calibration.ps_cpu_s if calibration is not None and args.cores else None,
        other_cores=min(calibration.other_cores, args.cores / 2) if calibration is not None and args.cores else 0.0,
    )


def _apply_s(calibration: Calibration | None) -> float:
    return calibration.ps_apply_s if calibration is not None else 0.0


def _print_calibration(c: Calibration) -> None:
    from shardflow.planning.units import format_bandwidth, format_bytes, format_duration

    print(f"measured in {c.capture} ({_plural(c.num_workers, 'worker')}, {c.num_ps} PS):")
    rows = [
        ["model on the wire", format_bytes(c.model_bytes), "pushed per worker step"],
        ["compute per step", format_duration(c.step_compute_s), "forward + backward, pushes excluded"],
        ["effective bandwidth", format_bandwidth(c.bandwidth), "push, PS receive and reply spans"],
        ["PS apply per update", format_duration(c.ps_apply_s), ""],
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
    rows.append(
        ["achieved", format_duration(c.worker_step_s), f"per worker step, {c.global_steps_per_s:.1f} global steps/s"]
    )
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
    print(
        f"{config.num_params:.4g} parameters x {config.bytes_per_param:g} B = {format_bytes(config.model_bytes)}; "
        f"{_plural(n, 'worker')}, {k} PS, {config.mode}; links {format_bandwidth(config.bandwidth)}"
        + (f"; {config.cores:g} shared CPU cores" if config.cores else "")
    )
    print()
    explain = {
        "compute": "forward + backward",
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


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"
