"""The span and flow names the runtime records and the analyses read back: the profiler's one vocabulary.

Worker spans, one set per local step, all carrying the global step the worker saw:

- `INPUT_WAIT`: waiting for the next batch from the input pipeline.
- `FORWARD`, `BACKWARD`: the model's forward pass and backward pass (args: cpu_ns, the CPU time of the thread that
  ran it: on CPU torch computes on the calling thread, so the span's work without the waits for a core).
- `PUSH`: sending one PS its gradients (args: ps, bytes); a flow of the same name starts inside it.
- `PULL_WAIT`: waiting for one PS's reply with parameters or rows (args: ps, bytes).
- `STEP`: the whole local step, input to the last reply it waits for.

All-reduce worker spans (`sf.AllReduceStrategy`), besides `INPUT_WAIT`, `FORWARD`, `BACKWARD` and `STEP`:

- `ALLREDUCE`: the step's whole all-reduce: the gradients copied into their buckets, every bucket's collective
  issued and waited for (args: buckets, bytes).
- `ALLREDUCE_BUCKET`: one bucket's collective, from its issue to the end of its wait (args: bucket, bytes), on the
  worker's `allreduce` track: the collectives run together, so these overlap each other and lie inside `ALLREDUCE`.
- `APPLY`: the worker's optimizer step with the mean gradient (args: worker, bytes).

PS spans:

- `RECEIVE`: taking a push's frames apart (args: worker, bytes).
- `APPLY`: one update of the global step (args: worker, or -1 for an aggregated one; bytes); the push's flow
  ends inside it.
- `REPLY`: sending a worker the parameters after an update (args: worker).

Chief spans: `CHECKPOINT` (writing one) and `EVAL` (one inline evaluation).
"""

from __future__ import annotations

INPUT_WAIT = "input_wait"
FORWARD = "forward"
BACKWARD = "backward"
PUSH = "push"
PULL_WAIT = "pull_wait"
STEP = "step"

ALLREDUCE = "allreduce"
ALLREDUCE_BUCKET = "allreduce_bucket"
ALLREDUCE_TRACK = "allreduce"
"""The thread track of a worker's ALLREDUCE_BUCKET spans (gloo runs the collectives on threads of its own)."""

RECEIVE = "receive"
APPLY = "apply"
REPLY = "reply"

CHECKPOINT = "checkpoint"
EVAL = "eval"

ALL = (
    INPUT_WAIT,
    FORWARD,
    BACKWARD,
    PUSH,
    PULL_WAIT,
    STEP,
    ALLREDUCE,
    ALLREDUCE_BUCKET,
    RECEIVE,
    APPLY,
    REPLY,
    CHECKPOINT,
    EVAL,
)

ARG_NAMES: dict[str, tuple[str, str]] = {
    FORWARD: ("cpu_ns", "arg1"),
    BACKWARD: ("cpu_ns", "arg1"),
    PUSH: ("ps", "bytes"),
    PULL_WAIT: ("ps", "bytes"),
    ALLREDUCE: ("buckets", "bytes"),
    ALLREDUCE_BUCKET: ("bucket", "bytes"),
    RECEIVE: ("worker", "bytes"),
    APPLY: ("worker", "bytes"),
    REPLY: ("worker", "bytes"),
}
"""What the two integer arguments of a span mean, by span name; other spans call them arg0 and arg1."""
