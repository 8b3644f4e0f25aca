"""`shardflow launch` as users run it: a real launcher process, its roles, what is left after."""

import contextlib
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from shardflow.cli.main import main
from shardflow.cluster.zygote import role_of

# Every role starts a grandchild (in the role's process group), then sleeps: none ends by itself.
SLEEPER = """\
import subprocess, time
subprocess.Popen(["sleep", "60"])
time.sleep(60)
"""


@pytest.fixture
def processes():
    """Every process a test registers here is SIGKILLed at teardown, even when the test failed."""
    tracked: list[psutil.Process] = []
    yield tracked
    for process in tracked:
        with contextlib.suppress(psutil.Error):
            process.kill()


def launch(tmp_path, processes, *args):
    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPER)
    launcher = subprocess.Popen(
        [sys.executable, "-m", "shardflow", "launch", *args, str(script)],
        stdout=subprocess.DEVNULL,
        stderr=(tmp_path / "stderr.txt").open("w"),
        start_new_session=True,
    )
    processes.append(psutil.Process(launcher.pid))
    return launcher


def wait_for_roles(launcher, processes, num_roles):
    """Role name -> its process, once every role is running with its grandchild."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        assert launcher.poll() is None, "the launcher exited before its roles were up"
        with contextlib.suppress(psutil.Error):
            descendants = psutil.Process(launcher.pid).children(recursive=True)
            roles = {name: process for process in descendants if (name := role_of(process)) is not None}
            grandchildren = [role.children() for role in roles.values()]
            if len(roles) == num_roles and all(grandchildren):
                processes.extend(descendants)
                for group in grandchildren:
                    processes.extend(group)
                return roles
        time.sleep(0.1)
    raise AssertionError(f"{num_roles} roles did not come up within 30 s")


def assert_all_gone(processes, timeout_s=5.0):
    deadline = time.monotonic() + timeout_s
    alive = processes
    while alive and time.monotonic() < deadline:
        alive = [process for process in processes if is_alive(process)]
        time.sleep(0.05)
    assert not alive, f"still running: {alive}"


def is_alive(process):
    # Orphans may stay zombies until reaped by init; a zombie runs nothing.
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_killed_worker_without_restarts_stops_the_job_and_leaves_no_process_behind(tmp_path, processes):
    launcher = launch(tmp_path, processes, "--max-restarts", "0", "--workers", "2", "--ps", "1")
    roles = wait_for_roles(launcher, processes, num_roles=4)

    roles["worker:1"].kill()

    assert launcher.wait(timeout=10) == 1
    stderr = (tmp_path / "stderr.txt").read_text()
    pid = roles["worker:1"].pid
    assert f"worker:1 (pid {pid}) exited with code -9 (SIGKILL); stopping the other roles" in stderr
    assert_all_gone(processes)


def test_sigkilled_launcher_takes_its_roles_with_it(tmp_path, processes):
    launcher = launch(tmp_path, processes, "--workers", "2", "--ps", "1")
    roles = wait_for_roles(launcher, processes, num_roles=4)

    launcher.kill()
    launcher.wait()

    # The parent-death signal reaches the roles; their grandchildren are the roles' to end.
    assert_all_gone(list(roles.values()))


def test_sigint_to_the_launcher_stops_every_role_and_exits_130(tmp_path, processes):
    launcher = launch(tmp_path, processes, "--workers", "1", "--ps", "1", "--evaluator")
    wait_for_roles(launcher, processes, num_roles=4)

    launcher.send_signal(signal.SIGINT)

    assert launcher.wait(timeout=30) == 130  # within the roles' grace; a loaded machine takes longer
    assert "shardflow launch: interrupted; stopping all roles" in (tmp_path / "stderr.txt").read_text()
    assert_all_gone(processes)


def test_script_arguments_pass_through_untouched(tmp_path, capfd):
    script = tmp_path / "args.py"
    script.write_text("import sys; print(sys.argv[1:])")

    code = main(["launch", "--workers", "1", "--ps", "0", str(script), "--workers", "7", "-x"])

    assert code == 0
    lines = capfd.readouterr().out.splitlines()
    assert sorted(lines) == [
        "[chief] ['--workers', '7', '-x']",
        "[worker:0] ['--workers', '7', '-x']",
    ]


def test_missing_script_is_an_error_with_exit_code_2(tmp_path, capsys):
    assert main(["launch", str(tmp_path / "missing.py")]) == 2
    assert "missing.py' does not exist" in capsys.readouterr().err


def test_help_lists_launch(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])

    assert exit_info.value.code == 0
    assert "launch" in capsys.readouterr().out


def test_python_m_shardflow_launch_help_shows_an_example():
    result = subprocess.run(
        [sys.executable, "-m", "shardflow", "launch", "--help"],
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, "COLUMNS": "100"},
    )

    assert result.returncode == 0
    assert "shardflow launch --workers 4 --ps 2 train.py" in result.stdout
