"""regression.py with one role's wall clock running ahead, to check that clock alignment finds the skew.

The config's "clock_skew" names the role and by how much its clock runs ahead: {"role": "worker:1", "us": 250000}.
Every role runs this script; in the named one, `time.time_ns` (the clock the recorder and the clock pings read) is
shifted before shardflow starts.
"""

import json
import os
import runpy
import sys
import time
from pathlib import Path

with open(sys.argv[1]) as f:
    skew = json.load(f)["clock_skew"]
task = json.loads(os.environ.get("SHARDFLOW_CLUSTER", "{}")).get("task", {})
role = task["type"] if task.get("type") in ("chief", "evaluator") else f"{task.get('type')}:{task.get('index')}"
if role == skew["role"]:
    true_time_ns = time.time_ns
    skew_ns = round(skew["us"] * 1000)
    time.time_ns = lambda: true_time_ns() + skew_ns

runpy.run_path(str(Path(__file__).with_name("regression.py")), run_name="__main__")
