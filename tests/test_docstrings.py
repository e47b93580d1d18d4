"""The examples in the core modules' docstrings run and print what they show."""

from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = [
    "autopipe.planning.tracing",
    "autopipe.planning.inplace",
    "autopipe.planning.hf_compat",
    "autopipe.planning.costgraph",
    "autopipe.planning.segment_graphs",
    "autopipe.planning.profile",
    "autopipe.planning.partitioner",
    "autopipe.planning.recompute",
    "autopipe.planning.baselines",
    "autopipe.planning.peers",
    "autopipe.planning.planner",
    "autopipe.planning.costmodel",
    "autopipe.planning.problem",
    "autopipe.planning.schedule_options",
    "autopipe.planning.plan",
    "autopipe.planning.plan_records",
    "autopipe.planning.plan_file",
    "autopipe.planning.plan_file",
    "autopipe.machine.device",
    "autopipe.machine.timing",
    "autopipe.machine.passes",
    "autopipe.machine.speed",
    "autopipe.machine.link",
    "autopipe.runtime.overhead_probe",
    "autopipe.reporting.text",
    "autopipe.models.transformer",
    "autopipe.runtime.step_failures",
    "autopipe.runtime.tensor_parallel",
    "autopipe.runtime.stage_schedule",
    "autopipe.runtime.placement",
    "autopipe.runtime.checkpointing",
    "autopipe.runtime.data_parallel",
    "autopipe.layouts",
    "autopipe.layouts.shapes",
    "autopipe.layouts.blocks",
    "autopipe.layouts.gpu",
    "autopipe.layouts.layout",
    "autopipe.layouts.step",
    "autopipe.layouts.search",
    "autopipe.layouts.sharding",
    "autopipe.layouts.exports",
    "autopipe.layouts.calibrate",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0, f"{name} has no examples"
    assert result.failed == 0
