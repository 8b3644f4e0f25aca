"""Network namespaces that act as separate hosts in one test: a switch (a bridge) in the first namespace and a veth
pair from it to each other one, on a private subnet that exists only inside the namespaces."""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

SUBNET = "10.199.0"
"""The hosts' /24; it lives only inside the namespaces, so it cannot clash with the machine's own networks."""

_SWITCH = "switch"
_NIC = "eth0"
_networks = itertools.count()


def unavailable() -> str | None:
    """Why this machine cannot make network namespaces, or None when it can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "network namespaces need iproute2 (`ip`)"
    return None


@dataclass(frozen=True)
class Host:
    """One namespace acting as a host, with an address of its own on the subnet."""

    name: str
    namespace: str
    address: str

    def command(self, argv: Sequence[str]) -> list[str]:
        """`argv` run inside this host's namespace."""
        return ["ip", "netns", "exec", self.namespace, *argv]


class Network:
    """Hosts on one switch; the first host holds the switch, and each other host's cable plugs into a port of it."""

    def __init__(self, hosts: Sequence[Host]) -> None:
        self.hosts = {host.name: host for host in hosts}
        self._switch_host = hosts[0]

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    def unplug(self, name: str) -> None:
        """Cut `name`'s cable: its switch port goes down, and packets either way are lost until `plug`."""
        _ip("-n", self._switch_host.namespace, "link", "set", _port(name), "down")

    def plug(self, name: str) -> None:
        _ip("-n", self._switch_host.namespace, "link", "set", _port(name), "up")


@contextmanager
def network(names: Sequence[str]) -> Iterator[Network]:
    """Hosts `names` (the first holds the switch) at SUBNET.1, .2, ...; every namespace is removed on exit, with its
    interfaces and the veth pairs into it, even when the setup or the test failed. Kill the processes started in the
    namespaces first: a namespace with a process in it outlives its name."""
    prefix = f"sf{os.getpid()}n{next(_networks)}"
    hosts = [Host(name, f"{prefix}{name}", f"{SUBNET}.{i + 1}") for i, name in enumerate(names)]
    created: list[str] = []
    try:
        for host in hosts:
            _ip("netns", "add", host.namespace)
            created.append(host.namespace)
            _ip("-n", host.namespace, "link", "set", "lo", "up")
        _wire(hosts)
        yield Network(hosts)
    finally:
        _delete(created)


def _wire(hosts: Sequence[Host]) -> None:
    switch_ns = hosts[0].namespace
    _ip("-n", switch_ns, "link", "add", _SWITCH, "type", "bridge")
    _ip("-n", switch_ns, "addr", "add", f"{hosts[0].address}/24", "dev", _SWITCH)
    _ip("-n", switch_ns, "link", "set", _SWITCH, "up")
    for host in hosts[1:]:
        port = _port(host.name)
        _ip("-n", switch_ns, "link", "add", port, "type", "veth", "peer", "name", _NIC, "netns", host.namespace)
        _ip("-n", switch_ns, "link", "set", port, "master", _SWITCH)
        _ip("-n", switch_ns, "link", "set", port, "up")
        _ip("-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", _NIC)
        _ip("-n", host.namespace, "link", "set", _NIC, "up")


def _port(name: str) -> str:
    return f"to-{name}"


def _delete(namespaces: Sequence[str]) -> None:
    """Delete every namespace, then say which could not be."""
    failed = []
    for namespace in namespaces:
        done = subprocess.run(["ip", "netns", "delete", namespace], capture_output=True, text=True, check=False)
        if done.returncode != 0:
            failed.append(f"{namespace}: {done.stderr.strip()}")
    if failed:
        raise RuntimeError(f"could not delete network namespaces (remove them with `ip netns delete`): {failed}")


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed: {done.stderr.strip()}")
