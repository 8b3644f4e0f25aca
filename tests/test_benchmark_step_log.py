"""The benchmarks' steady-state rate (benchmarks/step_log.py) counts only the steps after every worker's warm-up."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from step_log import steady_steps_per_s


def test_steady_rate_starts_once_every_worker_is_past_its_warm_up():
    # worker 0 steps once a second from t=0; worker 1 starts late (t=50) and then steps once a second too.
    early = [[i, 2 * i] for i in range(100)]
    late = [[50 + i, 2 * i + 1] for i in range(50)]
    # From worker 1's step after its 10 warm-up steps (t=60, global step 21) to the last (global step 198, t=99).
    assert steady_steps_per_s([early, late], warmup_steps=10) == (198 - 21) / (99 - 60)
