"""`make chaos`'s driver, without a job: the schedule a seed gives, how a job's lines become detect and recover times,
and the table it writes into its own block of RELIABILITY.md."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))  # the benchmarks import their neighbours as top-level modules

import audited_runs  # noqa: E402
import chaos  # noqa: E402


def test_a_seed_gives_the_same_schedule_every_time_and_another_seed_another():
    assert [chaos.plan_job(7, index) for index in range(8)] == [chaos.plan_job(7, index) for index in range(8)]
    assert [chaos.plan_job(7, index) for index in range(8)] != [chaos.plan_job(8, index) for index in range(8)]


def test_jobs_take_turns_in_every_mode_under_the_launcher_and_under_tf_config():
    flavours = {(plan.mode, plan.supervisor) for plan in (chaos.plan_job(1, index) for index in range(6))}
    modes = ("async", "sync", "hybrid")
    assert flavours == {(mode, supervisor) for mode in modes for supervisor in ("launch", "TF_CONFIG")}
    only_hybrid = [chaos.plan_job(1, index, ["hybrid"]) for index in range(4)]
    assert [(plan.mode, plan.supervisor) for plan in only_hybrid] == [("hybrid", "launch"), ("hybrid", "TF_CONFIG")] * 2


def test_every_fault_names_roles_its_supervisor_restarts_at_moments_in_range():
    plans = [chaos.plan_job(seed, index) for seed in range(30) for index in range(4)]
    for plan in plans:
        assert 3 <= len(plan.faults) <= 5
        assert 3 <= plan.faults[0].delay_s <= 8 and all(8 <= f.delay_s <= 15 for f in plan.faults[1:])
        for fault in plan.faults:
            assert len(set(fault.roles)) == len(fault.roles) == (2 if fault.kind == chaos.KILL_TWO else 1)
            if plan.supervisor == "launch":
                assert "chief" not in fault.roles, fault  # the launcher's chief is its job: losing it ends the job
            else:
                assert fault.kind not in chaos.ONLY_LAUNCH, fault
            if fault.stop_s is not None:
                assert fault.stops and 5 <= fault.stop_s <= 15
    fired = {fault.kind for plan in plans for fault in plan.faults}
    assert fired == set(chaos.KINDS)


def _lines(*timed: tuple[float, str]) -> audited_runs.Lines:
    lines = audited_runs.Lines()
    lines.lines.extend(timed)
    return lines


def test_a_ps_killed_then_restored_is_detected_recovered_and_counts_the_steps_done_again():
    plan = chaos.JobPlan(0, "async", "launch", (chaos.Fault(chaos.KILL_PS, ("ps:1",), 5.0),))
    outcome = chaos.JobOutcome(plan, [chaos.Fired(plan.faults[0], at=100.0)], returncode=0, started=90.0, seconds=60)
    outcome.exact = True
    lines = _lines(
        (100.2, "[launcher] ps:1 (pid 42) exited with code -9 (SIGKILL); restarting it in 0.5s (restart 1 of 50)"),
        (
            103.0,
            "[chief] ps:1 was lost and restarted: every PS restored to global step 64 (the latest checkpoint); "
            "the 17 steps since are done again; restored in 0.4s",
        ),
    )
    chaos.measure(lines, outcome, ended_at=150.0)
    (fired,) = outcome.fired
    assert (round(fired.detect_s, 2), round(fired.recover_s, 2), fired.steps_lost) == (0.2, 3.0, 17)
    assert fired.survived and outcome.steps_lost == 17


def test_a_failed_job_is_charged_to_its_last_fault_not_to_those_it_went_on_from():
    worker, ps = chaos.Fault(chaos.KILL_WORKER, ("worker:0",), 5.0), chaos.Fault(chaos.HANG_PS, ("ps:0",), 9.0)
    plan = chaos.JobPlan(1, "sync", "launch", (worker, ps))
    fired = [chaos.Fired(worker, at=10.0), chaos.Fired(ps, at=20.0)]
    outcome = chaos.JobOutcome(plan, fired, returncode=1, started=0.0, seconds=90, why="no result")
    lines = _lines(
        (10.1, "[launcher] worker:0 (pid 7) exited with code -9 (SIGKILL); restarting it in 0.5s"),
        (12.0, "[worker:0] worker:0 rejoins the job after 30 steps of its own; it resumes its input"),
        (30.0, "[chief] ps:0 is lost: no heartbeat for 10.0s"),
    )
    chaos.measure(lines, outcome, ended_at=90.0)
    assert [one.survived for one in outcome.fired] == [True, False]
    assert outcome.fired[1].detect_s == 10.0 and outcome.fired[1].recover_s is None


def test_the_table_has_a_row_per_fault_kind_and_a_line_per_job():
    two = chaos.Fault(chaos.KILL_TWO, ("ps:1", "worker:0"), 4.0)
    plan = chaos.JobPlan(3, "sync", "TF_CONFIG", (two,))
    fired = chaos.Fired(two, at=14.0, detect_s=0.1, recover_s=2.5, steps_lost=12, survived=False)
    job = chaos.JobOutcome(
        plan, [fired], returncode=None, started=10.0, seconds=400, twice=3, never=1, orphans=2, steps_lost=12
    )
    job.why = "did not end by itself; no result"
    report = chaos.Report(seed=5, minutes=2, seconds=420, commit="abc1234", load=[1.5, 2.5], jobs=[job], cores=2)
    text = chaos.render(report)
    assert "| two roles SIGKILLed at once | 1 | 0 of 1 | 12 | 0.10 s | 2.50 s | 3 / 1 |" in text
    assert "seed 5" in text and "abc1234" in text and "load average 1.5 to 2.5" in text
    assert (
        "| 3 | sync | TF_CONFIG | two roles SIGKILLed at once: ps:1 + worker:0 at 4 (NOT survived) "
        "| killed at its deadline | 3 / 1 | 12 | 2 | did not end by itself; no result |"
    ) in text
    assert "0 of 1 ended by themselves" in text


def test_each_tool_rewrites_its_own_block_of_reliability_md_and_leaves_the_other(tmp_path):
    path = tmp_path / "RELIABILITY.md"
    audited_runs.write_block(path, "make faults", "faults, first")
    audited_runs.write_block(path, "make chaos", "chaos, first")
    audited_runs.write_block(path, "make faults", "faults, again")
    text = path.read_text()
    assert text.startswith("# Reliability\n")
    assert "faults, again" in text and "faults, first" not in text and "chaos, first" in text
    assert text.index("make faults: begin") < text.index("make chaos: begin")
    audited_runs.write_block(path, "make faults", "faults, again")
    assert path.read_text() == text


def test_a_stall_nobody_noticed_is_survived_and_the_roles_exit_0_at_the_end_detects_nothing():
    stall = chaos.Fault(chaos.STALL_CHIEF, ("chief",), 5.0, stop_s=6.0)
    plan = chaos.JobPlan(2, "sync", "TF_CONFIG", (stall,))
    outcome = chaos.JobOutcome(plan, [chaos.Fired(stall, at=10.0)], returncode=0, started=0.0, seconds=60)
    outcome.exact = True
    chaos.measure(_lines((50.0, "[supervisor] chief (pid 9) exited with code 0")), outcome, ended_at=60.0)
    assert outcome.fired[0].detect_s is None and outcome.fired[0].survived


def test_a_role_failing_long_after_a_stall_ended_is_not_the_stalls_detection():
    stall = chaos.Fault(chaos.STALL_CHIEF, ("chief",), 5.0, stop_s=6.0)
    plan = chaos.JobPlan(2, "sync", "TF_CONFIG", (stall,))
    outcome = chaos.JobOutcome(plan, [chaos.Fired(stall, at=10.0)], returncode=None, started=0.0, seconds=400)
    chaos.measure(_lines((130.0, "[supervisor] chief (pid 9) exited with code 1; restarting it")), outcome, 400.0)
    assert outcome.fired[0].detect_s is None and not outcome.fired[0].survived
