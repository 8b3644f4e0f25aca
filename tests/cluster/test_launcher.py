"""LocalLauncher and run_local with real processes running small throwaway scripts."""

import io
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from shardflow.cluster import ClusterSpec, LocalLauncher, RoleExit, TaskSpec, run_local
from shardflow.cluster.runtime_dir import make_runtime_dir

# Prints its role, then sleeps or exits as the per-role table in argv[1] says ({"worker:1": 3}).
ROLE_SCRIPT = """\
import json, os, signal, sys, time
task = json.loads(os.environ["SHARDFLOW_CLUSTER"])["task"]
name = f"{task['type']}:{task['index']}"
print(f"hello from {name}")
print(f"pid {os.getpid()}", file=sys.stderr)
action = json.loads(sys.argv[1]).get(name, 0)
if action == "ignore-sigterm":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print("ignoring SIGTERM", flush=True)
    time.sleep(60)
elif action in ("sleep", "done-on-sigterm", "preempted-on-sigterm"):
    if action != "sleep":  # a chief whose job had ended when SIGTERM came, or that checkpointed and exits 143
        code = 0 if action == "done-on-sigterm" else 143
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(code))
        print("SIGTERM handled", flush=True)
    time.sleep(60)
elif action == "fail-once":
    marker = os.path.join(os.path.dirname(os.path.abspath(__file__)), name + ".failed")
    if os.path.exists(marker):
        sys.exit(0)
    open(marker, "w").close()
    os.kill(os.getpid(), signal.SIGKILL)
elif isinstance(action, float):  # seconds it runs, beating, then exit 0 (a chief that outlives their restarts)
    for _ in range(int(action * 10)):
        if os.environ.get("SHARDFLOW_LIVENESS_FILE"):
            open(os.environ["SHARDFLOW_LIVENESS_FILE"], "w").close()
        time.sleep(0.1)
    sys.exit(0)
elif isinstance(action, list):  # seconds each run lives before it is SIGKILLed; then exit 0
    runs = os.path.join(os.path.dirname(os.path.abspath(__file__)), name + ".runs")
    count = len(open(runs).read()) if os.path.exists(runs) else 0
    open(runs, "a").write("x")
    if count < len(action):
        time.sleep(action[count])
        os.kill(os.getpid(), signal.SIGKILL)
    sys.exit(0)
elif action in ("hang-once", "stop-at-once"):  # stopped for good, after a beat or before any; its restart exits 0
    marker = os.path.join(os.path.dirname(os.path.abspath(__file__)), name + ".hung")
    if os.path.exists(marker):
        sys.exit(0)
    open(marker, "w").close()
    if action == "hang-once":
        open(os.environ["SHARDFLOW_LIVENESS_FILE"], "w").close()
    os.kill(os.getpid(), signal.SIGSTOP)
sys.exit(action)
"""


CHIEF_S = 3.0
"""A chief that outlives its workers' restarts: once the chief exited 0 the job is over, and nothing is restarted."""


@pytest.fixture
def spec():
    return ClusterSpec.local(num_workers=2, num_ps=1)


def assert_gone(pids):
    # A reaped or zombie process is gone; psutil also guards against a reused pid.
    for pid in pids:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_output_lines_are_prefixed_with_the_role(spec, role_command):
    output = io.StringIO()
    with LocalLauncher(spec, role_command(), output=output) as launcher:
        launcher.start()
        assert launcher.wait(timeout_s=20) is None

    lines = output.getvalue().splitlines()
    for name, index in [("chief", "chief:0"), ("ps:0", "ps:0"), ("worker:1", "worker:1")]:
        assert f"[{name}] hello from {index}" in lines
    assert sum(line.startswith("[worker:0] pid ") for line in lines) == 1  # stderr merged


def test_each_task_gets_its_own_cluster_json_and_no_tf_config(spec, tmp_path):
    script = tmp_path / "env.py"
    script.write_text(
        "from os import environ\n"
        "print(environ['SHARDFLOW_CLUSTER'], environ.get('TF_CONFIG'), environ['EXTRA'], sep='|')"
    )
    output = io.StringIO()
    environment = {"TF_CONFIG": '{"cluster": {}}', "EXTRA": "1"}
    with LocalLauncher(spec, [sys.executable, str(script)], env=environment, output=output) as launcher:
        launcher.start()
        assert launcher.wait(timeout_s=20) is None

    seen = {}
    for line in output.getvalue().splitlines():
        name, _, rest = line.partition(" ")
        cluster_json, tf_config, extra = rest.split("|")
        assert (tf_config, extra) == ("None", "1")
        seen[name] = ClusterSpec.from_tf_config(cluster_json)
    assert seen == {f"[{task.name}]": (spec, task) for task in spec.tasks()}


