"""bf16 on the wire (ParameterClient's wire_dtype="bf16"): the float dense gradients and parameters cross the socket
in bfloat16, while the PS keeps float32 and casts up before it sums or applies; lanes and row-sparse rows stay
float32. Against real ParameterServers on loopback sockets, with and without lanes (tests/ps/conftest.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from shardflow.comm.client import Client
from shardflow.comm.errors import CommError
from shardflow.ps import protocol
from shardflow.ps.client import ParameterClient, PushRequest
from shardflow.ps.optimizers import SGD
from shardflow.ps.placement import place
from shardflow.ps.protocol import PSProtocolError
from shardflow.ps.update_rules import ApplyConfig
from shardflow.train.checkpoints.servers import fetch_state, init_servers

SENDER = "worker:0#0badcafe"
LIMITS = protocol.Limits(num_workers=1, buffers=((torch.float32, 5),), num_tables=0)
PUSH = protocol.Push(worker_index=0, local_step=1, base_step=0, frame_counts=(2,), wire_dtype="bfloat16")
BF16_FRAMES = [torch.zeros(3, dtype=torch.bfloat16), torch.ones(2, dtype=torch.bfloat16)]


def _rounded(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`'s values as bfloat16 holds them, back in its own dtype."""
    return tensor.to(torch.bfloat16).to(tensor.dtype)


def _model() -> torch.nn.Module:
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 2))


def _push(worker: ParameterClient, model: torch.nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """One step of `model` on `x` through `worker`; the gradients it pushed, as the model had them."""
    worker.begin_push(0)
    model(x).sum().backward()
    grads = {name: param.grad.clone() for name, param in model.named_parameters() if param.grad is not None}
    worker.wait_push(worker.push(PushRequest()))
    return grads


def test_only_float32_and_float64_buffers_travel_in_the_wire_dtype():
    assert protocol.on_the_wire(torch.float32, "bfloat16") == torch.bfloat16
    assert protocol.on_the_wire(torch.float64, "bfloat16") == torch.bfloat16
    for dtype in (torch.float16, torch.bfloat16, torch.int64, torch.bool):
        assert protocol.on_the_wire(dtype, "bfloat16") == dtype
    assert protocol.on_the_wire(torch.float32, None) == torch.float32


def test_a_push_in_bf16_is_decoded_with_its_bf16_frames():
    header = {**PUSH.header(), "s": SENDER, "q": 1}
    assert protocol.decode_request(header, BF16_FRAMES, LIMITS, SENDER) == PUSH


@pytest.mark.parametrize(
    ("frames", "problem"),
    [
        ([torch.zeros(3), torch.ones(2)], "of buffer 0 must be 1-D torch.bfloat16, got torch.float32"),
        ([torch.zeros(3, dtype=torch.float16), torch.ones(2)], "of buffer 0 must be 1-D torch.bfloat16"),
    ],
)
def test_a_push_whose_frames_are_not_in_its_wire_dtype_is_refused_naming_the_buffer(frames, problem):
    with pytest.raises(PSProtocolError, match=f"frames {problem}.*wire_dtype 'bfloat16'") as raised:
        protocol.decode_request({**PUSH.header(), "s": SENDER, "q": 1}, frames, LIMITS, SENDER)
    assert raised.value.field == "frames"


@pytest.mark.parametrize("op", ["push", "pull", "nonfinite"])
@pytest.mark.parametrize("value", ["bf16", "float16", "float32", 16, True, ["bfloat16"]])
def test_a_wire_dtype_that_is_not_bfloat16_is_refused_naming_the_field(op, value):
    messages: dict[str, protocol.PSRequest] = {
        "push": PUSH,
        "pull": protocol.Pull(wire_dtype="bfloat16"),
        "nonfinite": protocol.NonFinite(worker_index=0, local_step=1, base_step=0, found_in="loss"),
    }
    header: dict[str, Any] = {**messages[op].header(), "wire_dtype": value, "s": SENDER, "q": 1}
    frames = BF16_FRAMES if op == "push" else []
    with pytest.raises(PSProtocolError) as raised:
        protocol.decode_request(header, frames, LIMITS, SENDER)
    assert raised.value.field == "wire_dtype"


def test_a_client_refuses_a_wire_dtype_it_does_not_know():
    model = _model()
    with pytest.raises(ValueError, match=r"wire_dtype must be one of \['bf16'\] or None, got 'fp8'"):
        ParameterClient(
            Client("worker:0"), ["tcp://127.0.0.1:9"], place(model.named_parameters(), 1), model, wire_dtype="fp8"
        )


def test_parameters_pulled_in_bf16_are_the_ps_values_rounded_into_float32_parameters(cluster):
    model = _model()
    placement = place(model.named_parameters(), 3)
    init_servers(cluster.admin(model, placement), SGD(lr=0.1), ApplyConfig(num_workers=1))
    fresh = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 2))
    cluster.client(fresh, placement, wire_dtype="bf16").pull()
    for name, value in model.named_parameters():
        pulled = dict(fresh.named_parameters())[name]
        assert pulled.dtype == torch.float32
        # Through a lane the parameters come as the PS keeps them: bf16 is for the socket only.
        assert torch.equal(pulled.detach(), value.detach() if cluster.lanes else _rounded(value.detach())), name


