"""The `RESULT {json}` line each benchmark prints last: its raw figures and the rows it adds to BENCHMARKS.md.

run_all.py reads the line, stores it in benchmarks/results/ and regenerates BENCHMARKS.md from every stored result.
A row compares one measure of shardflow with a peer run side by side in the same script; `ratio` is shardflow's
figure over the peer's, and `target` is what the ratio should satisfy (">= 3", "<= 1.02"), or "" where there is none;
a target on something else says so and gives `met` itself.
"""

from __future__ import annotations

import json
from typing import Any


def row(
    measure: str,
    shardflow: float,
    peer: str,
    peer_figure: float,
    *,
    ratio: float | None = None,
    target: str = "",
    met: bool | None = None,
) -> dict[str, Any]:
    """One row of the table; the ratio is shardflow's figure over the peer's unless given, and `met` whether the
    ratio satisfies the target unless given."""
    if ratio is None:
        ratio = shardflow / peer_figure if peer_figure else float("nan")
    if met is None and target:
        operator, bound = target.split()
        met = ratio >= float(bound) if operator == ">=" else ratio <= float(bound)
    return {
        "measure": measure,
        "shardflow": _four_digits(shardflow),
        "peer": peer,
        "peer_figure": _four_digits(peer_figure),
        "ratio": _four_digits(ratio),
        "target": target,
        "met": met,
    }


def _four_digits(value: float) -> float:
    return float(f"{value:.4g}")


def print_result(benchmark: str, figures: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    print("RESULT " + json.dumps({"benchmark": benchmark, "figures": figures, "rows": rows}), flush=True)
