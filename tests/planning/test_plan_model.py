"""The step model against numbers computed by hand."""

from dataclasses import replace

import pytest

from shardflow.planning.plan_model import PlanConfig, num_ps_needed, predict, predict_allreduce

# 100M float32 parameters = 400 MB; 25 Gbit/s = 3.125 GB/s, so M/B = 0.128 s.
TALK = PlanConfig(num_params=100e6, num_workers=64, num_ps=8, bandwidth=25e9 / 8, step_compute_s=0.120)


def test_ps_link_bounds_the_talk_example():
    p = predict(TALK)
    assert p.parts["worker link"] == pytest.approx(2 * 0.128)
    assert p.parts["PS link"] == pytest.approx(2 * 64 * 0.128 / 8)  # the busiest PS moves n·M/k each way
    assert p.communication_s == pytest.approx(2.048)
    assert p.step_s == pytest.approx(0.120 + 2.048)
    assert p.overlap_step_s == pytest.approx(2.048)
    assert p.bottleneck == "PS link"
    assert p.global_steps_per_s(p.overlap_step_s) == pytest.approx(64 / 2.048)


def test_as_many_ps_as_workers_stop_the_ps_link_bounding_a_link_bound_step():
    # Compute (120 ms) is below the worker link (256 ms), so the PS link must fall to M/B: k = n = 64.
    assert num_ps_needed(TALK) == 64
    assert predict(replace(TALK, num_ps=63)).bottleneck == "PS link"
    assert predict(replace(TALK, num_ps=64)).bottleneck == "worker link"


def test_fewer_ps_suffice_when_compute_is_slower_than_the_links():
    # PS link 2·64·0.128/k ≤ 0.5 s of compute  ⇔  k ≥ 32.77.
    slow = replace(TALK, step_compute_s=0.5)
    assert num_ps_needed(slow) == 33
    assert predict(replace(slow, num_ps=32)).bottleneck == "PS link"
    assert predict(replace(slow, num_ps=33)).bottleneck == "compute"


def test_a_compute_bound_step_needs_one_ps():
    # 4 MB at 10 GB/s: 0.4 ms each way; with 4 workers on 2 PS, the PS moves 0.8 ms each way.
    config = PlanConfig(num_params=1e6, num_workers=4, num_ps=2, bandwidth=10e9, step_compute_s=0.010)
    p = predict(config)
    assert p.communication_s == pytest.approx(2 * 0.8e-3)
    assert p.step_s == pytest.approx(0.010 + 1.6e-3)
    assert p.overlap_step_s == pytest.approx(0.010)
    assert p.bottleneck == "compute"
    assert num_ps_needed(config) == 1


def test_async_applies_every_worker_update_and_sync_one_per_round():
    config = PlanConfig(num_params=1e6, num_workers=8, num_ps=2, bandwidth=10e9, step_compute_s=0.010, ps_apply_s=0.040)
    assert predict(config).parts["PS apply"] == pytest.approx(8 * 0.040 / 2)
    assert predict(config).bottleneck == "PS apply"
    synchronous = predict(replace(config, mode="sync"))
    assert synchronous.parts["PS apply"] == pytest.approx(0.040 / 2)
    assert synchronous.global_steps_per_s(0.5) == pytest.approx(2.0)
    # 8 updates of 40 ms must fit in 10 ms of compute once split: k ≥ 32.
    assert num_ps_needed(config) == 32


def test_cores_turn_copies_into_cpu_work_that_all_roles_share():
    # M/B = 0.5 ms. Per round: 2 workers x (2 ms compute + 4 copies of 0.5 ms) + 2 applies of 0.5 ms = 9 ms on 2 cores.
    config = PlanConfig(
        num_params=250e3, num_workers=2, num_ps=1, bandwidth=2e9, step_compute_s=2e-3, ps_apply_s=0.5e-3, cores=2
    )
    p = predict(config)
    assert p.parts["CPU cores"] == pytest.approx(4.5e-3)
    assert p.overlap_step_s == pytest.approx(4.5e-3)
    assert p.bottleneck == "CPU cores"
    alone = predict(replace(config, num_workers=1))
    assert alone.overlap_step_s == pytest.approx(2e-3 + 2 * 0.5e-3)  # the worker's own copies add to its compute
    assert alone.bottleneck == "compute"


def test_measured_cpu_per_step_replaces_the_estimate_of_the_copies():
    # Measured: 3 ms of worker CPU and 1.5 ms of PS CPU per worker step; 0.2 cores go to the chief.
    config = PlanConfig(
        num_params=250e3,
        num_workers=2,
        num_ps=1,
        bandwidth=2e9,
        step_compute_s=2e-3,
        ps_apply_s=0.5e-3,
        cores=2,
        worker_cpu_s=3e-3,
        ps_cpu_s=1.5e-3,
        other_cores=0.2,
    )
    p = predict(config)
    assert p.parts["CPU cores"] == pytest.approx(2 * (3e-3 + 1.5e-3) / 1.8)
    assert p.bottleneck == "CPU cores"
    assert predict(replace(config, mode="sync")).parts["CPU cores"] == pytest.approx(p.parts["CPU cores"])


def test_ring_allreduce_moves_2_n_minus_1_over_n_of_the_model():
    ring = predict_allreduce(TALK)
    assert ring.communication_s == pytest.approx(2 * 63 / 64 * 0.128)
    assert ring.step_s == pytest.approx(0.120 + 0.252)
    assert ring.overlap_step_s == pytest.approx(0.252)


