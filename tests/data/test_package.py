"""shardflow.data stands alone: importing it loads neither torch nor the training runtime."""

from __future__ import annotations

import subprocess
import sys


def test_importing_data_loads_no_torch_and_no_runtime() -> None:
    code = (
        "import sys; from shardflow import data; data.Dataset.range(3).batch(2).prefetch(1).map(lambda x: x); "
        "bad = [m for m in sys.modules if m == 'torch' or m.split('.')[:2] in "
        "(['shardflow', 'ps'], ['shardflow', 'train'], ['shardflow', 'comm'], ['shardflow', 'cluster'])]; "
        "print(bad)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def test_public_names() -> None:
    from shardflow import data

    for name in ("Dataset", "Options", "AUTOTUNE", "AutoShardPolicy", "auto_shard", "TensorSpec", "DataLossError"):
        assert hasattr(data, name)
