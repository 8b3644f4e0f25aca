"""Query a profile capture: top ops, per-step breakdown and diagnosis, memory, diff, SQL, HTML report."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shardflow.cli.tables import print_table

if TYPE_CHECKING:
    from shardflow.train.job_keys import Capture

EPILOG = """\
examples:
  shardflow profile steps runs/clicks                 where each step's time goes, and the bottleneck
  shardflow profile top runs/clicks --filter 'aten::' --steps 10:20
  shardflow profile sql runs/clicks "SELECT role, sum(dur) FROM events WHERE name = 'apply' GROUP BY role"
  shardflow profile report runs/clicks -o profile.html
  shardflow profile export runs/clicks --hta hta/       one trace per rank for HolisticTraceAnalysis

Each command reads MODEL_DIR/profile/<capture>/, the latest capture unless --capture NAME. A query that selects
nothing says why and exits with status 1.
"""


class NothingSelectedError(Exception):
    """The query ran and selected nothing: a step range outside the capture, a filter matching no name."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = EPILOG
    commands = parser.add_subparsers(dest="profile_command", metavar="QUERY", required=True)
    top = _query(commands, "top", "time (or allocated bytes) per op, source, shape, role or device")
    top.add_argument("--by", choices=["time", "memory"], default="time", help="what to rank by (time)")
    top.add_argument("--group-by", choices=["op", "source", "shape", "role", "device"], default="op", help="(op)")
    top.add_argument("--filter", metavar="REGEX", help="show only names matching; hidden ones roll up into parents")
    top.add_argument("--limit", type=int, default=25, metavar="N", help="rows to print (25)")
    steps = _query(commands, "steps", "per-step breakdown per role, and a diagnosis in words")
    steps.add_argument("--per-step", action="store_true", help="one line per role and step, not only the means")
    _query(commands, "memory", "peak memory per role, what ran and what was live at the peak")
    diff = commands.add_parser("diff", help="per-step time of capture B against capture A")
    diff.add_argument("model_dir_a", type=Path, metavar="DIR_A")
    diff.add_argument("model_dir_b", type=Path, metavar="DIR_B")
    diff.add_argument("--capture-a", metavar="NAME", help="capture in DIR_A (latest)")
    diff.add_argument("--capture-b", metavar="NAME", help="capture in DIR_B (latest)")
    diff.add_argument("--limit", type=int, default=25, metavar="N", help="rows to print (25)")
    sql = _query(commands, "sql", "any SQL over the capture's events (view `events`), with duckdb", steps=False)
    sql.add_argument("query", help='e.g. "SELECT name, count(*) FROM events GROUP BY name"')
    report = _query(commands, "report", "write one self-contained HTML report", steps=False)
    report.add_argument("-o", "--output", type=Path, metavar="HTML", help="(the capture's report.html)")
    export = _query(commands, "export", "write the capture for other tools: HolisticTraceAnalysis", steps=False)
    export.add_argument(
        "--hta", type=Path, required=True, metavar="DIR", help="one trace file per rank (role) for HTA's TraceAnalysis"
    )
    capture = commands.add_parser("capture", help="ask a running job to capture its next N global steps")
    capture.add_argument("model_dir", type=Path, metavar="MODEL_DIR")
    capture.add_argument("--steps", type=int, required=True, metavar="N", help="number of global steps")
    capture.add_argument("--ops", action="store_true", help="also record torch ops, shapes and memory (costly)")


def run(args: argparse.Namespace) -> int:
    from shardflow.profile.capture import CaptureNotFoundError

    try:
        code: int = _RUNNERS[args.profile_command](args)
    except (CaptureNotFoundError, ValueError) as error:
        print(f"shardflow profile {args.profile_command}: error: {error}", file=sys.stderr)
        return 2
    except NothingSelectedError as nothing:
        print(f"shardflow profile {args.profile_command}: nothing selected: {nothing}", file=sys.stderr)
        return 1
    return code


def _query(commands: Any, name: str, summary: str, steps: bool = True) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = commands.add_parser(name, help=summary, description=summary)
    parser.add_argument("model_dir", type=Path, metavar="MODEL_DIR")
    parser.add_argument("--capture", metavar="NAME", help="capture name under MODEL_DIR/profile/ (latest)")
    if steps:
        parser.add_argument("--steps", type=_step_range, metavar="A:B", help="only global steps [A, B)")
    return parser


def _step_range(text: str) -> tuple[int, int]:
    first, _, last = text.partition(":")
    try:
        return (int(first), int(last)) if last else (int(first), int(first) + 1)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected A:B with integers (global steps [A, B)), got {text!r}") from None


