"""The examples in the core modules' docstrings run and print what they show."""

from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = [
    "autopipe.trace",
    "autopipe.inplace",
    "autopipe.hf_compat",
    "autopipe.costgraph",
    "autopipe.profile",
    "autopipe.partitioner",
    "autopipe.baselines",
    "autopipe.planner",
    "autopipe.plan",
    "autopipe.devices",
    "autopipe.reporting.text",
    "autopipe.models.transformer",
    "autopipe.runtime.step_failures",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0, f"{name} has no examples"
    assert result.failed == 0
