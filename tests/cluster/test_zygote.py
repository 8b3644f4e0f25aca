"""Roles forked from the zygote by a real LocalLauncher, running small throwaway scripts: each is the process a fresh
`python script.py` would be, and the launcher sees and controls it as before."""

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from shardflow import env
from shardflow.cluster import ClusterSpec, LocalLauncher, RoleExit, TaskSpec
from shardflow.cluster import launcher as launcher_module
from shardflow.cluster.zygote import ZYGOTE_NAME, role_of

THIS_PROCESS_NAME = Path("/proc/self/comm").read_text().strip()

# Seconds a chief that must outlive the other roles' restarts stays up.
CHIEF_S = 3.0

# What a role's process sees of itself, one JSON line.
REPORT_SCRIPT = """\
import os
threads = len(os.listdir("/proc/self/task"))
import json, random, sys
import numpy, torch
print(json.dumps({
    "task": json.loads(os.environ["SHARDFLOW_CLUSTER"])["task"],
    "extra": os.environ.get("EXTRA"),
    "tf_config": os.environ.get("TF_CONFIG"),
    "argv": sys.argv,
    "orig_argv": sys.orig_argv,
    "cwd": os.getcwd(),
    "name": __name__,
    "file": __file__,
    "main_globals": sys.modules["__main__"].__dict__ is globals(),
    "path0": sys.path[0],
    "threads": threads,
    "process_name": open("/proc/self/comm").read().strip(),
    "parent_name": open(f"/proc/{os.getppid()}/comm").read().strip(),
    "random": random.random(),
    "numpy": float(numpy.random.random()),
    "torch_seed": torch.initial_seed(),
}))
"""

# Prints its role, then acts as the per-role table in argv[1] says ({"worker:1": "fail-once"}).
ROLE_SCRIPT = """\
import json, os, signal, subprocess, sys, time
task = json.loads(os.environ["SHARDFLOW_CLUSTER"])["task"]
name = f"{task['type']}:{task['index']}"
parent = open(f"/proc/{os.getppid()}/comm").read().strip()
print(f"hello from {name}, pid {os.getpid()}, parent {parent} {os.getppid()}", flush=True)
action = json.loads(sys.argv[1]).get(name, 0)
if action == "fail-once":
    marker = os.path.join(os.path.dirname(os.path.abspath(__file__)), name + ".failed")
    if not os.path.exists(marker):
        open(marker, "w").close()
        os.kill(os.getpid(), signal.SIGKILL)
elif action == "raise":
    raise ValueError("boom in " + name)
elif action == "grandchild":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    child = subprocess.Popen(["sleep", "60"])
    print(f"grandchild {child.pid}", flush=True)
    time.sleep(60)
elif action == "sleep":
    time.sleep(60)
elif isinstance(action, float):
    time.sleep(action)
sys.exit(action if isinstance(action, int) else 0)
"""


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    """One job of 4 forked roles running REPORT_SCRIPT in its directory: (directory, report by role, output,
    launcher)."""
    workdir = tmp_path_factory.mktemp("workdir")
    (workdir / "report.py").write_text(REPORT_SCRIPT)
    output = io.StringIO()
    spec = ClusterSpec.local(num_workers=2, num_ps=1)
    environment = {"TF_CONFIG": '{"cluster": {}}', "EXTRA": "1"}
    command = [sys.executable, "report.py", "--flag", "value"]
    with contextlib.chdir(workdir):
        launcher = LocalLauncher(spec, command, env=environment, output=output, log_dir=workdir / "logs")
        with launcher:
            launcher.start()
            assert launcher.wait(timeout_s=60) is None
    by_role = {}
    for line in output.getvalue().splitlines():
        prefix, _, text = line.partition(" ")
        by_role[prefix.strip("[]")] = json.loads(text)
    return workdir, by_role, output.getvalue(), launcher


def test_each_forked_role_sees_its_own_task_and_the_launchers_environment(reports):
    _, by_role, _, _ = reports

    assert sorted(by_role) == ["chief", "ps:0", "worker:0", "worker:1"]
    for name, report in by_role.items():
        assert TaskSpec(report["task"]["type"], report["task"]["index"]).name == name
        assert (report["extra"], report["tf_config"]) == ("1", None)


