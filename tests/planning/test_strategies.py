"""PS, all-reduce and hybrid from one calibration, against numbers computed by hand."""

import pytest

from shardflow.planning.plan_model import PlanConfig
from shardflow.planning.strategies import (
    predict_all,
    predict_strategy,
    ps_link_bytes,
    ring_bytes,
    winner,
)

# 1M float32 parameters = 4 MB; at 1 GB/s, M/B = 4 ms. Apply of the whole model: 2 ms.
DENSE = PlanConfig(num_params=1e6, num_workers=4, num_ps=1, bandwidth=1e9, step_compute_s=0.010, ps_apply_s=0.002)
# 10M parameters a step moves, 9M of them table rows, out of tables of 1B parameters.
SPARSE = PlanConfig(
    num_params=10e6,
    sparse_params=9e6,
    table_params=1e9,
    num_workers=4,
    num_ps=4,
    bandwidth=10e9 / 8,
    step_compute_s=0.050,
)


def test_ring_allreduce_sends_2_n_minus_1_over_n_of_the_gradients():
    assert ring_bytes(4, 4e6) == pytest.approx(6e6)
    assert ring_bytes(1, 4e6) == 0


def test_the_busiest_ps_carries_n_over_k_of_the_pushes():
    assert ps_link_bytes(SPARSE, 36e6) == {"worker": 36e6, "ps:0": 36e6}
    assert ps_link_bytes(DENSE, 4e6) == {"worker": 4e6, "ps:0": 16e6}


def test_allreduce_sums_the_tables_in_full_and_hybrid_only_the_dense_part():
    assert SPARSE.allreduce_bytes == pytest.approx((1e6 + 1e9) * 4)
    assert predict_strategy(SPARSE, "hybrid").link_bytes["worker"] == pytest.approx(ring_bytes(4, 4e6) + 36e6)


def test_allreduce_overlaps_compute_with_the_ring_then_applies_on_every_worker():
    # Ring: 2·3/4 · 4 MB = 6 MB at 1 GB/s = 6 ms, under 10 ms of compute; then the whole 2 ms apply.
    ring = predict_strategy(DENSE, "allreduce")
    assert ring.round_s == pytest.approx(0.012)
    assert ring.bound == "compute"
    assert ring.global_steps_per_s == pytest.approx(1 / 0.012)
    assert ring.batches_per_s == pytest.approx(4 / 0.012)
    assert ring.link_bytes == {"worker": pytest.approx(6e6)}


def test_async_ps_counts_every_worker_update_as_a_global_step():
    # ps:0 moves 4 · 4 MB each way: 2 · 16 ms = 32 ms per round; its 4 applies of 2 ms overlap on its CPU.
    ps = predict_strategy(DENSE, "ps")
    assert ps.round_s == pytest.approx(0.032)
    assert ps.busiest_link == "ps:0"
    assert ps.global_steps_per_s == pytest.approx(ps.batches_per_s)


def test_hybrid_without_table_rows_is_allreduce():
    assert predict_strategy(DENSE, "hybrid").round_s == predict_strategy(DENSE, "allreduce").round_s


def test_winner_has_the_most_batches_per_second_and_names_the_busiest_link():
    best, reason = winner(predict_all(DENSE, ("ps", "allreduce")))
    assert best.strategy == "allreduce"
    assert reason.startswith("all-reduce, 333.3 batches/s against 125 for PS (2.67x)")
    assert "PS moves 16 MB each way through ps:0, the busiest link, per round (bound: PS link)" in reason


def test_hybrid_wins_when_all_reduce_must_sum_whole_tables():
    best, reason = winner(predict_all(SPARSE))
    assert best.strategy == "hybrid"
    assert "against 62.5 for PS" in reason


def test_on_shared_cores_allreduce_keeps_the_workers_overhead_and_drops_the_ps_cpu():
    # Measured under the PS: 3 ms worker CPU = 1 ms compute + 4·M/B copies (4·0.25 ms) + 1 ms overhead.
    local = PlanConfig(
        num_params=250e3,
        num_workers=2,
        num_ps=1,
        bandwidth=4e9,
        step_compute_s=1e-3,
        ps_apply_s=0.5e-3,
        cores=2,
        worker_cpu_s=3e-3,
        ps_cpu_s=1.5e-3,
    )
    # All-reduce per worker: 1 ms compute + 1 ms overhead + 2 copies of 1 MB sent and received (1 ms) + 0.5 ms apply.
    ring = predict_strategy(local, "allreduce")
    assert ring.bound == "CPU cores"
    assert ring.round_s == pytest.approx(2 * 3.5e-3 / 2)
    assert predict_strategy(local, "ps").round_s == pytest.approx(2 * (3e-3 + 1.5e-3) / 2)


def test_sparse_params_above_num_params_is_named():
    with pytest.raises(ValueError, match="sparse_params must be in"):
        PlanConfig(num_params=1e6, sparse_params=2e6, num_workers=1, num_ps=1, bandwidth=1e9, step_compute_s=1e-3)


def test_an_allreduce_worker_on_cores_that_keep_up_computes_in_its_cpu_time():
    # One worker: no ring; 1 ms of compute on a core, then its 0.2 ms optimizer step.
    config = PlanConfig(
        num_params=25e3,
        num_workers=1,
        num_ps=1,
        bandwidth=2e9,
        step_compute_s=1.4e-3,
        step_compute_cpu_s=1.0e-3,
        ps_apply_s=0.2e-3,
        cores=2,
        worker_cpu_s=1.5e-3,
    )
    prediction = predict_strategy(config, "allreduce")
    assert prediction.bound == "compute"
    assert prediction.round_s == pytest.approx(1.2e-3)
