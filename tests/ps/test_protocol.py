"""The PS wire protocol: every message survives the wire, every malformed one is refused naming its field, and
a live PS answers malformed requests with an error and keeps serving."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardflow.comm.client import Client
from shardflow.comm.errors import CommError
from shardflow.comm.framing import decode, encode
from shardflow.ps import protocol
from shardflow.ps.client import PushRequest
from shardflow.ps.optimizers import SGD
from shardflow.ps.placement import place
from shardflow.ps.protocol import PSProtocolError, RejoinReply, StateReply, StatusReply, StepReply
from shardflow.ps.update_rules import ApplyConfig
from shardflow.train.checkpoints.servers import init_servers

SENDER = "worker:1#0badcafe"
# A PS holding one float32 buffer of 5 elements and one table of 2 columns, in a job of 2 workers.
LIMITS = protocol.Limits(num_workers=2, buffers=((torch.float32, 5),), num_tables=1)
DENSE = [torch.zeros(3), torch.ones(2)]
ROW_GRAD = [torch.tensor([0, 3]), torch.ones(2, 2)]


def _requests() -> list[tuple[protocol.PSRequest, list[torch.Tensor]]]:
    return [
        (
            protocol.Init(
                dtypes=("float32",),
                num_tables=1,
                optimizer=SGD(lr=0.1),
                apply=ApplyConfig(mode="sync", num_workers=2, max_steps=10, snapshot_every_n_steps=5),
                step=7,
                frame_counts=(2,),
                slots=({"momentum_buffer": 0}, {}),
                scalars=({"step": 3.0}, {}),
                iterators={"worker:0": {"epoch": 1, "inner": None}},
                worker_steps={"worker:0": 3},
                generation=1,
            ),
            [*DENSE, torch.zeros(4, 2), torch.zeros(5)],
        ),
        (protocol.Init(dtypes=(), num_tables=0, optimizer=SGD(), apply=ApplyConfig(), step=0, frame_counts=()), []),
        (protocol.Pull(min_step=3), []),
        (protocol.Rows(table_indices=(0,)), [torch.tensor([1, 2])]),
        (
            protocol.Push(worker_index=1, local_step=3, base_step=2, frame_counts=(2,), input_state={"epoch": 0}),
            DENSE + ROW_GRAD,
        ),
        (protocol.Push(worker_index=0, local_step=1, base_step=0, frame_counts=(2,)), DENSE + ROW_GRAD),
        (protocol.NonFinite(worker_index=1, local_step=5, base_step=4, found_in="loss", input_state={"epoch": 0}), []),
        (protocol.NonFinite(worker_index=0, local_step=1, base_step=0, found_in="gradients"), []),
        (protocol.Done(worker_index=1), []),
        (protocol.Rejoin(worker_index=0), []),
        (protocol.Lost(worker_index=1), []),
        (protocol.Status(), []),
        (protocol.GetState(), []),
        (protocol.GetState(snapshot_step=4), []),
        (protocol.SnapshotAt(step=5), []),
        (protocol.ReleaseSnapshots(through_step=5), []),
        (protocol.Stop(), []),
        (protocol.Shutdown(), []),
        (protocol.Attach(worker_index=1, pid=4242, fd=7, push_slots=2, reply_slots=3), []),
        (protocol.Pull(min_step=0, reply_slot=2), []),
        (
            protocol.Push(worker_index=1, local_step=4, base_step=3, frame_counts=(0,), slot=1, reply_slot=0),
            ROW_GRAD,
        ),
        (protocol.NonFinite(worker_index=1, local_step=6, base_step=5, found_in="loss", reply_slot=1), []),
        (
            protocol.Push(worker_index=0, local_step=2, base_step=1, frame_counts=(2,), wire_dtype="bfloat16"),
            [frame.bfloat16() for frame in DENSE] + ROW_GRAD,
        ),
        (protocol.Pull(wire_dtype="bfloat16"), []),
    ]


def _over_the_wire(header: dict[str, Any], frames: list[torch.Tensor]) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """What the receiving side decodes: msgpack and raw frames, as comm sends them."""
    return decode([bytes(frame) for frame in encode(header, frames)])


@pytest.mark.parametrize(
    ("message", "frames"), _requests(), ids=[f"{m.op}-{i}" for i, (m, _) in enumerate(_requests())]
)
def test_every_request_round_trips_through_the_wire(message, frames):
    header, received = _over_the_wire({**message.header(), "s": SENDER, "q": 1}, frames)
    assert protocol.decode_request(header, received, LIMITS, SENDER) == message


@pytest.mark.parametrize(
    "reply",
    [
        StepReply(step=3, stop=False),
        StepReply(step=10, stop=True, dropped=True),
        StepReply(step=4, stop=False, stale=True),
        StepReply(step=5, stop=False, nonfinite=2),
        StepReply(step=6, stop=False, duplicate=True, lane=True),
    ],
)
def test_every_step_reply_round_trips_through_the_wire(reply):
    header, _ = _over_the_wire({**reply.header(), "s": SENDER, "q": 1}, [])
    assert StepReply.decode(header, "push", "ps:0") == reply


def test_a_status_reply_round_trips_through_the_wire():
    reply = StatusReply(step=9, stop=False, initialized=True, snapshots=(5, 8), stats={"applied": 9, "apply_s": 0.5})
    header, _ = _over_the_wire(reply.header(), [])
    assert StatusReply.decode(header, "ps:1") == reply


def test_a_state_reply_round_trips_through_the_wire():
    reply = StateReply(
        step=9,
        stop=True,
        state_step=8,
        dtypes=("float32", "int64"),
        slots=({"exp_avg": 0, "exp_avg_sq": 1}, {}),
        scalars=({"step": 8.0}, {}),
        iterators={"worker:0": {"epoch": 2}},
        worker_steps={"worker:0": 7},
        stats={"applied": 9},
    )
    header, _ = _over_the_wire(reply.header(), [])
    assert StateReply.decode(header, "ps:0") == reply


def test_a_rejoin_reply_round_trips_through_the_wire():
    reply = RejoinReply(step=9, stop=False, local_step=4, input_state={"epoch": 1}, done=False, generation=2)
    header, _ = _over_the_wire(reply.header(), [])
    assert RejoinReply.decode(header, "ps:1") == reply


# -- malformed requests --------------------------------------------------------------------------------------

_VALID: dict[str, tuple[dict[str, Any], list[torch.Tensor]]] = {
    message.op: ({**message.header(), "s": SENDER, "q": 1}, frames) for message, frames in reversed(_requests())
}
_MISSING = object()

_MALFORMED = [
    # (op, field set to a bad value (_MISSING: removed), bad value, field the error names)
    ("pull", "min_step", [1, 2], "min_step"),
    ("pull", "min_step", -1, "min_step"),
    ("pull", "min_step", True, "min_step"),
    ("pull", "min_step", 1.0, "min_step"),
    ("pull", "want_params", False, "'want_params'"),
    ("pull", "reply_slot", 8, "reply_slot"),
    ("pull", "reply_slot", -1, "reply_slot"),
    ("pull", "reply_slot", "0", "reply_slot"),
    ("push", "slot", 8, "slot"),
    ("push", "slot", 0, "frame_counts"),
    ("push", "slot", "0", "slot"),
    ("push", "reply_slot", True, "reply_slot"),
    ("nonfinite", "reply_slot", [0], "reply_slot"),
    ("attach", "pid", 0, "pid"),
    ("attach", "pid", 2**40, "pid"),
    ("attach", "fd", -1, "fd"),
    ("attach", "worker_index", 2, "worker_index"),
    ("attach", "push_slots", 0, "push_slots"),
    ("attach", "reply_slots", 9, "reply_slots"),
    ("attach", "reply_slots", _MISSING, "reply_slots"),
    ("attach", "path", "/dev/shm/x", "'path'"),
    ("push", "worker_index", None, "worker_index"),
    ("push", "worker_index", True, "worker_index"),
    ("push", "worker_index", -1, "worker_index"),
    ("push", "worker_index", 2, "worker_index"),
    ("push", "worker_index", _MISSING, "worker_index"),
    ("push", "local_step", -1, "local_step"),
    ("push", "local_step", _MISSING, "local_step"),
    ("push", "base_step", "0", "base_step"),
    ("push", "base_step", -3, "base_step"),
    ("push", "base_step", 2**64, "base_step"),
    ("push", "frame_counts", 2, "frame_counts"),
    ("push", "frame_counts", [True], "frame_counts"),
    ("push", "frame_counts", [1], "frame_counts"),
    ("push", "frame_counts", [2, 0], "frame_counts"),
    ("push", "frame_counts", _MISSING, "frame_counts"),
    ("push", "input_state", [1], "input_state"),
    ("push", "input_state", {1: 2}, "input_state"),
    ("push", "w", 0, "'w'"),
    ("rows", "table_indices", 0, "table_indices"),
    ("rows", "table_indices", [1], "table_indices"),
    ("rows", "table_indices", [-1], "table_indices"),
    ("rows", "table_indices", _MISSING, "table_indices"),
    ("nonfinite", "found_in", "weights", "found_in"),
    ("nonfinite", "found_in", ["loss"], "found_in"),
    ("nonfinite", "found_in", _MISSING, "found_in"),
    ("nonfinite", "worker_index", 2, "worker_index"),
    ("nonfinite", "base_step", -1, "base_step"),
    ("nonfinite", "input_state", "start", "input_state"),
    ("nonfinite", "frame_counts", [2], "'frame_counts'"),
    ("done", "worker_index", None, "worker_index"),
    ("done", "worker_index", 7, "worker_index"),
    ("state", "snapshot_step", -1, "snapshot_step"),
    ("state", "snapshot_step", "latest", "snapshot_step"),
    ("snapshot_at", "step", None, "step"),
    ("snapshot_at", "step", _MISSING, "step"),
    ("release_snapshots", "through_step", [], "through_step"),
    ("release_snapshots", "step", 3, "'step'"),
    ("status", "stats", True, "'stats'"),
    ("stop", "at", 1, "'at'"),
    ("shutdown", "now", True, "'now'"),
    ("init", "dtypes", "float32", "dtypes"),
    ("init", "dtypes", ["no_such_dtype"], "dtypes"),
    ("init", "dtypes", ["float64"], "frames"),
    ("init", "num_tables", -1, "num_tables"),
    ("init", "num_tables", 3, "num_tables"),
    ("init", "optimizer", {"name": "Lion", "kwargs": {}}, "optimizer"),
    ("init", "optimizer", {"name": "SGD"}, "optimizer"),
    ("init", "apply", {"mode": "eventually"}, "apply"),
    ("init", "apply", {"num_workers": True}, "apply"),
    ("init", "apply", {"max_staleness": "2"}, "apply"),
    ("init", "apply", {"workers": 2}, "apply"),
    ("init", "step", None, "step"),
    ("init", "frame_counts", [5], "frame_counts"),
    ("init", "slots", [{"momentum_buffer": 1}, {}], "slots"),
    ("init", "slots", [{}], "slots"),
    ("init", "scalars", [{"step": "3"}, {}], "scalars"),
    ("init", "iterators", [], "iterators"),
]


@pytest.mark.parametrize(("op", "field", "value", "named"), _MALFORMED)
def test_a_malformed_request_is_refused_naming_its_op_field_and_sender(op, field, value, named):
    header, frames = _VALID[op]
    header = dict(header)
    if value is _MISSING:
        del header[field]
    else:
        header[field] = value
    with pytest.raises(PSProtocolError) as raised:
        protocol.decode_request(header, frames, LIMITS, SENDER)
    assert (raised.value.op, raised.value.field, raised.value.sender) == (op, named, SENDER)
    assert str(raised.value).startswith(f"{op!r} from {SENDER}: {named} ")


@pytest.mark.parametrize(
    ("header", "message"),
    [
        ({"op": "pull"}, protocol.Pull(min_step=0)),
        ({"op": "pull", "reply_slot": None}, protocol.Pull()),
        ({"op": "state"}, protocol.GetState(snapshot_step=None)),
    ],
)
def test_a_field_left_out_is_its_default(header, message):
    # Headers leave out the fields at their defaults (omit_defaults), so a receiver reads a missing one as its default.
    assert message.header() == {"op": message.op}
    assert protocol.decode_request({**header, "s": SENDER, "q": 1}, [], LIMITS, SENDER) == message


@pytest.mark.parametrize(
    ("op", "frames", "named"),
    [
        ("push", [*DENSE, ROW_GRAD[0]], "frame_counts"),
        ("push", [torch.zeros(3, dtype=torch.float64), torch.ones(2), *ROW_GRAD], "frames"),
        ("push", [torch.zeros(1, 3), torch.ones(2), *ROW_GRAD], "frames"),
        ("push", [torch.zeros(4), torch.ones(2), *ROW_GRAD], "frames"),
        ("attach", [torch.zeros(1)], "frames"),
        ("rows", [], "table_indices"),
        ("pull", [torch.zeros(1)], "frames"),
        ("nonfinite", DENSE, "frames"),
        ("stop", [torch.zeros(1)], "frames"),
        ("init", DENSE, "num_tables"),
        ("init", [torch.zeros(3)], "frame_counts"),
    ],
)
def test_frames_that_do_not_fit_the_header_or_the_ps_are_refused(op, frames, named):
    header, _ = _VALID[op]
    with pytest.raises(PSProtocolError) as raised:
        protocol.decode_request(header, frames, LIMITS, SENDER)
    assert raised.value.field == named


@pytest.mark.parametrize("op", ["bogus", 5, None, ["push"]])
def test_an_unknown_op_is_refused_naming_the_op_field(op):
    with pytest.raises(PSProtocolError, match=f"from {SENDER}: op is not a PS request") as raised:
        protocol.decode_request({"op": op, "s": SENDER, "q": 1}, [], LIMITS, SENDER)
    assert raised.value.field == "op"


@pytest.mark.parametrize(
    ("header", "named"),
    [
        ({"step": -1, "stop": False}, "step"),
        ({"step": 1, "stop": 1}, "stop"),
        ({"step": 1}, "stop"),
        ({"step": 1, "stop": False, "dropped": "yes"}, "dropped"),
        ({"step": 1, "stop": False, "nonfinite": -1}, "nonfinite"),
        ({"step": 1, "stop": False, "nonfinite": True}, "nonfinite"),
        ({"step": 1, "stop": False, "params": True}, "'params'"),
    ],
)
def test_a_malformed_step_reply_is_refused_naming_the_field(header, named):
    with pytest.raises(PSProtocolError) as raised:
        StepReply.decode(header, "pull", "ps:1")
    assert (raised.value.field, raised.value.sender) == (named, "ps:1")


def test_a_status_reply_with_non_numeric_stats_is_refused():
    header = StatusReply(step=1, stop=False, initialized=True, snapshots=(), stats={}).header()
    header["stats"] = {"applied": "many"}
    with pytest.raises(PSProtocolError, match=r"stats must be an int or a float at stats\[...\], got a str"):
        StatusReply.decode(header, "ps:0")


# -- anything at all ---------------------------------------------------------------------------------------

_FIELD_NAMES = sorted(
    {key for header, _ in _VALID.values() for key in header} | {"w", "n", "it", "want_params", "wire_dtype"}
)
_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True)
    | st.text(max_size=5)
    | st.binary(max_size=5)
    | st.just("bfloat16"),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=4) | st.integers(), children),
    max_leaves=8,
)
_FRAMES = st.lists(
    st.builds(
        lambda dtype, shape: torch.zeros(shape, dtype=dtype),
        st.sampled_from([torch.float32, torch.float64, torch.bfloat16, torch.int64, torch.int32]),
        st.lists(st.integers(0, 4), min_size=1, max_size=2),
    ),
    max_size=6,
)


@settings(max_examples=400, deadline=None)
@given(
    op=st.sampled_from([*_VALID, "bogus"]) | _VALUES,
    changes=st.dictionaries(st.sampled_from(_FIELD_NAMES) | st.text(max_size=3), _VALUES | st.just(_MISSING)),
    frames=st.none() | _FRAMES,
    limits=st.sampled_from([None, LIMITS]),
)
def test_the_decoder_only_ever_returns_a_request_or_raises_its_protocol_error(op, changes, frames, limits):
    header, valid_frames = _VALID.get(op, ({"s": SENDER, "q": 1}, [])) if isinstance(op, str) else ({}, [])
    header = {**header, "op": op}
    for key, value in changes.items():
        if value is _MISSING:
            header.pop(key, None)
        else:
            header[key] = value
    try:
        message = protocol.decode_request(header, valid_frames if frames is None else frames, limits, SENDER)
    except PSProtocolError as error:
        assert error.sender == SENDER
    else:
        assert type(message).op == op


@settings(max_examples=200, deadline=None)
@given(
    header=st.dictionaries(
        st.sampled_from(["step", "stop", "dropped", "stale", "nonfinite", "snapshots", "stats"]), _VALUES
    )
)
def test_the_reply_decoders_only_ever_return_a_reply_or_raise_the_protocol_error(header):
    for decode_reply in (lambda h: StepReply.decode(h, "pull", "ps:0"), lambda h: StatusReply.decode(h, "ps:0")):
        with contextlib.suppress(PSProtocolError):
            decode_reply(header)


# -- a live PS -----------------------------------------------------------------------------------------------


def test_a_live_ps_answers_each_malformed_request_with_an_error_and_keeps_serving(start_cluster):
    cluster = start_cluster(1)
    model = torch.nn.Linear(2, 1)
    placement = place(model.named_parameters(), 1)
    init_servers(cluster.admin(model, placement), SGD(lr=1.0), ApplyConfig(num_workers=1))
    outsider = Client("outsider")
    outsider.connect("ps:0", cluster.addresses[0])
    dense = [torch.zeros(1, 2).reshape(-1), torch.zeros(1)]  # weight, bias: the float32 buffer's pieces
    push = {"op": "push", "worker_index": 0, "local_step": 1, "base_step": 0, "frame_counts": [2]}
    malformed: list[tuple[dict[str, Any], list[torch.Tensor], str]] = [
        ({"op": "pull", "min_step": [1, 2]}, [], "min_step"),
        ({**push, "worker_index": None}, dense, "worker_index"),
        ({**push, "worker_index": 1}, dense, "worker_index"),
        ({"op": "no_such_op"}, [], "op"),
        ({"op": "push"}, dense, "worker_index"),
        ({**push, "frame_counts": [3]}, dense, "frame_counts"),
        (push, [torch.zeros(3), torch.zeros(1)], "frames"),
        ({"op": "done", "worker_index": True}, [], "worker_index"),
        ({"op": "snapshot_at", "step": -1}, [], "step"),
        ({**push, "w": 0}, dense, "'w'"),
    ]
    for header, frames, field in malformed:
        with pytest.raises(CommError, match=f"refused a malformed request: .* {field} "):
            outsider.request("ps:0", header, frames, timeout_s=5)
    # Well-formed, but the handler cannot serve it: answered with an error too.
    with pytest.raises(CommError, match="no snapshot at step 3"):
        outsider.request("ps:0", protocol.GetState(snapshot_step=3).header(), timeout_s=5)
    outsider.close()

    worker = cluster.client(model, placement)
    before = [p.detach().clone() for p in model.parameters()]
    worker.begin_push(0)
    model(torch.ones(1, 2)).sum().backward()  # every gradient is 1
    assert worker.wait_push(worker.push(PushRequest())).step == 1
    for param, value in zip(model.parameters(), before, strict=True):
        torch.testing.assert_close(param.detach(), value - 1.0)
    assert worker.global_step() == 1
    (status,) = cluster.admin(model, placement).status()
    assert (status.step, status.stats["malformed"], status.stats["failed"]) == (1, len(malformed), 1)
