"""ClusterSpec from TF_CONFIG, torchrun and free local ports, and errors that say what to fix."""

import json
import socket
from typing import Any, cast

import pytest
import zmq

from shardflow.cluster.spec import (
    DYNAMIC,
    ClusterSpec,
    ClusterSpecError,
    TaskSpec,
    cluster_from_env,
    host_of,
    release_local_ports,
)

TF_CONFIG = {
    "cluster": {
        "chief": ["host0:2222"],
        "worker": ["host1:2222", "host2:2222"],
        "ps": ["host3:2222", "host4:2222"],
    },
    "task": {"type": "worker", "index": 1},
}


def test_tf_config_gives_roles_and_task():
    spec, task = ClusterSpec.from_tf_config(json.dumps(TF_CONFIG))

    assert task == TaskSpec("worker", 1)
    assert (spec.num("chief"), spec.num("worker"), spec.num("ps"), spec.num("evaluator")) == (
        1,
        2,
        2,
        0,
    )
    assert spec.address(task) == "host2:2222"
    assert spec.address(TaskSpec("ps", 0)) == "host3:2222"


def test_tasks_are_listed_chief_then_ps_then_workers():
    spec, _ = ClusterSpec.from_tf_config(TF_CONFIG)

    assert [task.name for task in spec.tasks()] == ["chief", "ps:0", "ps:1", "worker:0", "worker:1"]


def test_tf_config_accepts_master_as_the_chief():
    config: dict[str, Any] = {"cluster": {"master": ["host0:2222"], "worker": ["host1:2222"]}}
    config["task"] = {"type": "master", "index": 0}

    spec, task = ClusterSpec.from_tf_config(config)

    assert task == TaskSpec("chief", 0)
    assert spec.address(task) == "host0:2222"


def test_evaluator_named_only_in_task_gets_a_dynamic_address():
    config = {**TF_CONFIG, "task": {"type": "evaluator", "index": 0}}

    spec, task = ClusterSpec.from_tf_config(config)

    assert task.name == "evaluator"
    assert spec.address(task) == DYNAMIC
    assert spec.tasks()[-1] == task


def test_to_json_round_trips_through_tf_config():
    spec, _ = ClusterSpec.from_tf_config(TF_CONFIG)

    for task in spec.tasks():
        assert ClusterSpec.from_tf_config(spec.to_json(task)) == (spec, task)


def test_task_names_show_single_roles_without_index():
    assert [TaskSpec(t, i).name for t, i in [("chief", 0), ("evaluator", 0), ("ps", 1)]] == [
        "chief",
        "evaluator",
        "ps:1",
    ]


def test_missing_chief_is_named():
    with pytest.raises(ClusterSpecError, match="the cluster has no 'chief'"):
        ClusterSpec({"worker": ("h:1",)})


def test_second_chief_is_rejected():
    with pytest.raises(ClusterSpecError, match=r"2 chief addresses .* keep exactly one chief"):
        ClusterSpec({"chief": ("h:1", "h:2")})


def test_duplicate_address_names_both_tasks():
    with pytest.raises(ClusterSpecError, match=r"'h:2' is used by both worker:1 and ps:0"):
        ClusterSpec({"chief": ("h:1",), "worker": ("h:3", "h:2"), "ps": ("h:2",)})


def test_dynamic_addresses_may_repeat():
    spec = ClusterSpec({"chief": ("h:1",), "worker": (DYNAMIC, DYNAMIC)})

    assert spec.num("worker") == 2


def test_unknown_role_is_named_with_the_valid_ones():
    with pytest.raises(ClusterSpecError, match="unknown role 'trainer': valid roles are chief, "):
        ClusterSpec({"chief": ("h:1",), "trainer": ("h:2",)})


@pytest.mark.parametrize("address", ["host", "host:", ":2222", "host:port", "host:70000"])
def test_malformed_address_is_named_with_its_task(address):
    with pytest.raises(ClusterSpecError, match=rf"address '{address}' of worker:0 is not host:port"):
        ClusterSpec({"chief": ("h:1",), "worker": (address,)})


def test_addresses_must_be_a_list():
    with pytest.raises(ClusterSpecError, match="role 'chief' must list its addresses"):
        ClusterSpec(cast(Any, {"chief": "h:1"}))  # deliberately not a list: the check under test is at run time


def test_index_out_of_range_says_how_many_there_are():
    spec, _ = ClusterSpec.from_tf_config(TF_CONFIG)

    with pytest.raises(ClusterSpecError, match="task worker:5 is out of range: the cluster has 2 workers"):
        spec.address(TaskSpec("worker", 5))


def test_task_of_tf_config_out_of_range_names_the_source():
    config = {**TF_CONFIG, "task": {"type": "ps", "index": 2}}

    with pytest.raises(ClusterSpecError, match=r"^TF_CONFIG: task ps:2 is out of range: .* 2 ps"):
        ClusterSpec.from_tf_config(config)


def test_unknown_task_type_is_rejected():
    with pytest.raises(ClusterSpecError, match="TF_CONFIG: unknown role 'trainer'"):
        ClusterSpec.from_tf_config({**TF_CONFIG, "task": {"type": "trainer", "index": 0}})


def test_malformed_json_names_the_variable():
    with pytest.raises(ClusterSpecError, match=r"^SHARDFLOW_CLUSTER is not valid JSON"):
        cluster_from_env({"SHARDFLOW_CLUSTER": "{'cluster': "})