def test_a_launcher_removes_the_runtime_directories_of_launchers_that_are_gone(spec, role_command):
    finished = subprocess.Popen([sys.executable, "-c", "pass"])
    finished.wait()
    stale, live = Path(make_runtime_dir()), Path(make_runtime_dir())
    (stale / "launcher.pid").write_text(str(finished.pid))  # as a SIGKILLed launcher leaves it
    (stale / "ps-0").write_text("")
    with LocalLauncher(spec, role_command(), skip=[TaskSpec("chief", 0)], output=io.StringIO()) as launcher:
        launcher.start()
        assert launcher.wait(timeout_s=30) is None
    assert not stale.exists()
    assert live.exists(), "this process is alive: its directory stays"
    shutil.rmtree(live)


def test_skipped_tasks_are_not_started(spec, role_command):
    with LocalLauncher(spec, role_command(), skip=[TaskSpec("chief", 0)], output=io.StringIO()) as launcher:
        launcher.start()
        assert sorted(launcher.pids) == ["ps:0", "worker:0", "worker:1"]
        assert launcher.wait(timeout_s=20) is None


def test_wait_returns_the_first_failure_without_waiting_for_the_others(spec, role_command):
    actions = {"chief:0": "sleep", "ps:0": "sleep", "worker:0": "sleep", "worker:1": 3}
    with LocalLauncher(spec, role_command(actions), output=io.StringIO()) as launcher:
        launcher.start()
        failure = launcher.wait(timeout_s=20)

        assert failure == RoleExit(TaskSpec("worker", 1), launcher.pids["worker:1"], 3)
        assert all(psutil.pid_exists(pid) for name, pid in launcher.pids.items() if name != "worker:1")


def test_wait_timeout_names_the_tasks_still_running(spec, role_command):
    actions = {"worker:1": "sleep"}
    with LocalLauncher(spec, role_command(actions), output=io.StringIO()) as launcher:
        launcher.start()
        with pytest.raises(TimeoutError, match=r"still running after 1 s: worker:1$"):
            launcher.wait(timeout_s=1)


def test_watch_reports_a_failure_from_another_thread(spec, role_command):
    reported = []
    done = threading.Event()

    def on_failure(role_exit):
        reported.append((role_exit, threading.current_thread() is threading.main_thread()))
        done.set()

    actions = {"chief:0": "sleep", "ps:0": 7}
    with LocalLauncher(spec, role_command(actions), output=io.StringIO()) as launcher:
        launcher.start()
        launcher.watch(on_failure)
        assert done.wait(20)

    [(role_exit, in_main_thread)] = reported
    assert (role_exit.task.name, role_exit.returncode, in_main_thread) == ("ps:0", 7, False)


def test_stop_kills_a_task_that_ignores_sigterm_after_the_grace_period(spec, role_command):
    output = io.StringIO()
    launcher = LocalLauncher(spec, role_command({"ps:0": "ignore-sigterm"}), output=output)
    try:
        launcher.start()
        while "[ps:0] ignoring SIGTERM" not in output.getvalue():
            time.sleep(0.05)
        started = time.monotonic()
        launcher.stop(grace_s=1.0)
        assert time.monotonic() - started < 5
    finally:
        launcher.stop()
    assert_gone(launcher.pids.values())


@pytest.mark.parametrize(("action", "code"), [("done-on-sigterm", 0), ("preempted-on-sigterm", 143)])
def test_preempt_says_how_the_chief_ended(spec, role_command, action, code):
    """So `shardflow launch` exits 0, not 143, when SIGTERM came after the job had ended: nothing to run again."""
    output = io.StringIO()
    launcher = LocalLauncher(spec, role_command({"chief:0": action}), output=output)
    with launcher:
        launcher.start()
        deadline = time.monotonic() + 30
        while "SIGTERM handled" not in output.getvalue():
            assert time.monotonic() < deadline, output.getvalue()
            time.sleep(0.05)
        assert launcher.preempt(grace_s=5.0) == code


