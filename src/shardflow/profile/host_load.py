"""Whether the cores of a host, not the number of workers, limit a job: the job's processes on each host against
the cores they may run on, and how busy those cores were during the capture."""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc

from shardflow.profile.events import trace_metadata
from shardflow.profile.memory import CPU_CORES, USABLE_CPUS_BUSY
from shardflow.profile.trace import role_sort_key

SATURATED = 0.8
"""The share of a host's usable cores kept busy from which more processes there only share the same cores."""


@dataclass(frozen=True)
class HostLoad:
    host: str
    roles: list[str]
    """The job's processes on the host."""
    usable_cores: int
    """The CPUs those processes may run on, all of their affinities together."""
    busy_cores: float
    """Cores the job's processes kept busy together, on average over the capture."""
    usable_busy_cores: float | None
    """Of the usable cores, how many were busy with any process (other jobs too); None where not measured."""

    @property
    def saturated(self) -> bool:
        """The usable cores are busy, with the job or with other processes as well."""
        busy = max(self.busy_cores, self.usable_busy_cores or 0.0)
        return busy >= SATURATED * self.usable_cores

    def describe(self) -> str:
        others = (
            f" ({self.usable_busy_cores:.2f} with other processes)"
            if self.usable_busy_cores is not None and self.usable_busy_cores > self.busy_cores + 0.05
            else ""
        )
        return (
            f"the {len(self.roles)} processes of this job on {self.host} share {self.usable_cores} "
            f"core{'s' if self.usable_cores != 1 else ''} and keep {self.busy_cores:.2f} busy{others}"
        )


def host_loads(table: pa.Table) -> list[HostLoad]:
    """One per host named in the capture's roles; empty for a capture that did not record where roles ran. Busy
    cores are each role's mean over its own counters, which cover about the same time: the capture's window."""
    roles = trace_metadata(table).get("roles", {})
    mean = {name: _mean_per_role(table, name) for name in (CPU_CORES, USABLE_CPUS_BUSY)}
    by_host: dict[str, list[str]] = {}
    for role, info in roles.items():
        if "host" in info and "cpus" in info:
            by_host.setdefault(info["host"], []).append(role)
    loads = []
    for host, names in sorted(by_host.items()):
        names.sort(key=role_sort_key)
        usable_busy = [mean[USABLE_CPUS_BUSY][role] for role in names if role in mean[USABLE_CPUS_BUSY]]
        loads.append(
            HostLoad(
                host=host,
                roles=names,
                usable_cores=len({cpu for role in names for cpu in roles[role]["cpus"]}),
                busy_cores=sum(mean[CPU_CORES].get(role, 0.0) for role in names),
                usable_busy_cores=max(usable_busy) if usable_busy else None,
            )
        )
    return loads


def _mean_per_role(table: pa.Table, counter: str) -> dict[str, float]:
    samples = table.filter(pc.and_(pc.equal(table["ph"], "C"), pc.equal(table["name"], counter)))
    grouped = samples.group_by("role").aggregate([("value", "mean")])
    return dict(zip(grouped["role"].to_pylist(), grouped["value_mean"].to_pylist(), strict=True))