def test_a_forked_role_runs_its_script_as_python_would(reports):
    workdir, by_role, _, _ = reports

    for report in by_role.values():
        assert report["argv"] == ["report.py", "--flag", "value"]
        assert report["orig_argv"] == [sys.executable, "report.py", "--flag", "value"]
        assert report["cwd"] == str(workdir)
        assert report["name"] == "__main__" and report["main_globals"]
        assert report["file"] == str(workdir / "report.py")
        assert report["path0"] == os.path.realpath(workdir)


def test_a_role_is_forked_from_a_zygote_with_one_thread_and_named_after_its_task(reports):
    _, by_role, _, _ = reports

    for name, report in by_role.items():
        assert report["parent_name"] == ZYGOTE_NAME
        assert report["process_name"] == f"sf:{name}"
        assert report["threads"] == 1


def test_sibling_roles_do_not_share_random_states(reports):
    _, by_role, _, _ = reports

    for generator in ("random", "numpy", "torch_seed"):
        values = [report[generator] for report in by_role.values()]
        assert len(set(values)) == len(values), generator


def test_forked_roles_output_is_prefixed_and_kept_per_role(reports):
    workdir, by_role, output, launcher = reports

    assert sum(line.startswith("[worker:1] {") for line in output.splitlines()) == 1
    log = (workdir / "logs" / "worker_1.log").read_text()
    assert json.loads(log) == by_role["worker:1"]
    assert sorted(launcher.pids) == sorted(by_role)


def test_a_module_runs_as_main_with_dash_m(tmp_path, monkeypatch):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "job.py").write_text(
        "import json, os, sys\n"
        "print(json.dumps([__name__, __spec__.name, sys.argv[1:], sys.path[0], open('/proc/self/comm').read()]))\n"
    )
    monkeypatch.chdir(tmp_path)
    output = io.StringIO()
    spec = ClusterSpec.local(num_workers=1, num_ps=0)
    with LocalLauncher(spec, [sys.executable, "-m", "pkg.job", "x"], output=output) as launcher:
        launcher.start()
        assert launcher.wait(timeout_s=60) is None

    line = next(line for line in output.getvalue().splitlines() if line.startswith("[worker:0] "))
    assert json.loads(line.removeprefix("[worker:0] ")) == [
        "__main__",
        "pkg.job",
        ["x"],
        str(tmp_path),
        "sf:worker:0\n",
    ]


def test_a_sigkilled_role_exits_minus_9_and_its_restart_is_forked_again(role_command):
    output = io.StringIO()
    spec = ClusterSpec.local(num_workers=2, num_ps=0)
    # The chief outlives the restart: once a chief has exited 0 the job is over and nothing is restarted.
    actions = {"worker:1": "fail-once", "chief:0": CHIEF_S}
    launcher = LocalLauncher(spec, role_command(actions), output=output, max_restarts=1, restart_backoff_s=0.1)
    with launcher:
        launcher.start()
        first = launcher.pids["worker:1"]
        assert launcher.wait(timeout_s=60) is None

    assert [(death.task.name, death.pid, death.returncode) for death in launcher.restarts] == [("worker:1", first, -9)]
    again = launcher.pids["worker:1"]
    assert again != first
    text = output.getvalue()
    assert f"[worker:1] hello from worker:1, pid {first}, parent {ZYGOTE_NAME} " in text
    assert f"[worker:1] hello from worker:1, pid {again}, parent {ZYGOTE_NAME} " in text
    assert f"worker:1 (pid {first}) exited with code -9 (SIGKILL); restarting it" in text


def test_an_uncaught_error_exits_1_with_the_scripts_own_traceback(role_command):
    output = io.StringIO()
    spec = ClusterSpec.local(num_workers=1, num_ps=0)
    command = role_command({"worker:0": "raise"})
    with LocalLauncher(spec, command, skip=[TaskSpec("chief", 0)], output=output) as launcher:
        launcher.start()
        failure = launcher.wait(timeout_s=60)
        assert failure == RoleExit(TaskSpec("worker", 0), launcher.pids["worker:0"], 1)

    line = ROLE_SCRIPT.splitlines().index('    raise ValueError("boom in " + name)') + 1
    assert output.getvalue().splitlines()[1:] == [
        "[worker:0] Traceback (most recent call last):",
        f'[worker:0]   File "{command[1]}", line {line}, in <module>',
        '[worker:0]     raise ValueError("boom in " + name)',
        "[worker:0] ValueError: boom in worker:0",
    ]


