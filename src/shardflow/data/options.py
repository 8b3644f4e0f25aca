"""Pipeline-wide options as in tf.data.Options, AUTOTUNE, and how AUTOTUNE turns into numbers."""

from __future__ import annotations

import dataclasses
import enum
import os
from typing import Any, TypeVar

from shardflow.data.dataset import Dataset, DatasetIterator, UnaryDataset, active_options

T = TypeVar("T")

AUTOTUNE = -1
"""Let shardflow pick a parallelism or buffer size within the CPU and RAM budget of `Options.autotune`."""

# An autotuned buffer holds 32 elements, or more small ones up to 1 MiB (a queue handover per few records would
# cost more than reading them), and at most this share of the RAM budget.
_AUTOTUNED_BUFFER_ELEMENTS = 32
_AUTOTUNED_BUFFER_BYTES = 1 << 20
_BUFFER_SHARE_OF_RAM_BUDGET = 8


class AutoShardPolicy(enum.IntEnum):
    """How `auto_shard` splits a pipeline across workers (tf.data.experimental.AutoShardPolicy's values)."""

    OFF = -1
    AUTO = 0
    FILE = 1
    DATA = 2


class ExternalStatePolicy(enum.IntEnum):
    """tf.data.experimental.ExternalStatePolicy: what tf.data does when it serializes a pipeline whose functions
    hold state. shardflow checkpoints iterator positions, never functions, so the policy has no effect."""

    WARN = 0
    IGNORE = 1
    FAIL = 2


class AutotuneAlgorithm(enum.IntEnum):
    """tf.data.experimental.AutotuneAlgorithm's values; shardflow has one AUTOTUNE strategy (see below)."""

    DEFAULT = 0
    HILL_CLIMB = 1
    GRADIENT_DESCENT = 2
    MAX_PARALLELISM = 3
    STAGE_BASED = 4


# The option groups are mutable, unlike shardflow's configs, because tf.data code sets them attribute by
# attribute (`options.autotune.ram_budget = ...`) and must port unchanged. None means "not set here". They have
# slots, so that setting a misspelt option raises AttributeError, as in tf.data, instead of doing nothing. Options
# that shardflow accepts without effect say so: a tf.data pipeline that sets them still runs.


@dataclasses.dataclass(slots=True)
class AutotuneOptions:
    enabled: bool | None = None
    """False makes AUTOTUNE mean the smallest setting (one call, one buffered element)."""
    cpu_budget: int | None = None
    """Cores AUTOTUNE may use; unset means the cores this process may run on."""
    ram_budget: int | None = None
    """Bytes the autotuned buffers may hold together; unset means half the physical memory, as in tf.data."""
    autotune_algorithm: AutotuneAlgorithm | None = None
    """Accepted; no effect."""
    initial_parallelism: int | None = None
    """Accepted; no effect (AUTOTUNE starts at the CPU budget)."""
    min_parallelism: int | None = None
    """Accepted; no effect."""


@dataclasses.dataclass(slots=True)
class DistributeOptions:
    auto_shard_policy: AutoShardPolicy | None = None
    """The policy `auto_shard` uses when not given one; unset means AUTO."""
    num_devices: int | None = None
    """Accepted; no effect (shardflow shards across workers, one pipeline per worker)."""


@dataclasses.dataclass(slots=True)
class OptimizationOptions:
    """tf.data's static graph rewrites. shardflow runs the pipeline as written, so all are accepted without effect."""

    apply_default_optimizations: bool | None = None
    filter_fusion: bool | None = None
    filter_parallelization: bool | None = None
    inject_prefetch: bool | None = None
    map_and_batch_fusion: bool | None = None
    map_and_filter_fusion: bool | None = None
    map_fusion: bool | None = None
    map_parallelization: bool | None = None
    noop_elimination: bool | None = None
    parallel_batch: bool | None = None
    seq_interleave_prefetch: bool | None = None
    shuffle_and_repeat_fusion: bool | None = None


@dataclasses.dataclass(slots=True)
class ThreadingOptions:
    private_threadpool_size: int | None = None
    """Caps the parallelism AUTOTUNE picks; unset means the CPU budget."""
    max_intra_op_parallelism: int | None = None
    """Accepted; no effect (a map function's own threads are its business, e.g. torch.set_num_threads)."""