def test_start_with_a_missing_program_raises(spec, tmp_path):
    launcher = LocalLauncher(spec, [str(tmp_path / "missing")], output=io.StringIO())

    with pytest.raises(FileNotFoundError):
        launcher.start()
    assert launcher.pids == {}


def test_run_local_returns_zero_when_every_role_exits_zero(spec, role_command, capsys):
    assert run_local(spec, role_command()) == 0
    assert "[worker:1] hello from worker:1" in capsys.readouterr().out


def test_run_local_stops_the_others_when_a_role_exits_with_code_3(spec, role_command, capsys):
    actions = {"chief:0": "sleep", "ps:0": "sleep", "worker:0": "sleep", "worker:1": 3}
    started = time.monotonic()

    assert run_local(spec, role_command(actions)) == 1

    assert time.monotonic() - started < 10
    captured = capsys.readouterr()
    assert "shardflow launch: worker:1 (pid " in captured.err
    assert "exited with code 3; stopping the other roles" in captured.err
    pids = [int(line.rsplit(" ", 1)[1]) for line in captured.out.splitlines() if " pid " in line]
    assert len(pids) == 4
    assert_gone(pids)


def test_role_exit_describes_signal_and_code():
    task = TaskSpec("worker", 1)

    assert RoleExit(task, 1234, -9).describe() == "worker:1 (pid 1234) exited with code -9 (SIGKILL)"
    assert RoleExit(task, 1234, 3).describe() == "worker:1 (pid 1234) exited with code 3"


def test_a_worker_that_dies_is_restarted_after_its_back_off_and_the_job_goes_on(spec, role_command):
    output = io.StringIO()
    actions = {"worker:1": "fail-once", "chief:0": CHIEF_S}
    launcher = LocalLauncher(spec, role_command(actions), output=output, max_restarts=2, restart_backoff_s=0.3)
    with launcher:
        launcher.start()
        first = launcher.pids["worker:1"]
        started = time.monotonic()
        assert launcher.wait(timeout_s=20) is None
        assert time.monotonic() - started >= 0.3
    [death] = launcher.restarts
    assert (death.task.name, death.pid, death.returncode) == ("worker:1", first, -9)
    assert launcher.pids["worker:1"] != first
    text = output.getvalue()
    assert (
        f"[launcher] worker:1 (pid {first}) exited with code -9 (SIGKILL); restarting it in 0.3s (restart 1 of 2)"
        in text
    )
    assert text.count("hello from worker:1") == 2


def test_a_role_that_cannot_hear_the_end_does_not_hold_the_job_open_once_the_chief_ended_it(spec, role_command):
    """Stopped for good (SIGSTOP), worker:1 never exits: once the chief exited 0 the job is over, so the launcher
    waits `after_chief_s` for it, then stops it; it is neither restarted nor a failure."""
    output = io.StringIO()
    actions = {"worker:1": "stop-at-once"}
    launcher = LocalLauncher(
        spec, role_command(actions), output=output, max_restarts=2, restart_backoff_s=0.1, after_chief_s=1.0
    )
    with launcher:
        launcher.start()
        stopped = launcher.pids["worker:1"]
        assert launcher.wait(timeout_s=20) is None
    assert launcher.restarts == []
    assert "stopping worker:1, which did not exit" in output.getvalue(), output.getvalue()
    assert_gone([stopped])


def test_a_worker_that_keeps_dying_fails_once_its_restarts_are_spent(spec, role_command):
    actions = {"chief:0": "sleep", "ps:0": "sleep", "worker:0": "sleep", "worker:1": 5}
    launcher = LocalLauncher(spec, role_command(actions), output=io.StringIO(), max_restarts=2, restart_backoff_s=0.1)
    with launcher:
        launcher.start()
        failure = launcher.wait(timeout_s=20)
        assert failure is not None and (failure.task.name, failure.returncode) == ("worker:1", 5)
        # Backed off 0.1s, then 0.2s: three runs in all.
        assert [d.task.name for d in launcher.restarts] == ["worker:1", "worker:1"]