# Exits with the code in argv[1] while a thread it started is still running, an exit handler and a finalizer due.
EXIT_SCRIPT = """\
import atexit, json, sys, threading, time, weakref
atexit.register(print, "exit handler ran", flush=True)
class Kept:
    pass
kept = Kept()
weakref.finalize(kept, print, "finalizer ran", flush=True)  # run at exit, though torch's own are not
def finish():
    time.sleep(0.3)
    print("thread finished", flush=True)
threading.Thread(target=finish).start()
sys.exit(json.loads(sys.argv[1]))
"""


@pytest.mark.parametrize(("code", "returncode"), [(None, 0), (3, 3), ("bad input", 1)])
def test_a_forked_role_ends_as_python_would_after_its_threads_and_exit_handlers(tmp_path, code, returncode):
    script = tmp_path / "exit.py"
    script.write_text(EXIT_SCRIPT)
    output = io.StringIO()
    spec = ClusterSpec.local(num_workers=1, num_ps=0)
    command = [sys.executable, str(script), json.dumps(code)]
    with LocalLauncher(spec, command, skip=[TaskSpec("chief", 0)], output=output) as launcher:
        launcher.start()
        failure = launcher.wait(timeout_s=60)

    expected = None if returncode == 0 else RoleExit(TaskSpec("worker", 0), launcher.pids["worker:0"], returncode)
    assert failure == expected
    message = [f"[worker:0] {code}"] if isinstance(code, str) else []
    assert output.getvalue().splitlines() == [
        *message,
        "[worker:0] thread finished",
        "[worker:0] exit handler ran",
        "[worker:0] finalizer ran",
    ]


# Leaves cyclic garbage with a finalizer, and a handler that runs after the exit's collection.
FINALIZING_SCRIPT = """\
import atexit, gc
from shardflow.cluster.zygote import exit_without_final_collection
gc.disable()
class Cycle:
    def __del__(self):
        print("garbage finalized", flush=True)
cycle = Cycle()
cycle.itself = cycle
del cycle
atexit.register(lambda: print("frozen", gc.get_freeze_count() > 0, flush=True))
exit_without_final_collection()
exit_without_final_collection()
"""


def test_a_process_that_exits_without_the_final_collection_still_finalizes_its_garbage_once(tmp_path):
    script = tmp_path / "finalizing.py"
    script.write_text(FINALIZING_SCRIPT)

    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)

    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout.splitlines() == ["garbage finalized", "frozen True"]


def test_stop_ends_each_forked_roles_process_group_with_what_it_started(role_command):
    output = io.StringIO()
    spec = ClusterSpec.local(num_workers=1, num_ps=1)
    actions = {"chief:0": "grandchild", "ps:0": "grandchild", "worker:0": "grandchild"}
    launcher = LocalLauncher(spec, role_command(actions), output=output)
    try:
        launcher.start()
        grandchildren = [int(line.split()[-1]) for line in wait_for_lines(output, "grandchild ", 3)]
        roles = {name: psutil.Process(pid) for name, pid in launcher.pids.items()}
        assert {name: role_of(process) for name, process in roles.items()} == {name: name for name in roles}
        for pid in grandchildren:
            assert role_of(psutil.Process(pid)) is None
        for process in roles.values():  # each role leads its own group and session
            assert os.getpgid(process.pid) == os.getsid(process.pid) == process.pid
        launcher.stop(grace_s=0.5)
    finally:
        launcher.stop()
    assert_gone([*launcher.pids.values(), *grandchildren])


def test_a_killed_zygote_takes_its_roles_with_it(role_command):
    output = io.StringIO()
    spec = ClusterSpec.local(num_workers=2, num_ps=1)
    actions = {"chief:0": "sleep", "ps:0": "sleep", "worker:0": "sleep", "worker:1": "sleep"}
    with LocalLauncher(spec, role_command(actions), output=output) as launcher:
        launcher.start()
        wait_for_lines(output, "hello from ", 4)
        [zygote] = [child for child in psutil.Process().children() if child.name() == ZYGOTE_NAME]
        roles = list(launcher.pids.values())
        assert all(psutil.Process(pid).ppid() == zygote.pid for pid in roles)

        zygote.kill()

        failure = launcher.wait(timeout_s=30)
        assert failure is not None and failure.returncode == -signal.SIGKILL
        assert_gone(roles)
    assert f"[launcher] the zygote (pid {zygote.pid}) exited with code -9; its roles died with it" in output.getvalue()


