"""The chief's control service: keys, counters, waits with deadlines, only for holders of the job secret,
malformed requests answered, and roles that ride out a restart of the chief."""

import contextlib
import math
import socket
import threading
import time

import msgpack
import msgspec
import pytest
import torch
import zmq

from shardflow.cluster import control
from shardflow.cluster.control_keys import ControlValueError
from shardflow.cluster.control_plane import ControlPlane, ControlPlaneError
from shardflow.comm.client import Client
from shardflow.comm.errors import CommError
from shardflow.comm.security import Credentials, job_credentials, secure_client_socket
from shardflow.ps.placement import place
from shardflow.train import job_keys
from shardflow.train.job_keys import Capture, Handover, ProgressReport, RecoveryNotice

ONE_BYTE = torch.zeros(1, dtype=torch.uint8)


def _free_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture
def plane(monkeypatch):
    monkeypatch.setenv("SHARDFLOW_CLUSTER_SECRET", "control-test")
    address = _free_address()
    chief = ControlPlane.serve(address, timeout_s=5)
    role = ControlPlane(address, timeout_s=5)
    yield chief, role
    role.close()
    chief.close()


def test_keys_counters_and_deletes(plane):
    chief, role = plane
    role.set("ps/0/address", "tcp://127.0.0.1:1234")
    assert chief.endpoint("ps/0", waiting_for="ps:0") == "tcp://127.0.0.1:1234"
    role.set("blob", bytes(range(256)) * 10)
    assert chief.get_bytes("blob", waiting_for="blob") == bytes(range(256)) * 10
    role.set("empty", b"")
    assert chief.get_bytes("empty", waiting_for="empty") == b""
    assert chief.get_if_set("empty") == b"" and chief.get_if_set("never set") is None
    assert [role.add("n", 2), chief.add("n", 5), role.add("n", -1)] == [2, 7, 6]
    assert role.is_set("n") and role.delete("n") and not role.is_set("n") and not role.delete("n")


def test_the_chief_reads_its_own_service_without_a_round_trip_and_sees_every_write(plane):
    chief, role = plane
    role.set("progress/worker:0", "7")
    chief.set("written by the chief", "1")
    before = chief.service.stats["requests"]
    for _ in range(100):  # as the chief's loop reads several keys per worker 20 times a second
        assert chief.get_if_set("progress/worker:0") == b"7" and chief.is_set("written by the chief")
    assert chief.service.stats["requests"] == before
    role.set("progress/worker:0", "8")  # the reply comes once it is stored: the next read sees it
    assert chief.get_if_set("progress/worker:0") == b"8"
    assert role.delete("progress/worker:0") and chief.get_if_set("progress/worker:0") is None


def test_a_wait_is_answered_when_the_key_is_set_and_expires_naming_what_it_waited_for(plane):
    chief, role = plane
    threading.Timer(0.3, chief.set, args=("ready", "1")).start()
    start = time.monotonic()
    role.wait(["ready"], waiting_for="the chief to be ready", timeout_s=5)
    assert time.monotonic() - start < 2
    start = time.monotonic()
    with pytest.raises(ControlPlaneError, match=r"waited 1s for ps:3 to start \(key 'never'"):
        role.get("never", waiting_for="ps:3 to start", timeout_s=1.0)
    assert 0.9 < time.monotonic() - start < 4


def test_set_within_says_whether_a_key_got_set_and_raises_only_when_the_chief_is_gone(plane):
    chief, role = plane
    assert role.set_within("over", 0.2, waiting_for="the end") is False
    threading.Timer(0.2, chief.set, args=("over", "1")).start()
    start = time.monotonic()
    assert role.set_within("over", 5.0, waiting_for="the end") is True
    assert time.monotonic() - start < 2
    address = _free_address()
    ending = ControlPlane.serve(address, timeout_s=1)
    orphan = ControlPlane(address, timeout_s=1)
    ending.close()
    with pytest.raises(ControlPlaneError, match="did not answer"):
        orphan.set_within("over", 0.2, waiting_for="the end")
    orphan.close()


