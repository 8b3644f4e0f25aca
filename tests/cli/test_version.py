"""`shardflow --version` and `python -m shardflow --version` print the installed version."""

import subprocess
import sys

import pytest

import shardflow
from shardflow.cli.main import main


def test_version_option_prints_the_version_and_exits_0(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out == f"shardflow {shardflow.__version__}\n"


def test_python_dash_m_shardflow_prints_the_version():
    proc = subprocess.run([sys.executable, "-m", "shardflow", "--version"], capture_output=True, text=True, timeout=60)
    assert (proc.returncode, proc.stdout) == (0, f"shardflow {shardflow.__version__}\n")
