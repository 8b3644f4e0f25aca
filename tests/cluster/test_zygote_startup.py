"""How a local cluster's zygote starts early: a script that imports shardflow first has it start on import, its
launcher adopts it, and the zygote imports for the roles what the launcher's process imported. Real processes:
each test runs a small script with this interpreter."""

import io
import json
import os
import socket
import subprocess
import sys
import time

import psutil
import pytest

from shardflow.cluster import ClusterSpec, LocalLauncher, TaskSpec
from shardflow.cluster.zygote import installed_modules

# Imports shardflow first (before torch); it names an Estimator, as every training script does. As the
# launcher it prints the zygote it started on import and the parents of its roles; as a role, its parent.
EARLY_SCRIPT = """\
import shardflow  # what a training script that uses an Estimator imports first
import json, os, sys
if "SHARDFLOW_CLUSTER" in os.environ:
    print(json.dumps({"parent": os.getppid()}), flush=True)
    sys.exit(0)
import io
import psutil
import shardflow
from shardflow.cluster import ClusterSpec, LocalLauncher, TaskSpec
started = [child.pid for child in psutil.Process().children()]
os.environ.update(json.loads(sys.argv[1]))  # what the script changes after importing shardflow
output = io.StringIO()
spec = ClusterSpec.local(num_workers=2, num_ps=0)
with LocalLauncher(spec, [sys.executable, __file__], skip=[TaskSpec("chief", 0)], output=output) as launcher:
    launcher.start()
    assert launcher.wait(timeout_s=60) is None
parents = [json.loads(line.partition(" ")[2])["parent"] for line in output.getvalue().splitlines() if "parent" in line]
print(json.dumps({"started": started, "parents": parents, "alive": [psutil.pid_exists(pid) for pid in started]}))
"""

# Prints how many processes this one started by importing shardflow.
COUNT_SCRIPT = """\
{import_line}
import psutil
print(len(psutil.Process().children()))
# Estimator
"""


