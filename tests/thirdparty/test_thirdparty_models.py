"""Models nobody in this project wrote: every plan autopipe makes for them builds and runs.

For each model of :data:`zoo.thirdparty.REGISTRY` (stock classes from
transformers, diffusers, torchvision and timm at their default settings, tiny sizes), the
planner is asked for 2 and 4 stages, with FLOP-estimated and with measured costs (each
model traced once, and each kind of costs profiled once for both stage counts), and each plan it returns is
built with the runtime's own stage builder (``autopipe.runtime.stages.split_model``, what
:class:`autopipe.Pipeline` builds) and run in one process: the stages, run in order,
must give the unsplit model's output.

A model whose package is missing is skipped (``conftest.py``); a model ``torch.export``
cannot capture at all is listed in the registry with its reason and not tested here.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import autopipe
from autopipe.planning.profile import SegmentCosts, profile_segments
from autopipe.planning.tracing import TracedModel, trace
from zoo.thirdparty import FAMILIES, REGISTRY, Built, get, package_missing
from zoo.thirdparty_checks import TOLERANCE, check_split, first_line, output_difference
from _planning import partition_with  # noqa: E402

TESTED = [name for name, entry in REGISTRY.items() if entry.unsupported is None]
# Small profiles: the tests check that plans run, not how good they are.
PROFILE = {"warmup": 0, "repeats": 1}

# One model build and trace, one profile per (model, cost) and one check per distinct split,
# shared by the tests of this module: the plans for 2 and 4 stages are made from the same
# profile (partition given a profile reuses the trace it was measured on), and the four plans
# of a model often repeat a split.
_built: dict[str, Built] = {}
_traced: dict[str, TracedModel] = {}
_profiles: dict[tuple[str, str], SegmentCosts] = {}
_plans: dict[tuple[str, int, str], autopipe.Plan | BaseException] = {}
_checks: dict[tuple[str, tuple[str, ...]], float | BaseException] = {}


def _build(name: str) -> Built:
    if name not in _built:
        _built[name] = get(name).build()
    return _built[name]


def _profile(name: str, cost: str) -> SegmentCosts:
    """The model's segment costs, counted or measured (small profiles: the tests check that plans run)."""
    built = _build(name)
    if name not in _traced:
        _traced[name] = trace(built.model, built.example_args, built.example_kwargs)
    if (name, cost) not in _profiles:
        _profiles[name, cost] = profile_segments(_traced[name], cost=cost, progress=False,
                                                 **(PROFILE if cost == "measured" else {}))
    return _profiles[name, cost]


def _plan(name: str, n_gpus: int, cost: str) -> autopipe.Plan:
    key = (name, n_gpus, cost)
    if key not in _plans:
        built = _build(name)
        try:
            _plans[key] = partition_with(built.model, n_gpus, example_args=built.example_args,
                                         example_kwargs=built.example_kwargs, cost=_profile(name, cost),
                                         profiling=autopipe.ProfileOptions(progress=False))
        except Exception as e:  # noqa: BLE001 - kept, so the next test asking for it fails the same way at once
            _plans[key] = e
    if isinstance(_plans[key], BaseException):
        raise _plans[key]
    return _plans[key]


def _check(name: str, split_points: list[str]) -> float:
    key = (name, tuple(split_points))
    if key not in _checks:
        try:
            _checks[key] = check_split(_build(name), split_points)
        except Exception as e:  # noqa: BLE001 - re-raised by every test that asks for this split
            _checks[key] = e
    outcome = _checks[key]
    if isinstance(outcome, BaseException):
        raise AssertionError(f"the runtime cannot build or run the split {split_points}: {first_line(outcome)}") \
            from outcome
    return outcome


@pytest.mark.parametrize("cost", ["flops", pytest.param("measured", marks=pytest.mark.slow)])
@pytest.mark.parametrize("n_gpus", [2, 4])
@pytest.mark.parametrize("name", TESTED)
def test_every_plan_builds_and_runs_like_the_unsplit_model(name, n_gpus, cost):
    plan = _plan(name, n_gpus, cost)
    assert plan.num_stages == n_gpus and len(plan.split_points) == n_gpus - 1
    diff = _check(name, plan.split_points)
    assert diff <= TOLERANCE, f"the stages of {plan.split_points} differ from the unsplit model by {diff:.3g}"


# ----------------------------------------------------------------------------- the registry itself


def test_the_registry_covers_every_family_with_enough_models():
    assert len(REGISTRY) >= 24
    assert {e.family for e in REGISTRY.values()} == set(FAMILIES)
    assert {e.package for e in REGISTRY.values()} == {"transformers", "diffusers", "torchvision", "timm"}
    subset = [e for e in REGISTRY.values() if e.pipeline_split and e.unsupported is None]
    assert len(subset) >= 8
    assert {e.family for e in subset} == set(FAMILIES), "the 2-rank check covers one model of every family"


def test_unsupported_models_say_why_in_one_line():
    unsupported = [e for e in REGISTRY.values() if e.unsupported is not None]
    assert unsupported, "Switch Transformers is listed as a model torch.export cannot capture"
    for entry in unsupported:
        assert entry.unsupported.strip() and "\n" not in entry.unsupported
        assert entry.pipeline_split is None


@pytest.mark.parametrize("name", ["bert", "unet2d"])
def test_a_built_batch_is_reproducible_and_its_loss_is_a_scalar(name):
    a, b = get(name).build(), get(name).build()
    out = a.model(*a.example_args, **a.example_kwargs)
    loss = a.loss_fn(out, a.target)
    assert loss.dim() == 0 and loss.requires_grad
    a.model.eval(), b.model.eval()  # dropout off: the same weights give the same output
    assert output_difference(a.model(*a.example_args, **a.example_kwargs),
                             b.model(*b.example_args, **b.example_kwargs)) == 0.0


def test_without_dropout_every_stochastic_rate_is_zero():
    built = get("bert").build(dropout=False)
    rates = {k: v for k, v in built.model.config.to_dict().items() if "dropout" in k and isinstance(v, float)}
    assert rates and all(v == 0.0 for v in rates.values())
    out = [built.model(*built.example_args, **built.example_kwargs).logits for _ in range(2)]
    assert output_difference(out[0], out[1]) == 0.0  # in training mode


def test_the_registry_imports_without_any_third_party_package():
    blocked = "import sys\nfor m in ('transformers', 'diffusers', 'torchvision', 'timm'): sys.modules[m] = None\n"
    code = blocked + ("from zoo.thirdparty import REGISTRY, package_missing\n"
                      "assert len(REGISTRY) >= 24\nprint(package_missing('transformers'))")
    tests = str(Path(__file__).resolve().parents[1])  # where the zoo lives
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONWARNINGS": "ignore",
                               "PYTHONPATH": os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH")]))})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().startswith("import transformers fails") or "not installed" in proc.stdout


def test_a_package_that_is_absent_is_reported_in_one_line():
    reason = package_missing("autopipe_no_such_package")
    assert reason == "autopipe_no_such_package is not installed"
    vision = package_missing("torchvision")
    assert vision is None or ("\n" not in vision and "torchvision" in vision)


@pytest.mark.parametrize("module", ["zoo.thirdparty", "zoo.thirdparty_checks"])
def test_the_module_examples_run(module):
    import doctest
    import importlib

    result = doctest.testmod(importlib.import_module(module), optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0