def _load(model_dir: Path, name: str | None) -> Any:
    from shardflow.profile.capture import capture_dir, finalize
    from shardflow.profile.events import load

    return load(finalize(capture_dir(model_dir, name)))


def _steps_filter(args: argparse.Namespace) -> Any:
    from shardflow.profile.events import in_steps

    return in_steps(*args.steps) if args.steps else None


def _nothing_selected(table: Any, args: argparse.Namespace, otherwise: str) -> NothingSelectedError:
    """Why a query over `table` selected nothing: the first of its selections that matches no event."""
    import pyarrow.compute as pc

    from shardflow.profile.events import name_matches

    held = table["step"].drop_null()
    if args.steps and not _steps_filter(args)(table).any():
        first, last = args.steps
        holds = f"steps {pc.min(held).as_py()} to {pc.max(held).as_py()}" if len(held) else "no global steps"
        return NothingSelectedError(f"no event of global steps [{first}, {last}) in the capture; it holds {holds}")
    if getattr(args, "filter", None) and not name_matches(args.filter)(table).any():
        return NothingSelectedError(f"--filter {args.filter!r} matches no event name in the capture")
    return NothingSelectedError(otherwise)


def _top(args: argparse.Namespace) -> int:
    from shardflow.profile.analysis import top
    from shardflow.profile.events import name_matches

    shown = name_matches(args.filter) if args.filter else None
    table = _load(args.model_dir, args.capture)
    rows = top(table, args.by, args.group_by, shown, _steps_filter(args))
    if not rows:
        raise _nothing_selected(table, args, f"no {'allocations' if args.by == 'memory' else 'spans'} to rank")
    unit, scale = ("ms", 1000) if args.by == "time" else ("MB", 1e6)
    header = [args.group_by, "calls", f"self {unit}", f"total {unit}", "share"]
    print_table(
        None,
        header,
        [
            [r.key, r.calls, f"{r.self_value / scale:.3f}", f"{r.total_value / scale:.3f}", f"{r.share:.1%}"]
            for r in rows[: args.limit]
        ],
    )
    return 0


def _steps(args: argparse.Namespace) -> int:
    from shardflow.profile.diagnose import CATEGORIES, diagnose, steps, summarize
    from shardflow.profile.trace import role_sort_key

    table = _load(args.model_dir, args.capture)
    rows = steps(table, _steps_filter(args))
    if not rows:
        raise _nothing_selected(table, args, "no span of a global step in the capture")
    parts = (*CATEGORIES, "idle")
    header = ["role", "step" if args.per_step else "steps", "step ms", *(f"{p} ms" for p in parts)]
    if args.per_step:
        lines = [
            [r.role, r.step, f"{r.step_us / 1000:.3f}", *(f"{r.parts_us[p] / 1000:.3f}" for p in parts)] for r in rows
        ]
    else:
        summaries = sorted(summarize(rows), key=lambda s: role_sort_key(s.role))
        lines = [
            [
                s.role,
                s.num_steps,
                f"{s.step_us / 1000:.3f}",
                *(f"{s.parts_us[p] / 1000:.3f} ({s.fraction(p):.0%})" for p in parts),
            ]
            for s in summaries
        ]
    print_table(None, header, lines)
    _tables(table)
    findings = diagnose(table, _steps_filter(args))
    print()
    for i, finding in enumerate(findings):
        if i == 0 or finding.fraction >= 0.25:
            print(("diagnosis: " if i == 0 else "also:      ") + finding.message)
    return 0


def _tables(table: Any) -> None:
    """The sf.nn tables' counters per PS, as the capture last saw them, if the model has any."""
    from shardflow.profile.analysis import table_counters

    found = table_counters(table)
    if not found:
        return
    names = ("rows", "admitted", "rejected", "evicted", "expired", "memory_bytes")
    lines = [[t.role, t.table, *(f"{t.counters[n]:.0f}" if n in t.counters else "-" for n in names)] for t in found]
    print_table("sf.nn tables", ["role", "table", *names], lines, right=set(names))