def test_stop_during_a_back_off_calls_the_restart_off(spec, role_command):
    actions = {"chief:0": "sleep", "ps:0": "sleep", "worker:0": "sleep", "worker:1": 5}
    launcher = LocalLauncher(spec, role_command(actions), output=io.StringIO(), max_restarts=1, restart_backoff_s=30)
    launcher.start()
    deadline = time.monotonic() + 20
    while not launcher.restarts:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    started = time.monotonic()
    launcher.stop()
    assert time.monotonic() - started < 10
    assert_gone(launcher.pids.values())


def test_a_role_that_ran_healthily_starts_its_back_off_over(spec, role_command):
    output = io.StringIO()
    # worker:1 dies at once, then after a healthy run (0.6s >= healthy_run_s), then at once, then exits 0.
    actions = {"worker:1": [0, 0.6, 0], "chief:0": CHIEF_S}
    launcher = LocalLauncher(
        spec, role_command(actions), output=output, max_restarts=3, restart_backoff_s=0.2, healthy_run_s=0.5
    )
    with launcher:
        launcher.start()
        assert launcher.wait(timeout_s=20) is None
    delays = re.findall(r"worker:1 .* restarting it in (\S+)s", output.getvalue())
    # 0.2s, then 0.2s again instead of 0.4s (the run before was healthy), then doubled: 0.4s.
    assert delays == ["0.2", "0.2", "0.4"], output.getvalue()


def test_a_hung_role_is_killed_and_restarted(spec, role_command):
    output = io.StringIO()
    launcher = LocalLauncher(
        spec,
        role_command({"worker:1": "hang-once", "chief:0": CHIEF_S}),
        output=output,
        max_restarts=1,
        restart_backoff_s=0.1,
        hung_timeout_s=0.5,
    )
    with launcher:
        launcher.start()
        first = launcher.pids["worker:1"]
        assert launcher.wait(timeout_s=20) is None
    text = output.getvalue()
    hung = (
        rf"\[launcher\] worker:1 \(pid {first}\) is hung: no heartbeat for [\d.]+s \(hung_timeout_s=0.5\); killing it"
    )
    assert re.search(hung, text), text
    assert f"worker:1 (pid {first}) exited with code -9 (SIGKILL); restarting it in 0.1s" in text
    assert text.count("hello from worker:1") == 2
    # Nothing else was taken for hung: the other roles exited at once.
    assert text.count("is hung") == 1


def test_a_role_stopped_before_it_ever_beat_is_killed_and_restarted(spec, role_command, monkeypatch):
    # A fresh Python per role, which never touches its liveness file: a forked role's touches start as it is forked.
    monkeypatch.setenv("SHARDFLOW_ZYGOTE", "off")
    output = io.StringIO()
    launcher = LocalLauncher(
        spec,
        role_command({"worker:1": "stop-at-once", "chief:0": CHIEF_S}),
        output=output,
        max_restarts=1,
        restart_backoff_s=0.1,
        hung_timeout_s=0.5,
    )
    with launcher:
        launcher.start()
        first = launcher.pids["worker:1"]
        assert launcher.wait(timeout_s=20) is None
    text = output.getvalue()
    assert f"worker:1 (pid {first}) is hung: no heartbeat for" in text, text
    assert f"worker:1 (pid {first}) exited with code -9 (SIGKILL); restarting it in 0.1s" in text
    assert text.count("hello from worker:1") == 2


def test_a_chief_killed_by_a_signal_is_restarted_and_one_that_exits_with_an_error_is_not(spec, role_command):
    output = io.StringIO()
    launcher = LocalLauncher(
        spec, role_command({"chief:0": "fail-once"}), output=output, max_restarts=1, restart_backoff_s=0.1
    )
    with launcher:
        launcher.start()
        first = launcher.pids["chief"]
        assert launcher.wait(timeout_s=20) is None
    assert [(death.task.name, death.returncode) for death in launcher.restarts] == [("chief", -9)]
    assert f"chief (pid {first}) exited with code -9 (SIGKILL); restarting it in 0.1s" in output.getvalue()

    for ended_on_purpose in (4, 143):  # a failed job; a preempted one
        actions = {"chief:0": ended_on_purpose}
        launcher = LocalLauncher(spec, role_command(actions), output=io.StringIO(), max_restarts=2)
        with launcher:
            launcher.start()
            failure = launcher.wait(timeout_s=20)
        assert failure is not None and (failure.task.name, failure.returncode) == ("chief", ended_on_purpose)
        assert launcher.restarts == []
