"""The command line starts without the heavy libraries (its subcommands import them when they run), and `dir()` of
the package shows the public API before any of it is imported."""

from __future__ import annotations

import subprocess
import sys

HEAVY = ("torch", "pyarrow", "zmq", "matplotlib", "duckdb")


def imported_after(code: str) -> list[str]:
    """The heavy top-level modules a fresh interpreter has imported after running `code`."""
    probe = f"{code}\nimport sys\nprint(' '.join(sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r}))))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True)
    return done.stdout.split()


def test_the_command_line_entry_imports_no_heavy_library():
    assert imported_after("import shardflow.cli.main") == []


def test_shardflow_help_imports_no_heavy_library():
    code = "import contextlib, io\nfrom shardflow.cli.main import main\n"
    code += "quiet = contextlib.redirect_stdout(io.StringIO())\n"
    for command in (["--help"], ["launch", "--help"], ["profile", "capture", "--help"]):
        code += f"with contextlib.suppress(SystemExit), quiet:\n    main({command!r})\n"
    assert imported_after(code) == []


def test_dir_of_shardflow_lists_the_public_api_before_it_is_imported():
    code = "import shardflow; print(' '.join(dir(shardflow)))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    listed = set(done.stdout.split())
    assert {"Estimator", "ParameterServerStrategy", "TrainSpec", "train_and_evaluate", "nn", "optim"} <= listed
    assert imported_after("import shardflow\ndir(shardflow)") == []


def test_dir_of_shardflow_data_lists_the_example_codec_and_file_sources():
    from shardflow import data

    assert {"parse_example", "FixedLenFeature", "TFRecordDataset", "make_csv_dataset", "Dataset"} <= set(dir(data))


def test_the_local_launcher_that_shardflow_launch_runs_imports_no_torch():
    # Its roles import torch (forked from the zygote, which imports it once); the launcher itself would spend ~1.3 s
    # of CPU on it, beside the zygote's own import, on the cores the job starts on.
    assert "torch" not in imported_after("import shardflow.cluster.local_job, shardflow.cluster.launcher")
