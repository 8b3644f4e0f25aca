"""Options, with_options and AUTOTUNE: merged across the pipeline and turned into bounded numbers."""

from __future__ import annotations

import os
from typing import Any

import pytest

from shardflow import data
from shardflow.data import options as options_module

D = data.Dataset


def test_later_with_options_win_and_unset_fields_are_kept() -> None:
    first = data.Options()
    first.deterministic = False
    first.autotune.cpu_budget = 3
    second = data.Options()
    second.autotune.cpu_budget = 5
    merged = D.range(3).with_options(first).map(lambda x: x).with_options(second).options()
    assert merged.deterministic is False and merged.autotune.cpu_budget == 5


def test_zip_merges_the_options_of_its_inputs() -> None:
    chosen = data.Options()
    chosen.experimental_distribute.auto_shard_policy = data.AutoShardPolicy.DATA
    merged = D.zip(D.range(2), D.range(2).with_options(chosen)).options()
    assert merged.experimental_distribute.auto_shard_policy == data.AutoShardPolicy.DATA


def test_with_options_rejects_other_types() -> None:
    with pytest.raises(TypeError, match=r"with_options expects shardflow\.data\.Options, got dict"):
        D.range(2).with_options({"deterministic": False})  # type: ignore[arg-type]


def test_autotune_parallelism_is_the_cpu_budget() -> None:
    budget = data.Options()
    budget.autotune.cpu_budget = 3
    iterator: Any = iter(D.range(4).map(lambda x: x, num_parallel_calls=data.AUTOTUNE).with_options(budget))
    assert iterator._parallelism == 3
    assert list(iterator) == [0, 1, 2, 3]
    iterator.close()


def test_default_cpu_budget_is_the_cores_this_process_may_use() -> None:
    assert options_module.cpu_budget(data.Options()) == len(os.sched_getaffinity(0))


def test_autotuned_buffers_respect_the_ram_budget() -> None:
    small = data.Options()
    small.autotune.ram_budget = 8 * 1000
    assert options_module.autotuned_buffer_size(element_nbytes=500, options=small) == 2
    assert options_module.autotuned_buffer_size(element_nbytes=1, options=small) == 1000
    assert options_module.autotuned_buffer_size(element_nbytes=10**9, options=small) == 1


def test_autotuned_buffers_hold_32_elements_or_1_mib_of_small_ones() -> None:
    assert options_module.autotuned_buffer_size(element_nbytes=1 << 20, options=data.Options()) == 32
    assert options_module.autotuned_buffer_size(element_nbytes=128, options=data.Options()) == 8192


def test_deterministic_option_applies_when_map_leaves_it_unset() -> None:
    relaxed = data.Options()
    relaxed.deterministic = False
    iterator: Any = iter(D.range(4).map(lambda x: x, num_parallel_calls=2).with_options(relaxed))
    assert iterator._deterministic is False
    iterator.close()
