"""Slurm's srun inside a heterogeneous job, for the manifests test, which puts it first on the batch script's PATH.

`srun --het-group=K [--ntasks-per-node=1] [--kill-on-bad-exit=0] COMMAND...` starts one task per node of component
K with the variables a Slurm step gives its tasks (the component's SLURM_JOB_ID, SLURM_PROCID, SLURM_NODEID, ...),
waits for them and exits with the worst status. The test describes the allocation in FAKE_SLURM_LAYOUT (a JSON
list, per component, of its job ID and node names, expanded by the test itself) and maps node names to loopback
addresses in the hosts file FAKE_SLURM_HOSTS: each task sees that file as /etc/hosts and listens on its node's
address, since here every node shares one network namespace.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

_FAKE_VARS = ("FAKE_SLURM_LAYOUT", "FAKE_SLURM_HOSTS")


def on_host(argv: list[str], hosts_file: str) -> list[str]:
    """`argv` in a private mount namespace where `hosts_file` is /etc/hosts, so the test's host names resolve."""
    unshare = ["unshare", "-m"] if os.geteuid() == 0 else ["unshare", "-r", "-m"]
    return [*unshare, "sh", "-c", 'mount --bind "$0" /etc/hosts && exec "$@"', hosts_file, *argv]


def host_addresses(hosts_file: str) -> dict[str, str]:
    """Name -> address of a hosts file."""
    addresses = {}
    for line in Path(hosts_file).read_text().splitlines():
        address, *names = line.split()
        addresses.update(dict.fromkeys(names, address))
    return addresses


def _parse(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    options: dict[str, str] = {}
    while argv and argv[0].startswith("--"):
        name, _, value = argv.pop(0)[2:].partition("=")
        options[name] = value
    if "het-group" not in options or not argv:
        sys.exit(f"fake srun: expected --het-group=K and a command, got {sys.argv[1:]}")
    if options.get("ntasks-per-node", "1") != "1":
        sys.exit("fake srun: only --ntasks-per-node=1 is emulated")
    return options, argv


def task_environment(
    batch: dict[str, str], component: int, job_id: int, nodes: list[str], index: int
) -> dict[str, str]:
    """What task `index` of a step of one component sees: the batch script's environment and the step's variables
    (Slurm's src/common/env.c; a step of one het group gets that component's job ID)."""
    return {
        **batch,
        "SLURM_JOB_ID": str(job_id),
        "SLURM_JOBID": str(job_id),
        "SLURM_STEP_ID": "0",
        "SLURM_PROCID": str(index),
        "SLURM_NODEID": str(index),
        "SLURM_LOCALID": "0",
        "SLURMD_NODENAME": nodes[index],
        "SLURM_STEP_NODELIST": batch[f"SLURM_JOB_NODELIST_HET_GROUP_{component}"],
        "SLURM_STEP_NUM_TASKS": str(len(nodes)),
        "SLURM_STEP_NUM_NODES": str(len(nodes)),
        "SLURM_NTASKS": str(len(nodes)),
        "SLURM_NNODES": str(len(nodes)),
    }


def main(argv: list[str]) -> int:
    options, command = _parse(argv)
    component = int(options["het-group"])
    job_id, nodes = json.loads(os.environ["FAKE_SLURM_LAYOUT"])[component]
    hosts_file = os.environ["FAKE_SLURM_HOSTS"]
    addresses = host_addresses(hosts_file)
    batch = {name: value for name, value in os.environ.items() if name not in _FAKE_VARS}
    tasks = []
    for index, node in enumerate(nodes):
        environ = task_environment(batch, component, job_id, nodes, index)
        environ["SHARDFLOW_BIND_ADDRESS"] = addresses[node]
        tasks.append(subprocess.Popen(on_host(command, hosts_file), env=environ))

    def forward(signum: int, _frame: object) -> None:
        for task in tasks:
            task.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    statuses = [task.wait() for task in tasks]
    # As a shell reports them: a task killed by signal N is 128 + N.
    return next((status if status > 0 else 128 - status for status in statuses if status != 0), 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