@dataclasses.dataclass(slots=True)
class Options:
    deterministic: bool | None = None
    """False lets parallel map return elements out of order (as they finish) when its own argument is None."""
    autotune: AutotuneOptions = dataclasses.field(default_factory=AutotuneOptions)
    experimental_distribute: DistributeOptions = dataclasses.field(default_factory=DistributeOptions)
    threading: ThreadingOptions = dataclasses.field(default_factory=ThreadingOptions)
    experimental_optimization: OptimizationOptions = dataclasses.field(default_factory=OptimizationOptions)
    experimental_external_state_policy: ExternalStatePolicy | None = None
    """Accepted; no effect (see ExternalStatePolicy)."""
    experimental_slack: bool | None = None
    """Accepted; no effect (tf.data delays prefetch to spread work across multi-device steps)."""
    experimental_symbolic_checkpoint: bool | None = None
    """Accepted; no effect: shardflow's iterator state is always symbolic (positions and seeds, never buffers)."""
    experimental_warm_start: bool | None = None
    """Accepted; no effect: background stages start on the first element requested."""
    dataset_name: str | None = None
    """Accepted; no effect (a label in tf.data's metrics)."""

    @property
    def experimental_deterministic(self) -> bool | None:
        """tf.data's older name of `deterministic`."""
        return self.deterministic

    @experimental_deterministic.setter
    def experimental_deterministic(self, value: bool | None) -> None:
        self.deterministic = value

    @property
    def experimental_threading(self) -> ThreadingOptions:
        """tf.data's older name of `threading`."""
        return self.threading

    @experimental_threading.setter
    def experimental_threading(self, value: ThreadingOptions) -> None:
        self.threading = value

    def merge(self, other: Options) -> Options:
        """A new Options with every field `other` sets overriding this one's."""
        merged: Options = _merge(self, other)
        return merged


def _merge(base: Any, override: Any) -> Any:
    values = {}
    for field in dataclasses.fields(base):
        mine, theirs = getattr(base, field.name), getattr(override, field.name)
        if dataclasses.is_dataclass(mine):
            values[field.name] = _merge(mine, theirs)
        else:
            values[field.name] = mine if theirs is None else theirs
    return type(base)(**values)


class OptionsDataset(UnaryDataset[T]):
    def __init__(self, input_dataset: Dataset[T], options: Options) -> None:
        super().__init__(input_dataset)
        if not isinstance(options, Options):
            raise TypeError(f"with_options expects shardflow.data.Options, got {type(options).__name__}")
        self._options = options

    def options(self) -> Options:
        return super().options().merge(self._options)

    def _iterator(self) -> DatasetIterator[T]:
        return iter(self._input)

    def _cardinality(self) -> int:
        return self._input._cardinality()

    def _element_spec(self) -> Any | None:
        return self._input._element_spec()


def cpu_budget(options: Options | None = None) -> int:
    options = options or active_options()
    if options.autotune.cpu_budget is not None:
        return max(1, options.autotune.cpu_budget)
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def ram_budget(options: Options | None = None) -> int:
    options = options or active_options()
    if options.autotune.ram_budget is not None:
        return options.autotune.ram_budget
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2


def resolve_parallelism(num_parallel_calls: int | None, argument: str = "num_parallel_calls") -> int:
    """0 for None (run inline), the CPU budget (capped by the thread-pool option) for AUTOTUNE, else the value."""
    if num_parallel_calls is None:
        return 0
    options = active_options()
    if num_parallel_calls == AUTOTUNE:
        if options.autotune.enabled is False:
            return 1
        limit = options.threading.private_threadpool_size
        return min(cpu_budget(options), limit) if limit else cpu_budget(options)
    if not isinstance(num_parallel_calls, int) or num_parallel_calls < 1:
        raise ValueError(f"{argument} must be a positive int, None or AUTOTUNE, got {num_parallel_calls!r}")
    return num_parallel_calls


def resolve_deterministic(deterministic: bool | None) -> bool:
    if deterministic is not None:
        return deterministic
    return active_options().deterministic is not False


def autotuned_buffer_size(element_nbytes: int, options: Options | None = None) -> int:
    """How many elements of this size an AUTOTUNE buffer holds: 32, or as many as fit in 1 MiB if that is more, and
    at most 1/8 of the RAM budget."""
    options = options or active_options()
    if options.autotune.enabled is False:
        return 1
    element_nbytes = max(1, element_nbytes)
    wanted = max(_AUTOTUNED_BUFFER_ELEMENTS, _AUTOTUNED_BUFFER_BYTES // element_nbytes)
    fits = ram_budget(options) // _BUFFER_SHARE_OF_RAM_BUDGET // element_nbytes
    return int(max(1, min(wanted, fits)))