def test_a_stopped_zygote_does_not_hold_stop_forever(role_command, monkeypatch):
    # SIGSTOPped, the zygote can neither reap its SIGKILLed roles nor report their exits: stop() waits a deadline for
    # them, names them, and closing the zygote ends it and them.
    monkeypatch.setattr(launcher_module, "KILLED_EXIT_TIMEOUT_S", 2.0)
    output = io.StringIO()
    spec = ClusterSpec.local(num_workers=1, num_ps=1)
    actions = {"chief:0": "sleep", "ps:0": "sleep", "worker:0": "sleep"}
    launcher = LocalLauncher(spec, role_command(actions), output=output)
    launcher.start()
    wait_for_lines(output, "hello from ", 3)
    [zygote] = [child for child in psutil.Process().children() if child.name() == ZYGOTE_NAME]
    roles = list(launcher.pids.values())
    zygote.suspend()

    stopping = threading.Thread(target=launcher.stop, kwargs={"grace_s": 0.5}, daemon=True)
    stopping.start()
    stopping.join(timeout=60)

    assert not stopping.is_alive(), "stop() is still waiting for exits a stopped zygote cannot report"
    assert "no exit heard from chief, ps:0, worker:0 2 s after SIGKILL; going on" in output.getvalue()
    assert_gone([*roles, zygote.pid])


@pytest.mark.parametrize("how", ["SHARDFLOW_ZYGOTE=off", "an interpreter option"])
def test_roles_start_as_fresh_processes_when_the_zygote_is_off_or_cannot_run_the_command(
    how, role_command, monkeypatch
):
    command = role_command()
    if how == "SHARDFLOW_ZYGOTE=off":
        monkeypatch.setenv(env.ZYGOTE, "off")
    else:
        command.insert(1, "-u")
    output = io.StringIO()
    with LocalLauncher(ClusterSpec.local(num_workers=1, num_ps=0), command, output=output) as launcher:
        launcher.start()
        assert launcher.wait(timeout_s=30) is None

    assert f"pid {launcher.pids['worker:0']}, parent {THIS_PROCESS_NAME} {os.getpid()}\n" in output.getvalue()


def test_a_zygote_that_fails_to_import_falls_back_to_fresh_processes_with_one_warning(tmp_path, role_command):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "numpy.py").write_text("raise ImportError('numpy is broken here')\n")
    output = io.StringIO()
    spec = ClusterSpec.local(num_workers=2, num_ps=0)
    launcher = LocalLauncher(spec, role_command(), env={"PYTHONPATH": str(broken)}, output=output)
    with launcher:
        launcher.start()
        assert launcher.wait(timeout_s=30) is None

    text = output.getvalue()
    assert text.count("[launcher] the zygote (pid ") == 1
    assert "exited with code 1 before its imports were done (see its stderr); every role starts as a fresh" in text
    assert text.count(f"parent {THIS_PROCESS_NAME} {os.getpid()}\n") == 3


def test_an_unknown_zygote_setting_is_refused_naming_the_variable(role_command, monkeypatch):
    monkeypatch.setenv(env.ZYGOTE, "maybe")
    launcher = LocalLauncher(ClusterSpec.local(num_workers=1, num_ps=0), role_command(), output=io.StringIO())

    with pytest.raises(ValueError, match=r"SHARDFLOW_ZYGOTE='maybe': use on \(the default\) or off"):
        launcher.start()
    assert launcher.pids == {}


def wait_for_lines(output, marker, count, timeout_s=60):
    """The output lines with `marker`, once there are `count`."""
    deadline = time.monotonic() + timeout_s
    while True:
        lines = [line for line in output.getvalue().splitlines() if marker in line]
        if len(lines) >= count:
            return lines
        assert time.monotonic() < deadline, f"fewer than {count} lines with {marker!r}:\n{output.getvalue()}"
        time.sleep(0.05)


def assert_gone(pids, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    alive = pids
    while alive and time.monotonic() < deadline:
        alive = [pid for pid in pids if is_alive(pid)]
        time.sleep(0.05)
    assert not alive, f"still running: {alive}"


def is_alive(pid):
    # Orphans may stay zombies until init reaps them; a zombie runs nothing.
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