def test_counters_are_atomic_across_threads(plane):
    chief, role = plane

    def count() -> None:
        for _ in range(100):
            role.add("hits", 1)

    threads = [threading.Thread(target=count) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert chief.add("hits", 0) == 400


@pytest.mark.parametrize(
    ("header", "frames", "problem"),
    [
        (
            {"op": "drop_table", "key": "x"},
            [],
            "unknown op 'drop_table' from prober\\S*; the control service knows set",
        ),
        ({"op": "set", "key": "x"}, [], "'set' from prober\\S*: expected 1 frames, got 0"),
        (
            {"op": "set", "key": 7},
            [ONE_BYTE],
            "'set' from prober\\S*: key must be printable text of 1..512 char",
        ),
        ({"op": "set", "key": "a\nb"}, [ONE_BYTE], "'set' from prober\\S*: key must hold printable text"),
        ({"op": "set", "key": "x" * 600}, [ONE_BYTE], "key must be printable text"),
        ({"op": "set", "key": "x"}, [torch.zeros(2, dtype=torch.float32)], "one uint8 frame"),
        (
            {"op": "get", "key": "x", "extra": 1},
            [],
            "'get' from prober\\S*: 'extra' is not a field of this message \\(it has key\\)",
        ),
        ({"op": "get", "k": "x"}, [], "'get' from prober\\S*: 'k' is not a field of this message \\(it has key\\)"),
        ({"op": "add", "key": "x", "amount": "1"}, [], "'add' from prober\\S*: amount must be an int within"),
        ({"op": "add", "key": "x", "amount": True}, [], "amount must be an int"),
        ({"op": "add", "key": "x", "amount": 2**63}, [], "amount must be an int"),
        ({"op": "wait", "keys": ["x"], "timeout_s": 1e9}, [], "timeout_s must be seconds in \\[0, 10.0\\]"),
        (
            {"op": "wait", "keys": [], "timeout_s": 1},
            [],
            "'wait' from prober\\S*: keys must be a list of 1..256",
        ),
        ({"op": "wait", "keys": ["x", 3], "timeout_s": 1}, [], "keys must be a list"),
        ({"op": "check", "keys": "x"}, [], "'check' from prober\\S*: keys must be a list"),
        ({"op": "check"}, [], "'check' from prober\\S*: keys is missing"),
    ],
)
def test_a_malformed_request_gets_an_error_reply_and_the_service_goes_on(plane, header, frames, problem):
    chief, role = plane
    with Client("prober", credentials=job_credentials()) as client:
        client.connect("chief", f"tcp://{chief.address}")
        with pytest.raises(CommError, match=problem):
            client.request("chief", header, frames, timeout_s=5)
    assert chief.service is not None and chief.service.stats["malformed"] == 1
    role.set("still", "serving")
    assert chief.get("still", waiting_for="still") == "serving"


def test_a_counter_over_a_value_that_is_not_a_number_is_refused(plane):
    _, role = plane
    role.set("text", "hello")
    with pytest.raises(ControlPlaneError, match=r"'text' holds .*not a counter"):
        role.add("text", 1)


def test_garbage_frames_from_a_member_are_answered_and_counted(plane):
    chief, _ = plane
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    sock.linger = 0
    sock.rcvtimeo = 5000
    secure_client_socket(sock, f"tcp://{chief.address}", job_credentials())
    sock.connect(f"tcp://{chief.address}")
    for message in ([b"\xc1not msgpack"], [msgpack.packb([1, 2])], [msgpack.packb({"op": "get", "key": "x"})]):
        sock.send_multipart(message)
        reply = msgpack.unpackb(sock.recv_multipart()[0])
        assert "malformed" in reply["error"]
    sock.close()
    assert chief.service is not None and chief.service.server.malformed == 3


def test_without_the_secret_nothing_can_be_read_or_written(plane):
    chief, _ = plane
    chief.set("placement", "secret placement")
    with pytest.raises(ControlPlaneError, match="job's secret"):
        ControlPlane(chief.address, timeout_s=2, credentials=Credentials("a guess"))
    assert chief.get("placement", waiting_for="placement") == "secret placement"


def test_a_role_rides_out_a_restart_of_the_chief(plane):
    chief, role = plane
    role.set("before", "1")
    address = chief.address
    chief.close()
    restarted: list[ControlPlane] = []
    threading.Timer(1.0, lambda: restarted.append(ControlPlane.serve(address, timeout_s=5))).start()
    # Sent while the chief is gone: answered by the restarted one, which knows nothing of the old keys.
    role.set("after", "2")
    assert restarted and restarted[0].get("after", waiting_for="after") == "2"
    assert not restarted[0].is_set("before")
    restarted[0].close()


def test_held_waits_are_bounded(plane, monkeypatch):
    chief, role = plane
    monkeypatch.setattr(control, "MAX_HELD", 2)
    waiters = [threading.Thread(target=_wait_quietly, args=(chief.address,)) for _ in range(2)]
    for waiter in waiters:
        waiter.start()
    time.sleep(0.5)
    with pytest.raises(ControlPlaneError, match="2 waits are held already"):
        role.wait(["never"], waiting_for="never", timeout_s=1)
    for waiter in waiters:
        waiter.join()
    assert chief.service is not None and chief.service.stats["expired"] >= 2


def _wait_quietly(address: str) -> None:
    plane = ControlPlane(address, timeout_s=5)
    with contextlib.suppress(ControlPlaneError):
        plane.wait(["never"], waiting_for="never", timeout_s=1.5)
    plane.close()


def test_every_op_of_the_protocol_has_a_handler(plane):
    chief, _ = plane
    assert chief.service is not None
    assert set(chief.service._handlers) == set(control.OPS.values())
    assert list(control.OPS) == ["set", "get", "delete", "check", "add", "wait"]


def test_typed_values_round_trip_with_their_type(plane):
    chief, role = plane
    notice = RecoveryNotice(generation=2, step=40, lost="ps:1")
    chief.put(job_keys.RECOVERY, notice)
    assert role.read(job_keys.RECOVERY, waiting_for="the recovery") == notice
    report = ProgressReport(
        local_step=7,
        epoch=1,
        first_loss=2.5,
        loss=math.nan,  # a worker reports the loss of its latest step, however bad
        steps_per_s=3.0,
        input_wait_share=0.1,
        time=1.0,
        done=False,
        generation=2,
        summary_losses={0: (4.5, 3)},
        summary_interval=0,
    )
    role.put(job_keys.progress("worker:3"), report)
    read = chief.read_if_set(job_keys.progress("worker:3"))
    assert read is not None and math.isnan(read.loss) and read.summary_losses == {0: (4.5, 3)}
    assert chief.read_if_set(job_keys.progress("worker:4")) is None
    placement = place([("w", torch.zeros(8, 4)), ("b", torch.zeros(4))], 2)
    chief.put(job_keys.PLACEMENT, placement)
    assert role.read(job_keys.PLACEMENT, waiting_for="the placement") == placement


def test_a_value_of_another_type_is_refused_before_it_is_sent(plane):
    chief, _ = plane
    with pytest.raises(TypeError, match="'recovery' holds a RecoveryNotice, not a Handover"):
        chief.put(job_keys.RECOVERY, Handover(workers=("worker:1",)))
    assert not chief.is_set(job_keys.RECOVERY)


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        (b"\xc1", "MessagePack data is malformed"),
        (b'{"generation": 2, "step": 40, "lost": "ps:1"}', "Expected `object`, got `int`"),  # JSON, not msgpack
        (msgspec.msgpack.encode({"generation": 2, "step": 40, "checkpoint": "ckpt-40"}), "unknown field `checkpoint`"),
        (msgspec.msgpack.encode({"generation": "2", "step": 40, "lost": "ps:1"}), "Expected `int`, got `str`"),
    ],
)
def test_a_malformed_value_is_an_error_naming_the_key_and_its_writer(plane, value, problem):
    chief, role = plane
    role.set(job_keys.RECOVERY.name, value)
    with pytest.raises(ControlValueError, match=f"'recovery' on the control plane, written by the chief, .*{problem}"):
        chief.read(job_keys.RECOVERY, waiting_for="the recovery")


def test_a_capture_request_is_validated_when_read(plane):
    chief, role = plane
    escape = msgspec.msgpack.encode({"name": "../../etc", "first": 5, "last": 8})
    role.set(job_keys.CAPTURE_REQUEST.name, escape)
    with pytest.raises(ControlValueError, match=r"'capture/request'.*a capture name is"):
        chief.read(job_keys.CAPTURE_REQUEST, waiting_for="a capture request")
    with pytest.raises(ValueError, match=r"0 <= first < last"):
        Capture(name="steps", first=8, last=5)