def test_tf_config_without_task_says_what_to_add():
    with pytest.raises(ClusterSpecError, match='TF_CONFIG has no "task"'):
        ClusterSpec.from_tf_config({"cluster": TF_CONFIG["cluster"]})


TORCHRUN = {"WORLD_SIZE": "5", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}


@pytest.mark.parametrize(
    ("rank", "expected"),
    [
        ("0", TaskSpec("chief", 0)),
        ("1", TaskSpec("ps", 0)),
        ("2", TaskSpec("ps", 1)),
        ("3", TaskSpec("worker", 0)),
        ("4", TaskSpec("worker", 1)),
    ],
)
def test_torchrun_ranks_map_to_chief_then_ps_then_workers(rank, expected):
    # The chief's control service takes MASTER_PORT + 1: torchrun's own store holds MASTER_PORT.
    spec, task = ClusterSpec.from_torchrun({**TORCHRUN, "RANK": rank}, num_ps=2)

    assert task == expected
    assert spec.roles == {
        "chief": ("10.0.0.1:29501",),
        "worker": (DYNAMIC, DYNAMIC),
        "ps": (DYNAMIC, DYNAMIC),
    }


def test_torchrun_world_too_small_for_num_ps():
    with pytest.raises(ClusterSpecError, match="need at least one chief, 4 PS and one worker"):
        ClusterSpec.from_torchrun({**TORCHRUN, "RANK": "0"}, num_ps=4)


def test_torchrun_missing_variables_are_named():
    with pytest.raises(ClusterSpecError, match="lacks MASTER_ADDR, MASTER_PORT"):
        ClusterSpec.from_torchrun({"RANK": "0", "WORLD_SIZE": "3"}, num_ps=1)


def test_cluster_from_env_is_none_without_a_cluster():
    assert cluster_from_env({"PATH": "/bin", "TF_CONFIG": ""}) is None


def test_cluster_from_env_prefers_shardflow_cluster_then_tf_config_then_torchrun():
    local = ClusterSpec.local(num_workers=1, num_ps=1)
    shardflow_cluster = local.to_json(TaskSpec("ps", 0))
    environ = {"TF_CONFIG": json.dumps(TF_CONFIG), "RANK": "0", **TORCHRUN}

    assert cluster_from_env({**environ, "SHARDFLOW_CLUSTER": shardflow_cluster}) == (
        local,
        TaskSpec("ps", 0),
    )
    from_tf_config = cluster_from_env(environ)
    assert from_tf_config is not None and from_tf_config[1] == TaskSpec("worker", 1)
    del environ["TF_CONFIG"]
    from_torchrun = cluster_from_env(environ, num_ps=2)
    assert from_torchrun is not None and from_torchrun[1] == TaskSpec("chief", 0)


def test_cluster_from_env_reads_num_ps_for_torchrun():
    environ = {**TORCHRUN, "RANK": "4", "SHARDFLOW_NUM_PS": "3"}

    found = cluster_from_env(environ)

    assert found is not None
    spec, task = found
    assert (spec.num("ps"), task) == (3, TaskSpec("worker", 0))


def test_cluster_from_env_under_torchrun_needs_num_ps():
    with pytest.raises(ClusterSpecError, match="pass num_ps or set SHARDFLOW_NUM_PS"):
        cluster_from_env({**TORCHRUN, "RANK": "1"})


def test_local_gives_every_task_a_distinct_port_its_role_can_listen_on():
    spec = ClusterSpec.local(num_workers=4, num_ps=2, evaluator=True)

    addresses = [spec.address(task) for task in spec.tasks()]
    assert len(addresses) == len(set(addresses)) == 8
    try:
        for address in addresses:
            host, _, port = address.rpartition(":")
            with socket.socket() as sock:  # as a role's ZeroMQ socket does
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind((host, int(port)))
                sock.listen()
    finally:
        release_local_ports(spec)


def test_host_of_an_address_with_or_without_a_scheme_and_an_ipv6_host_without_brackets():
    assert host_of("10.0.0.2:2222") == "10.0.0.2"
    assert host_of("tcp://host1:2222") == "host1"
    assert host_of("[::1]:2222") == "::1"
    assert host_of("tcp://[fe80::2]:2222") == "fe80::2"
    assert host_of(DYNAMIC) == ""


def test_a_local_clusters_ports_are_held_for_its_roles_sockets_and_refused_to_other_binds_until_released():
    spec = ClusterSpec.local(num_workers=1, num_ps=2)
    addresses = [spec.address(TaskSpec("ps", index)) for index in range(2)]
    ports = {int(address.rpartition(":")[2]) for address in addresses}
    try:
        for port in ports:
            with socket.socket() as other, pytest.raises(OSError):
                other.bind(("127.0.0.1", port))
        others = [socket.socket() for _ in range(2000)]
        try:
            for other in others:
                other.bind(("127.0.0.1", 0))
            assert not ports & {other.getsockname()[1] for other in others}
        finally:
            for other in others:
                other.close()
        for _ in range(2):  # a PS's ZeroMQ socket binds its held port, and again after a restart
            context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
            server = context.socket(zmq.ROUTER)
            server.linger = 0
            server.bind(f"tcp://{addresses[0]}")
            server.close()
            context.term()  # the listener is closed when term returns (close alone lets ZeroMQ's thread do it)
    finally:
        release_local_ports(spec)
    for port in ports:
        with socket.socket() as other:
            other.bind(("127.0.0.1", port))
