"""Run a training script at several cluster sizes; table, plot and explanation of how it scales."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from shardflow.cli.tables import print_table

EPILOG = """\
example:
  shardflow scale train.py --workers 1,2,4 --target 'accuracy>=0.95' --batch-size 64 -- --epochs 5

Options may come before or after SCRIPT; the script's own arguments come after --. Each size runs
`shardflow launch --workers N --ps M SCRIPT ARGS` in a fresh model dir (OUT/workers-N/), with
SHARDFLOW_MODEL_DIR, SHARDFLOW_RESULT_JSON and SHARDFLOW_PROFILE_STEPS set, and reads the result the chief
writes. Steps and time to the target come from the chief's periodic evaluations, so give the script
EvalSpec(every_n_steps=...). OUT gets scale.json, scale.png and scale.html.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = EPILOG
    _add_options(parser)
    parser.add_argument(
        "script_and_args", nargs=argparse.REMAINDER, metavar="SCRIPT [OPTIONS] [-- ARGS]", help="the training script"
    )


def _add_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", type=_sizes, default=[1, 2, 4], metavar="N,N,...", help="sizes to run (1,2,4)")
    parser.add_argument("--ps", type=int, default=1, metavar="M", help="parameter servers at every size (1)")
    parser.add_argument("--target", metavar="EXPR", help="e.g. 'accuracy>=0.95' or 'loss<0.1' (quoted)")
    parser.add_argument("--mode", choices=["async", "sync", "ssp"], help="fail unless the script trains in this mode")
    parser.add_argument("--batch-size", type=int, metavar="B", help="the script's batch per worker, for the text")
    parser.add_argument(
        "--profile-steps", type=_step_range, default=(50, 150), metavar="A,B", help="global steps profiled (50,150)"
    )
    parser.add_argument("--no-profile", action="store_true", help="skip the capture and the time breakdown")
    parser.add_argument("--timeout", type=float, default=600.0, metavar="SECONDS", help="per run (600)")
    parser.add_argument("--out", type=Path, metavar="DIR", help="where runs and reports go (runs/scale-SCRIPT)")


def run(args: argparse.Namespace) -> int:
    from shardflow.planning.scale_report import explain, plot, table_rows, write_html
    from shardflow.planning.scaling import ScaleConfig, ScaleRunError, run_size, summarize
    from shardflow.planning.target import TargetError, parse_target

    try:
        script, script_args = _split_command(args)
        target = parse_target(args.target) if args.target else None
        out = args.out or Path("runs") / f"scale-{script.stem}"
        config = ScaleConfig(
            script=script,
            script_args=tuple(script_args),
            num_ps=args.ps,
            out=out,
            profile_steps=None if args.no_profile else args.profile_steps,
            timeout_s=args.timeout,
        )
    except ValueError as error:  # TargetError included
        return _error(str(error))
    rows = []
    try:
        for num_workers in args.workers:
            row = summarize(run_size(config, num_workers), target)
            if args.mode and row.mode != args.mode:
                return _error(
                    f"the script trains in {row.mode!r} mode, not {args.mode!r}; "
                    f"set ParameterServerStrategy(mode={args.mode!r}) in {script} or drop --mode"
                )
            rows.append(row)
    except (ScaleRunError, TargetError) as error:
        return _error(str(error))
    table = table_rows(rows, target)
    paragraphs = explain(rows, target, args.batch_size)
    unprofiled = [row for row in rows if row.breakdown is None]
    if config.profile_steps is not None and unprofiled:
        first, last = config.profile_steps
        paragraphs.append(
            f"No capture of the run with {unprofiled[0].num_workers} worker(s), which ended at global step "
            f"{unprofiled[0].global_step}: choose --profile-steps A,B inside every run (now {first},{last})."
        )
    png = plot(rows, target, out / "scale.png")
    page = write_html(table, paragraphs, png, out / "scale.html", f"shardflow scale: {script.name}")
    summary = {
        "script": str(script),
        "target": str(target) if target else None,
        "rows": [{k: v for k, v in asdict(row).items() if k != "result"} for row in rows],
        "explanation": paragraphs,
    }
    (out / "scale.json").write_text(json.dumps(summary, indent=1))
    print()
    print_table(None, table[0], table[1:], right=table[0])
    print()
    for paragraph in paragraphs:
        print(paragraph)
        print()
    print(f"plot: {png}\nreport: {page}")
    return 0


def _split_command(args: argparse.Namespace) -> tuple[Path, list[str]]:
    """SCRIPT [OPTIONS] [-- ARGS]: reads the options after SCRIPT into args; returns the script and its arguments."""
    command = args.script_and_args[1:] if args.script_and_args[:1] == ["--"] else args.script_and_args
    if not command:
        raise ValueError("name the training script, e.g. shardflow scale train.py --workers 1,2,4")
    rest = command[1:]
    options, script_args = (rest[: rest.index("--")], rest[rest.index("--") + 1 :]) if "--" in rest else (rest, [])
    parser = argparse.ArgumentParser(prog="shardflow scale", add_help=False, exit_on_error=False)
    _add_options(parser)
    try:
        _, unknown = parser.parse_known_args(options, namespace=args)
    except argparse.ArgumentError as error:
        raise ValueError(str(error)) from None
    if unknown:
        raise ValueError(
            f"unknown option(s) {' '.join(unknown)}; the script's own arguments go after --, "
            f"e.g. shardflow scale {command[0]} --workers 1,2 -- {' '.join(unknown)}"
        )
    return Path(command[0]), script_args


def _error(message: str) -> int:
    print(f"shardflow scale: error: {message}", file=sys.stderr)
    return 2


def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected worker counts like 1,2,4; got {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"expected worker counts of at least 1, like 1,2,4; got {text!r}")
    return sizes


def _step_range(text: str) -> tuple[int, int]:
    first, _, last = text.partition(",")
    try:
        return int(first), int(last)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected A,B (global steps [A, B)), like 50,150; got {text!r}") from None