def run_script(path, *args, environment=None, timeout_s=120):
    """Runs `python path args...` in its directory (nothing may go to stderr, from it or its zygote); its last line
    of output, parsed as JSON."""
    child_environment = {name: value for name, value in os.environ.items() if not name.startswith("SHARDFLOW_")}
    child_environment.pop("TF_CONFIG", None)
    child_environment.update(environment or {})
    done = subprocess.run(
        [sys.executable, path.name, *args],
        cwd=path.parent,
        env=child_environment,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    assert (done.returncode, done.stderr) == (0, ""), done.stdout
    return json.loads(done.stdout.splitlines()[-1])


@pytest.fixture
def early_script(tmp_path):
    path = tmp_path / "early.py"
    path.write_text(EARLY_SCRIPT)
    return path


def test_a_script_that_imports_shardflow_first_forks_its_roles_from_the_zygote_it_started_on_import(early_script):
    report = run_script(early_script, "{}")

    [zygote] = report["started"]
    assert report["parents"] == [zygote, zygote]


def test_a_change_to_what_torch_reads_on_loading_has_the_launcher_start_a_fresh_zygote(early_script):
    report = run_script(early_script, json.dumps({"OMP_NUM_THREADS": "1"}), environment={"OMP_NUM_THREADS": "2"})

    [early] = report["started"]
    assert report["alive"] == [False]  # stopped, not left behind
    assert len(set(report["parents"])) == 1 and early not in report["parents"]


def test_other_changes_to_the_environment_keep_the_early_zygote(early_script):
    report = run_script(early_script, json.dumps({"SOME_SETTING": "1"}))

    [zygote] = report["started"]
    assert report["parents"] == [zygote, zygote]


@pytest.mark.parametrize(
    "environment",
    [
        {"SHARDFLOW_ZYGOTE": "off"},
        {"SHARDFLOW_CLUSTER": '{"cluster": {"worker": ["localhost:1"]}, "task": {"type": "worker", "index": 0}}'},
        {"TF_CONFIG": '{"cluster": {"worker": ["localhost:1"]}, "task": {"type": "worker", "index": 0}}'},
        {"JOBSET_NAME": "job"},
        {"SLURM_HET_SIZE": "3"},
        {"RANK": "1", "WORLD_SIZE": "3"},
    ],
    ids=lambda environment: next(iter(environment)),
)
def test_importing_shardflow_starts_no_zygote_when_it_is_off_or_this_process_is_a_role_of_a_cluster(
    tmp_path, environment
):
    script = tmp_path / "train.py"
    script.write_text(COUNT_SCRIPT.format(import_line="import shardflow"))

    assert run_script(script, environment=environment) == 0


def test_importing_shardflow_starts_no_zygote_from_a_script_that_makes_no_estimator(tmp_path):
    script = tmp_path / "data_only.py"
    script.write_text(COUNT_SCRIPT.format(import_line="import shardflow").replace("# Estimator\n", ""))

    assert run_script(script) == 0


def test_importing_shardflow_starts_no_zygote_when_a_module_other_than_the_script_imports_it(tmp_path):
    (tmp_path / "helper.py").write_text("import shardflow\n")
    script = tmp_path / "train.py"
    script.write_text(COUNT_SCRIPT.format(import_line="import helper"))

    assert run_script(script) == 0


def test_a_zygote_started_on_import_and_never_adopted_ends_with_its_script(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(
        "import shardflow, json, psutil\n"
        "print(json.dumps([child.pid for child in psutil.Process().children()]))\n"
        "# Estimator\n"
    )

    [zygote] = run_script(script)

    deadline = time.monotonic() + 30
    while is_alive(zygote):
        assert time.monotonic() < deadline, f"the zygote (pid {zygote}) outlived its script"
        time.sleep(0.05)


# What a forked role finds imported before its script imports anything.
PRELOADED_SCRIPT = """\
import sys
print("sched" in sys.modules, flush=True)
"""


@pytest.mark.parametrize("preload", [["sched"], []], ids=["preloaded", "not preloaded"])
def test_a_forked_role_finds_imported_what_the_launcher_had_the_zygote_preload(tmp_path, preload):
    script = tmp_path / "role.py"
    script.write_text(PRELOADED_SCRIPT)
    output = io.StringIO()
    spec = ClusterSpec.local(num_workers=1, num_ps=0)
    command = [sys.executable, str(script)]
    with LocalLauncher(spec, command, skip=[TaskSpec("chief", 0)], output=output, preload=preload) as launcher:
        launcher.start()
        assert launcher.wait(timeout_s=60) is None

    assert output.getvalue() == f"[worker:0] {bool(preload)}\n"


def test_a_preloaded_module_that_starts_a_thread_has_the_roles_start_as_fresh_processes(tmp_path):
    (tmp_path / "starts_a_thread.py").write_text(
        "import threading, time\nthreading.Thread(target=time.sleep, args=(60,), name='sleeper', daemon=True).start()\n"
    )
    script = tmp_path / "role.py"
    script.write_text("import os\nprint('parent', os.getppid(), flush=True)\n")
    output = io.StringIO()
    spec = ClusterSpec.local(num_workers=2, num_ps=0)
    launcher = LocalLauncher(
        spec,
        [sys.executable, str(script)],
        skip=[TaskSpec("chief", 0)],
        env={"PYTHONPATH": str(tmp_path)},
        output=output,
        preload=["starts_a_thread"],
    )
    with launcher:
        launcher.start()
        assert launcher.wait(timeout_s=60) is None

    text = output.getvalue()
    assert text.count("[launcher] ") == 1
    assert "could not start sf:worker:0: an imported module started a thread (sleeper)" in text
    assert text.count(f"parent {os.getpid()}\n") == 2


def test_installed_modules_name_what_this_process_imported_from_installed_packages_not_the_users_own(
    tmp_path, monkeypatch
):
    (tmp_path / "users_own_module.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    import numpy  # noqa: F401  (imported here, not only by whichever test this process ran before)
    import torch  # noqa: F401
    import users_own_module  # noqa: F401

    names = installed_modules()

    assert {"json", "torch", "numpy", "shardflow.cluster.zygote"} <= set(names)
    assert "users_own_module" not in names
    assert "__main__" not in names


def is_alive(pid):
    # An orphan may stay a zombie until init reaps it; a zombie runs nothing.
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_zygote_hung_up_on_during_its_imports_exits_quietly():
    # A script that fails before any role starts (an unwritable model_dir) hangs up on the zygote it started on
    # import while that one still imports torch: no traceback of a broken pipe follows the script's own error.
    from shardflow import _ZYGOTE_ENTRY

    ours, theirs = socket.socketpair()
    with theirs:
        zygote = subprocess.Popen(
            [sys.executable, "-c", _ZYGOTE_ENTRY, str(theirs.fileno()), str(os.getpid())],
            pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
    ours.close()
    _, stderr = zygote.communicate(timeout=60)
    assert (zygote.returncode, stderr) == (0, "")


# Imports torch before shardflow, as most training scripts do, and before that a module of its own; the launcher's
# process runs an OpenMP region, leaves a line unflushed and sets a signal handler before it imports shardflow. Each
# role runs an OpenMP region too (which hangs in a fork of a process whose OpenMP threads were not released) and
# reports what it found.
FORKED_SCRIPT = """\
import json, os, signal, sys
import torch
import own_module  # the script's own: it keeps the pid of the process that imported it
if "SHARDFLOW_CLUSTER" not in os.environ:
    torch.randn(1000, 1000) @ torch.randn(1000, 1000)
    print("before shardflow")
    signal.signal(signal.SIGUSR1, lambda signum, frame: None)
    if sys.argv[1] == "thread":
        import threading, time
        threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
import shardflow
if "SHARDFLOW_CLUSTER" in os.environ:
    torch.randn(1000, 1000) @ torch.randn(1000, 1000)
    import psutil
    print(json.dumps({
        "zygote": psutil.Process(os.getppid()).cmdline(),
        "own_module_imported_here": own_module.PID == os.getpid(),
        "path": sys.path.count(os.path.dirname(os.path.realpath(__file__))),
        "input": sys.stdin.read(),
        "usr1": signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL,
    }), flush=True)
    sys.exit(0)
import io
from shardflow.cluster import ClusterSpec, LocalLauncher, TaskSpec
output = io.StringIO()
spec = ClusterSpec.local(num_workers=2, num_ps=0)
with LocalLauncher(spec, [sys.executable, __file__, sys.argv[1]], skip=[TaskSpec("chief", 0)], output=output) as job:
    job.start()
    assert job.wait(timeout_s=60) is None
print(json.dumps([json.loads(line.partition(" ")[2]) for line in output.getvalue().splitlines()]))
# Estimator
"""


def run_forked_script(tmp_path, how):
    (tmp_path / "own_module.py").write_text("import os\nPID = os.getpid()\n")
    script = tmp_path / "forked.py"
    script.write_text(FORKED_SCRIPT)
    done = subprocess.run(
        [sys.executable, script.name, how],
        cwd=tmp_path,
        env={name: value for name, value in os.environ.items() if not name.startswith("SHARDFLOW_")},
        input="typed at the terminal\n",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (done.returncode, done.stderr) == (0, ""), done.stdout
    lines = done.stdout.splitlines()
    return lines[:-1], json.loads(lines[-1])


def test_a_script_that_imported_torch_forks_its_zygote_which_starts_as_a_fresh_process_would(tmp_path):
    printed, roles = run_forked_script(tmp_path, "plain")

    assert printed == ["before shardflow"]  # once: not again from the zygote or a role
    expected = {"own_module_imported_here": True, "path": 1, "input": "", "usr1": True}
    for role in roles:
        assert role["zygote"] == [sys.executable, "forked.py", "plain"]  # the script's process, forked
        assert {key: role[key] for key in expected} == expected


def test_a_script_with_a_thread_before_it_imports_shardflow_gets_a_fresh_zygote(tmp_path):
    _, roles = run_forked_script(tmp_path, "thread")

    for role in roles:
        assert role["zygote"][1] == "-c"
        assert role["own_module_imported_here"]