def _memory(args: argparse.Namespace) -> int:
    from shardflow.profile.analysis import memory

    table = _load(args.model_dir, args.capture)
    peaks = memory(table, _steps_filter(args))
    if not peaks:
        raise _nothing_selected(table, args, "the capture has no memory counters")
    print_table(
        "Peaks",
        ["role", "counter", "peak MB", "at ms", "step", "running at the peak"],
        [
            [
                peak.role,
                peak.counter,
                f"{peak.peak / 1e6:.3f}",
                f"{peak.ts / 1000:.3f}",
                peak.step if peak.step is not None else "between steps",
                " > ".join(peak.active) or "nothing recorded",
            ]
            for peak in peaks
        ],
        right={"peak MB", "at ms", "step"},
    )
    live = [(peak, group) for peak in peaks for group in peak.live[:10]]
    if not live:
        return 0  # allocations are recorded only with ops (profile_ops, --ops)
    print()
    print_table(
        "Live at the peak (the 10 largest per peak)",
        ["role", "counter", "live MB", "tensors", "op", "shape", "device"],
        [
            [peak.role, peak.counter, f"{group.bytes / 1e6:.3f}", group.count, group.op, group.shape, group.device]
            for peak, group in live
        ],
        right={"live MB", "tensors"},
    )
    return 0


def _diff(args: argparse.Namespace) -> int:
    from shardflow.profile.analysis import diff

    rows = diff(_load(args.model_dir_a, args.capture_a), _load(args.model_dir_b, args.capture_b))
    lines = [
        [r.key, f"{r.a_us / 1000:.3f}", f"{r.b_us / 1000:.3f}", f"{r.delta_us / 1000:+.3f}"] for r in rows[: args.limit]
    ]
    print_table(None, ["per global step", "A ms", "B ms", "B - A ms"], lines)
    return 0


def _sql(args: argparse.Namespace) -> int:
    import duckdb

    from shardflow.profile.capture import capture_dir, finalize

    table_path = str(finalize(capture_dir(args.model_dir, args.capture))).replace("'", "''")
    connection = duckdb.connect()
    connection.execute(f"CREATE VIEW events AS SELECT * FROM read_parquet('{table_path}')")
    try:
        result = connection.execute(args.query)
    except duckdb.Error as error:
        raise ValueError(f"the query failed: {error}") from None
    header = [column[0] for column in result.description or []]
    rows = result.fetchall()
    if not rows:
        raise NothingSelectedError("the query returned no rows")
    print_table(None, header, rows)
    return 0


def _report(args: argparse.Namespace) -> int:
    from shardflow.profile.capture import capture_dir, finalize
    from shardflow.profile.events import load
    from shardflow.profile.report import write_report

    directory = capture_dir(args.model_dir, args.capture)
    output = args.output or directory / "report.html"
    write_report(
        load(finalize(directory)), output, title=f"shardflow profile: {args.model_dir.name} / {directory.name}"
    )
    print(output)
    return 0


def _export(args: argparse.Namespace) -> int:
    from shardflow.profile.capture import MERGED, capture_dir
    from shardflow.profile.hta import export_hta

    files = export_hta(capture_dir(args.model_dir, args.capture) / MERGED, args.hta)
    if not any(file.path for file in files):
        raise NothingSelectedError("no role has work spans (forward, backward, push, apply, ...) in the capture")
    print_table(
        None,
        ["rank", "role", "file"],
        [[f.rank, f.role, f.path or "no work in the capture: left out"] for f in files],
        right={"rank"},
    )
    print(f"\nin Python: hta.trace_analysis.TraceAnalysis(trace_dir={str(args.hta)!r}).get_temporal_breakdown()")
    return 0


def _capture(args: argparse.Namespace) -> int:
    # The runtime answers the request; the query commands above need only shardflow.profile.
    from shardflow.profile.capture import finalize
    from shardflow.profile.events import trace_metadata
    from shardflow.profile.trace import role_sort_key
    from shardflow.train.profiling import request_capture

    def announce(capture: Capture) -> None:
        recorded = "spans, counters and torch ops" if capture.ops else "spans and counters; --ops adds torch ops"
        print(f"asked the job in {args.model_dir} for global steps [{capture.first}, {capture.last}) of every role")
        print(f"({recorded}); waiting for the capture to land in {args.model_dir / 'profile' / capture.name}")
        sys.stdout.flush()  # the steps may take a while to come

    try:
        directory = request_capture(args.model_dir, args.steps, ops=args.ops, on_request=announce)
    except (FileNotFoundError, RuntimeError) as error:
        print(f"shardflow profile capture: {error}", file=sys.stderr)
        return 1
    roles = sorted(trace_metadata(finalize(directory)).get("roles", {}), key=role_sort_key)
    print(f"captured {', '.join(roles) or 'no role'} into {directory}; to read it:")
    print(f"  shardflow profile steps {args.model_dir} --capture {directory.name}")
    print(f"  shardflow profile report {args.model_dir} --capture {directory.name}")
    return 0


_RUNNERS = {
    "top": _top,
    "steps": _steps,
    "memory": _memory,
    "diff": _diff,
    "sql": _sql,
    "report": _report,
    "export": _export,
    "capture": _capture,
}