def test_gradients_pushed_in_bf16_are_applied_to_float32_masters_on_the_ps(cluster):
    model = _model()
    placement = place(model.named_parameters(), 3)
    admin = cluster.admin(model, placement)
    init_servers(admin, SGD(lr=0.5), ApplyConfig(num_workers=1))
    before = {name: param.detach().clone() for name, param in model.named_parameters()}
    grads = _push(cluster.client(model, placement, wire_dtype="bf16"), model, torch.randn(4, 5))
    state = fetch_state(admin)
    for name, value in state.params.items():
        assert value.dtype == torch.float32, name
        sent = grads[name] if cluster.lanes else _rounded(grads[name])
        torch.testing.assert_close(value, before[name] - 0.5 * sent, rtol=0, atol=1e-6)


def test_sync_sums_the_bf16_pushes_of_its_replicas_in_float32(start_cluster):
    cluster = start_cluster(1)
    model = torch.nn.Linear(2, 1, bias=False)
    torch.nn.init.zeros_(model.weight)
    placement = place(model.named_parameters(), 1)
    admin = cluster.admin(model, placement)
    init_servers(admin, SGD(lr=1.0), ApplyConfig(mode="sync", num_workers=2))
    workers = [
        cluster.client(torch.nn.Linear(2, 1, bias=False), placement, worker_index=i, wire_dtype="bf16") for i in (0, 1)
    ]
    requests = []
    # 1 and 2**-9 are both exact in bfloat16, but their sum is not (8 significant bits): it rounds to 1 there.
    for worker, grad in zip(workers, (1.0, 2.0**-9), strict=True):
        worker.begin_push(0)
        param = worker.named["weight"]
        param.grad = torch.full_like(param, grad)
        requests.append(worker.push(PushRequest()))
    for worker, request in zip(workers, requests, strict=True):
        worker.wait_push(request)
    assert torch.equal(fetch_state(admin).params["weight"], torch.full((1, 2), -(1 + 2.0**-9) / 2))


def test_row_sparse_rows_and_their_gradients_stay_float32_with_bf16_on_the_wire(cluster):
    torch.manual_seed(5)
    embedding = torch.nn.Embedding(20, 3, sparse=True)
    model = torch.nn.Sequential(embedding, torch.nn.Flatten(), torch.nn.Linear(6, 1))
    placement = place(model.named_parameters(), 3, sparse={"0.weight"})
    admin = cluster.admin(model, placement)
    init_servers(admin, SGD(lr=0.5), ApplyConfig(num_workers=1))
    table = embedding.weight.detach().clone()
    worker = cluster.client(model, placement, wire_dtype="bf16")
    worker.begin_push(0)
    ids = torch.tensor([[4, 9]])
    model(ids).sum().backward()
    grad = embedding.weight.grad
    assert grad is not None
    grad_rows = grad.coalesce().to_dense()[ids[0]]
    worker.wait_push(worker.push(PushRequest()))
    expected = table.clone()
    expected[ids[0]] -= 0.5 * grad_rows
    assert torch.equal(fetch_state(admin).params["0.weight"], expected)


def test_a_live_ps_refuses_pushes_whose_wire_dtype_is_unknown_or_does_not_match_and_keeps_serving(start_cluster):
    cluster = start_cluster(1)
    model = torch.nn.Linear(2, 1)
    placement = place(model.named_parameters(), 1)
    init_servers(cluster.admin(model, placement), SGD(lr=1.0), ApplyConfig(num_workers=1))
    outsider = Client("outsider")
    outsider.connect("ps:0", cluster.addresses[0])
    push = {"op": "push", "worker_index": 0, "local_step": 1, "base_step": 0, "frame_counts": [2]}
    fp32, bf16 = [torch.zeros(2), torch.zeros(1)], [torch.zeros(2, dtype=torch.bfloat16), torch.zeros(1).bfloat16()]
    refused = [
        ({**push, "wire_dtype": "float8"}, bf16, "wire_dtype "),
        ({**push, "wire_dtype": "bfloat16"}, fp32, r"frames of buffer 0 must be 1-D torch.bfloat16, got torch.float32"),
        (push, bf16, r"frames of buffer 0 must be 1-D torch.float32, got torch.bfloat16"),
        ({"op": "pull", "wire_dtype": 16}, [], "wire_dtype "),
    ]
    for header, frames, problem in refused:
        with pytest.raises(CommError, match=f"refused a malformed request: .*{problem}"):
            outsider.request("ps:0", header, frames, timeout_s=5)
    outsider.close()
    worker = cluster.client(model, placement, wire_dtype="bf16")
    _push(worker, model, torch.ones(1, 2))
    assert worker.global_step() == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: the cast before the host copy")
def test_a_cuda_model_pushes_and_pulls_in_bf16_and_keeps_float32_parameters(start_cluster):
    cluster = start_cluster(1)
    model = _model()
    placement = place(model.named_parameters(), 1)
    admin = cluster.admin(model, placement)
    init_servers(admin, SGD(lr=0.5), ApplyConfig(num_workers=1))
    before = {name: param.detach().clone() for name, param in model.named_parameters()}
    on_gpu = _model().cuda()
    worker = cluster.client(on_gpu, placement, wire_dtype="bf16")  # a GPU model uses no lane
    worker.pull()
    for name, param in on_gpu.named_parameters():
        assert param.dtype == torch.float32 and param.is_cuda
        assert torch.equal(param.detach().cpu(), _rounded(before[name])), name
    grads = _push(worker, on_gpu, torch.randn(4, 5, device="cuda"))
    for name, value in fetch_state(admin).params.items():
        expected = before[name] - 0.5 * _rounded(grads[name].cpu())
        torch.testing.assert_close(value, expected, rtol=0, atol=1e-6)
        assert torch.equal(dict(on_gpu.named_parameters())[name].detach().cpu(), _rounded(value)), name