def test_allreduce_sums_the_sf_nn_tables_in_full_not_the_rows_a_step_touches():
    # Of the 100M parameters 90M are table rows a step touches, of tables of 1B in full: a worker all-reduces 1.01B.
    tables = replace(TALK, sparse_params=90e6, table_params=1e9)
    assert tables.allreduce_bytes == pytest.approx(1.01e9 * 4)
    assert predict_allreduce(tables).communication_s == pytest.approx(2 * 63 / 64 * 1.01e9 * 4 / (25e9 / 8))


def test_a_config_names_its_bad_field():
    with pytest.raises(ValueError, match="num_ps must be at least 1"):
        replace(TALK, num_ps=0)
    with pytest.raises(ValueError, match="bandwidth must be positive"):
        replace(TALK, bandwidth=0)


# A local run measured as the MLP benchmark's: 1.4 ms of compute in wall time, of which 1 ms on a core; 1.5 ms of
# worker CPU and 0.3 ms of PS CPU per worker step; M/B = 0.05 ms.
LOCAL = PlanConfig(
    num_params=25e3,
    num_workers=1,
    num_ps=1,
    bandwidth=2e9,
    step_compute_s=1.4e-3,
    step_compute_cpu_s=1.0e-3,
    cores=2,
    worker_cpu_s=1.5e-3,
    ps_cpu_s=0.3e-3,
)


def test_on_shared_cores_that_keep_up_the_compute_takes_its_cpu_time():
    # 1.8 ms of CPU per worker step on 2 cores: 0.9 ms, less than the worker's own 1.5 ms.
    p = predict(LOCAL)
    assert p.parts["compute"] == pytest.approx(1.0e-3)
    assert p.overlap_step_s == pytest.approx(1.0e-3 + 2 * 0.05e-3)
    assert p.bottleneck == "compute"


def test_once_the_cores_fall_short_the_compute_takes_longer_by_the_share_of_a_core_a_worker_gets():
    # 4 workers need 4 x 1.8 ms of CPU per round of 2 cores: 3.6 ms, in which a worker runs its 1.5 ms.
    p = predict(replace(LOCAL, num_workers=4))
    assert p.parts["CPU cores"] == pytest.approx(3.6e-3)
    assert p.parts["compute"] == pytest.approx(1.0e-3 * 3.6 / 1.5)
    assert p.bottleneck == "CPU cores"


def test_without_cores_the_compute_is_its_measured_wall_time():
    assert predict(replace(LOCAL, cores=None)).parts["compute"] == pytest.approx(1.4e-3)


def test_without_its_cpu_time_the_compute_is_its_measured_wall_time():
    assert predict(replace(LOCAL, step_compute_cpu_s=None)).parts["compute"] == pytest.approx(1.4e-3)


# LOCAL measured on 2 workers + 1 PS (3 roles on 2 cores: half a role beyond a core's share), 100 kB touched per step.
SWITCHING = replace(LOCAL, num_params=25e3, num_workers=2, calibrated_roles=3, refill_s_per_byte=1e-9)


def test_roles_beyond_the_cores_cost_cpu_to_reload_each_steps_working_set():
    # 5 roles on 2 cores: 1.5 roles per core beyond one, against the calibrating run's 0.5: 1 x 100 kB x 1 ns more.
    assert SWITCHING.switch_cpu_s(5, 100e3) == pytest.approx(1e-4)
    assert SWITCHING.switch_cpu_s(2, 100e3) == pytest.approx(-0.5e-4)  # no more roles than cores: the run's share back
    assert SWITCHING.switch_cpu_s(3, 100e3) == 0.0
    assert replace(SWITCHING, calibrated_roles=None).switch_cpu_s(5, 100e3) == 0.0
    assert replace(SWITCHING, cores=None).switch_cpu_s(5, 100e3) == 0.0


def test_a_ps_step_pays_the_reloads_on_its_worker_and_on_its_ps():
    # 4 workers + 1 PS: each worker step touches 100 kB on the worker and 100 kB on the PS, 0.1 ms more on each.
    p = predict(replace(SWITCHING, num_workers=4))
    assert p.parts["CPU cores"] == pytest.approx(4 * (1.5e-3 + 1e-4 + 0.3e-3 + 1e-4) / 2)
    assert predict(replace(SWITCHING, calibrated_roles=None, num_workers=4)).parts["CPU cores"] == pytest.approx(
        4 * 1.8e-3 / 2
    )


def test_waiting_for_a_core_grows_with_the_roles_beyond_the_cores():
    # The calibrating compute took 1.4 ms for 1 ms of CPU with 3 roles (0.5 beyond the 2 cores): 0.4 of waiting per
    # 0.5 role. With 5 roles 1.2, with 2 none; relative to the run's 1.4.
    assert SWITCHING.waiting_factor(3) == pytest.approx(1.0)
    assert SWITCHING.waiting_factor(5) == pytest.approx(2.2 / 1.4)
    assert SWITCHING.waiting_factor(2) == pytest.approx(1 / 1.4)
    assert replace(SWITCHING, calibrated_roles=2).waiting_factor(5) == 1.0  # a run with no wait to scale
    assert replace(SWITCHING, step_compute_cpu_s=None).waiting_factor(5) == 1.0


def test_calibrated_roles_and_refill_are_checked():
    with pytest.raises(ValueError, match="calibrated_roles must be at least 1"):
        replace(SWITCHING, calibrated_roles=0)
    with pytest.raises(ValueError, match="refill_s_per_byte must be >= 0"):
        replace(SWITCHING, refill_s_per_byte=-1.0)
