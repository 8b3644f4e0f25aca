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


# The option groups are mutable, unlike shardflow's configs, because tf.data code sets them attribute by
# attribute (`options.autotune.ram_budget = ...`) and must port unchanged. None means "not set here".


@dataclasses.dataclass
class AutotuneOptions:
    enabled: bool | None = None
    """False makes AUTOTUNE mean the smallest setting (one call, one buffered element)."""
    cpu_budget: int | None = None
    """Cores AUTOTUNE may use; unset means the cores this process may run on."""
    ram_budget: int | None = None
    """Bytes the autotuned buffers may hold together; unset means half the physical memory, as in tf.data."""


@dataclasses.dataclass
class DistributeOptions:
    auto_shard_policy: AutoShardPolicy | None = None
    """The policy `auto_shard` uses when not given one; unset means AUTO."""


@dataclasses.dataclass
class ThreadingOptions:
    private_threadpool_size: int | None = None
    """Caps the parallelism AUTOTUNE picks; unset means the CPU budget."""


@dataclasses.dataclass
class Options:
    deterministic: bool | None = None
    """False lets parallel map return elements out of order (as they finish) when its own argument is None."""
    autotune: AutotuneOptions = dataclasses.field(default_factory=AutotuneOptions)
    experimental_distribute: DistributeOptions = dataclasses.field(default_factory=DistributeOptions)
    threading: ThreadingOptions = dataclasses.field(default_factory=ThreadingOptions)

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
