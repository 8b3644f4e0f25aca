"""BENCHMARKS.md is written by benchmarks/run_all.py from the stored results, never by hand, and says which
benchmarks have no result yet, with the command that measures them."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run_all():
    spec = importlib.util.spec_from_file_location("run_all", ROOT / "benchmarks" / "run_all.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["run_all"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


run_all = _run_all()


def test_benchmarks_md_is_the_table_of_the_stored_results():
    assert (ROOT / "BENCHMARKS.md").read_text() == run_all.render(run_all.stored_results()), (
        "BENCHMARKS.md differs from what the stored results give: run `python benchmarks/run_all.py --table-only`"
    )


def test_every_stored_result_is_of_a_known_benchmark_and_has_rows():
    for name, result in run_all.stored_results().items():
        assert name in run_all.BY_NAME, f"benchmarks/results/{name}.json: no such benchmark in run_all.py"
        assert result["rows"], f"benchmarks/results/{name}.json has no rows"
        assert {"date", "command", "commit", "load", "figures"} <= set(result)


def test_a_benchmark_without_a_result_says_so_with_its_command_and_no_figure():
    benchmark = run_all.BENCHMARKS[0]
    (line,) = run_all.table_rows(benchmark, None)
    assert "not measured since the table was introduced" in line
    assert f"`python benchmarks/run_all.py {benchmark.name}`" in line


def test_a_result_gives_one_line_per_row_with_its_ratio_target_and_load(tmp_path):
    result = {
        "benchmark": "comm_roundtrip",
        "date": "2026-11-27 08:00 UTC",
        "command": "python benchmarks/comm_roundtrip.py",
        "commit": "abc1234",
        "exit_status": 0,
        "machine": {"cores": 2, "memory_gb": 24},
        "load": {"load_average_median": 1.5, "load_average_max": 2.0, "other_processes_cores": 0.5, "seconds": 13},
        "figures": {},
        "rows": [
            {"measure": "bandwidth", "shardflow": 2.4, "peer": "raw TCP", "peer_figure": 3.0, "ratio": 0.8}
            | {"target": ">= 0.8", "met": True},
            {"measure": "state", "shardflow": 751, "peer": "tf.data", "peer_figure": 3_235_601, "ratio": 0.000232}
            | {"target": "", "met": None},
        ],
    }
    first, second = run_all.table_rows(run_all.BY_NAME["comm_roundtrip"], result)
    assert "| 2.40 | raw TCP | 3.00 | 0.80 | >= 0.8 | yes | 2026-11-27 08:00 UTC |" in first
    assert "load average 1.5 (max 2.0); other processes 0.50 of 2 cores" in first
    assert "| 751 | tf.data | 3,235,601 | 1/4,310 |" in second


def test_a_ratio_of_zero_is_written_as_such():
    # A winner check that missed: shardflow's figure 0 over the peer's 1.
    assert run_all._ratio(0.0) == "0.00"
