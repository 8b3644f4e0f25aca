"""The control-plane protocol: every key and counter the roles of one job share through the chief's control
plane, who writes it, who reads it and what it means. No key is spelled anywhere else.

Values are UTF-8 text (JSON where structured) unless a key says bytes. Each entry reads
`key`: writer -> readers. Meaning.

Start-up, in order:

- `ps/<k>/address`: ps:k -> chief, workers, `shardflow profile capture`. Where ps:k serves.
- `restore/iterators`: chief, when it restored a checkpoint -> workers. JSON: each worker's input position.
- `placement`: chief -> workers. JSON: which PS holds which piece of which variable.
- `ready`: chief -> workers. The PS are initialised; workers may pull.

While training:

- `heartbeat/<role>`: each worker and PS, every second from its start, from a thread of its own -> chief.
  `<pid>:<count>`, changing with every beat; a role whose beat stops changing for the strategy's
  heartbeat_timeout_s is lost (the chief then waits up to worker_rejoin_timeout_s for it to be restarted), and
  a new pid means it was restarted.
- `clip_norm/<generation>/<step>/ps:<k>`: ps:k -> every other PS, in sync mode with clip_grad_norm on several PS.
  The squared norm of ps:k's shard of that step's gradient (ps/clipping.py); ps:k deletes it a step later.
- `recovery`: chief, when it restored every PS after one was lost -> workers. JSON: {"generation", "step",
  "checkpoint"}; a worker whose generation is older drops what it was doing and rejoins.
- `progress/<role>`: each worker, about once a second -> chief. JSON progress report; its last one says
  `"done": true`.
- `handover/<role>`: chief -> that worker. JSON list of workers lost for good (not back within
  worker_rejoin_timeout_s) whose remaining shards it reads once its own is done, as each of them (their worker
  index and step count): every record is still applied once (async mode with epochs; see chief_loop.py).
- `failed/<role>`: a worker that raised -> chief. The error, as `Type: message`.
- `preempted/<role>`: a worker, PS or evaluator sent SIGTERM -> chief. Why (e.g. `SIGTERM`); the chief then ends
  the whole job at the current step, checkpointed, within the strategy's termination_grace_s.
- `chief/clock/address`: chief -> every role handing over a capture. The clock service.
- `capture/current`: chief -> every role. JSON: the capture being recorded (name, first, last, ops).
- `capture/request`: `shardflow profile capture` -> chief. JSON: a capture asked for from outside the job.
- `capture/<name>/part/<role>`: each role but the chief -> chief. Its gzipped trace of the capture (bytes).
- `capture/<name>/done`: chief -> `shardflow profile capture`. The merged capture's directory.

The end:

- `shutdown`: chief -> PS, evaluator. The job is over; stop serving.
- `goodbye/<role>`: each role but the chief, when it saw the end -> chief. A chief in a process of its own
  serves the control plane until every role said it (or 10 s).
- `eval/final`: evaluator -> chief. JSON: the side-car evaluator's last checkpoint and metrics.
"""

from __future__ import annotations

READY = "ready"
PLACEMENT = "placement"
RESTORE_ITERATORS = "restore/iterators"
SHUTDOWN = "shutdown"
RECOVERY = "recovery"
EVAL_FINAL = "eval/final"
CAPTURE_CURRENT = "capture/current"
CAPTURE_REQUEST = "capture/request"
CHIEF_CLOCK = "chief/clock"
"""An endpoint name: see `endpoint_address`."""


def ps_endpoint(index: int) -> str:
    """The endpoint name of ps:`index`."""
    return f"ps/{index}"


def endpoint_address(endpoint: str) -> str:
    return f"{endpoint}/address"


def goodbye(role: str) -> str:
    return f"goodbye/{role}"


def handover(role: str) -> str:
    return f"handover/{role}"


def heartbeat(role: str) -> str:
    return f"heartbeat/{role}"


def clip_norm(generation: int, step: int, ps: int) -> str:
    return f"clip_norm/{generation}/{step}/ps:{ps}"


def progress(role: str) -> str:
    return f"progress/{role}"


def failed(role: str) -> str:
    return f"failed/{role}"


def preempted(role: str) -> str:
    return f"preempted/{role}"


def capture_part(capture: str, role: str) -> str:
    return f"capture/{capture}/part/{role}"


def capture_done(capture: str) -> str:
    return f"capture/{capture}/done"
