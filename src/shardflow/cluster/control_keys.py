"""The control-plane protocol: every key and counter the roles of one job share through the chief's control
plane, who writes it, who reads it and what it means. No key is spelled anywhere else.

Two modules declare them, one per layer. This one holds the keys whose value is plain text or bytes, which the
cluster layer and the PS use, and `Key`, the declaration of a key whose value is typed. train/job_keys.py holds
the job's structured keys (progress, recovery, placement, handover, restored input, captures, the final
evaluation), each a `Key` with the frozen type of its value: the placement's type lives in ps/, which `cluster`
never imports, so the typed keys live where training meets the PS.

Each entry reads `key`: writer -> readers. Meaning. Values are UTF-8 text unless a key says bytes.

- `ps/<k>/address`: ps:k -> chief, workers, `shardflow profile capture`. Where ps:k serves.
- `ready`: chief -> workers. The PS are initialised; workers may pull.
- `heartbeat/<role>`: each worker and PS, every second from its start, from a thread of its own -> chief.
  `<pid>:<count>`, changing with every beat; a role whose beat stops changing for the strategy's
  heartbeat_timeout_s is lost (the chief then waits up to worker_rejoin_timeout_s for it to be restarted), and
  a new pid means it was restarted.
- `clip_norm/<generation>/<step>/ps:<k>`: ps:k -> every other PS, in sync mode with clip_grad_norm on several PS.
  The squared norm of ps:k's shard of that step's gradient (ps/clipping.py); ps:k deletes it a step later.
- `failed/<role>`: a worker that raised -> chief. The error, as `Type: message`.
- `preempted/<role>`: a worker, PS or evaluator sent SIGTERM -> chief. Why (e.g. `SIGTERM`); the chief then ends
  the whole job at the current step, checkpointed, within the strategy's termination_grace_s.
- `chief/clock/address`: chief -> every role handing over a capture. The clock service.
- `capture/<name>/part/<role>`: each role but the chief -> chief. Its gzipped trace of the capture (bytes).
- `capture/<name>/done`: chief -> `shardflow profile capture`. The merged capture's directory.
- `dist/<group>/<generation>/<key>`: each rank of an all-reduce group -> the others. torch.distributed's rendezvous
  (gloo's addresses and counters) through cluster/dist_store.py, never an open TCPStore; bytes.
- `state/<name>/<i>`: worker:0 (`checkpoint/<n>`) -> chief, in `sf.AllReduceStrategy`. Chunk i of a whole model
  state as safetensors bytes (train/allreduce_state.py), streamed: the chief deletes each it reads.
- `state/<name>/<i>/taken`: the chief -> worker:0, in `sf.AllReduceStrategy`. Chunk i of a streamed state was read:
  the next one past the window may be put (train/allreduce_state.py `stream`); worker:0 deletes it.
- `allreduce/joined/<role>`: that worker -> the other workers, in `sf.AllReduceStrategy`. The last generation of the
  workers' group it joined; a restarted worker joins the next one (train/allreduce_group.py).
- `allreduce/chief`: chief -> workers, in `sf.AllReduceStrategy`. A fresh id of this chief's process, set as it
  starts: a worker that finds another one than it knew puts again what a restarted chief needs of it.
- `allreduce/stop`: chief -> worker:0, in `sf.AllReduceStrategy`. End training at the next global step (preempted),
  with a final checkpoint.
- `shutdown`: chief -> PS, evaluator. The job is over; stop serving.
- `goodbye/<role>`: each role but the chief, when it saw the end -> chief. A chief in a process of its own
  serves the control plane until every role said it (or 10 s).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import msgspec

from shardflow.structs import prepared

Value = TypeVar("Value")


class ControlValueError(ValueError):
    """A typed key's value that does not decode to its type; names the key and who writes it."""


@dataclass(frozen=True)
class Key(Generic[Value]):
    """A control-plane key whose value is a `value_type` (a frozen msgspec Struct or dataclass), carried as
    msgpack: JSON cannot carry the NaN loss a worker may report. Validated when read."""

    name: str
    value_type: type[Value]
    writer: str
    """Who writes it, named when its value is malformed."""

    def encode(self, value: Value) -> bytes:
        if not isinstance(value, self.value_type):
            raise TypeError(f"{self.name!r} holds a {self.value_type.__name__}, not a {type(value).__name__}")
        return msgspec.msgpack.encode(value)

    def decode(self, data: bytes) -> Value:
        try:
            return msgspec.msgpack.decode(data, type=prepared(self.value_type), strict=True)
        except (msgspec.DecodeError, ValueError, TypeError) as error:
            raise ControlValueError(
                f"the value of {self.name!r} on the control plane, written by {self.writer}, is not a "
                f"{self.value_type.__name__}: {error}"
            ) from None


def key_name(key: str | Key[Any]) -> str:
    return key.name if isinstance(key, Key) else key


READY = "ready"
ALLREDUCE_CHIEF = "allreduce/chief"
ALLREDUCE_STOP = "allreduce/stop"
SHUTDOWN = "shutdown"
CHIEF_CLOCK = "chief/clock"
"""An endpoint name: see `endpoint_address`."""


def ps_endpoint(index: int) -> str:
    """The endpoint name of ps:`index`."""
    return f"ps/{index}"


def endpoint_address(endpoint: str) -> str:
    return f"{endpoint}/address"


def goodbye(role: str) -> str:
    return f"goodbye/{role}"


def heartbeat(role: str) -> str:
    return f"heartbeat/{role}"


def clip_norm(generation: int, step: int, ps: int) -> str:
    return f"clip_norm/{generation}/{step}/ps:{ps}"


def failed(role: str) -> str:
    return f"failed/{role}"


def preempted(role: str) -> str:
    return f"preempted/{role}"


def capture_part(capture: str, role: str) -> str:
    return f"capture/{capture}/part/{role}"


def capture_done(capture: str) -> str:
    return f"capture/{capture}/done"


def dist_store_prefix(group: str, generation: int) -> str:
    """Where the torch.distributed store of all-reduce group `group`, formed for the `generation`-th time, keeps
    its keys (cluster/dist_store.py); each rank of the group writes and reads them as gloo's rendezvous needs."""
    return f"dist/{group}/{generation}/"


def allreduce_joined(role: str) -> str:
    return f"allreduce/joined/{role}"


def state_chunk(name: str, index: int) -> str:
    return f"state/{name}/{index}"


def state_taken(name: str, index: int) -> str:
    return f"state/{name}/{index}/taken"
