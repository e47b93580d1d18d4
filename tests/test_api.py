"""The public surface: partition()'s keywords, the top-level names, the shared argument checks."""

from __future__ import annotations

import inspect
import subprocess
import sys
import warnings

import numpy as np
import pytest

import autopipe
from autopipe import Device, ProfileOptions
from autopipe._checks import check_at_most, check_bool, check_choice, check_int
from autopipe.planning.options import PlannerOptions, resolve_devices
from autopipe.planning.profile import profile_segments
from _planning import partition_with

QUICK = ProfileOptions(progress=False, warmup=0, repeats=1)


@pytest.fixture(scope="module")
def costs(small_traced):
    return profile_segments(small_traced, progress=False, warmup=0, repeats=1)


def _figures(plan: autopipe.Plan) -> tuple:
    """What the devices and costs given decide: the split, each stage's times, the step."""
    return (plan.split_points, [(s.fwd_s, s.bwd_s, s.comm_s) for s in plan.stages], plan.predicted_step_s,
            plan.action_overhead_s(), plan.memory_limit_bytes)


# --------------------------------------------------------------------------- partition's signature


def test_partition_takes_few_parameters_the_profiling_ones_grouped():
    params = inspect.signature(autopipe.partition).parameters
    assert list(params) == [
        "model", "n_gpus", "example_args", "example_kwargs", "loss_fn", "example_target", "schedule",
        "n_microbatches", "planner", "data_parallel",
    ]
    assert len(params) <= 12  # the rest lives in PlannerOptions, shared with Pipeline
    assert all(p.kind is p.KEYWORD_ONLY for p in list(params.values())[4:])


def test_pipeline_takes_its_options_grouped():
    params = inspect.signature(autopipe.Pipeline.__init__).parameters
    assert list(params)[1:] == [
        "model", "example_args", "example_kwargs", "example_target", "loss_fn", "plan", "split_points", "schedule",
        "n_microbatches", "planner", "data_parallel", "weights", "device", "timeout_s",
    ]
    assert len(params) - 1 <= 14
    assert all(p.kind is p.KEYWORD_ONLY for p in list(params.values())[2:])


def test_the_top_level_holds_the_entry_points_and_each_resolves_without_a_warning():
    assert autopipe.__all__ == [
        "partition", "Pipeline", "tune", "Plan", "Device", "ProfileOptions", "PlannerOptions", "DataParallelOptions",
        "simulate",
        "profile_scaling", "measure_link", "AutopipeError", "InfeasibleMemoryError", "PipelineStepError",
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for name in autopipe.__all__:
            assert getattr(autopipe, name).__name__ == name


PUBLIC_PACKAGES = ("autopipe", "autopipe.errors", "autopipe.machine", "autopipe.planning", "autopipe.layouts",
                   "autopipe.reporting", "autopipe.runtime", "autopipe.models", "autopipe.cli")


def test_the_public_surface_is_the_packages_all_and_stays_small():
    import ast
    import importlib
    from pathlib import Path

    names = 0
    for package in PUBLIC_PACKAGES:
        module = importlib.import_module(package)
        names += len(module.__all__)
        for name in module.__all__:  # each resolves to the object, not to a submodule of the same name
            assert not inspect.ismodule(getattr(module, name)), f"{package}.{name} is a module"
    assert names <= 120
    root = Path(autopipe.__file__).parent
    public_files = {root / "__init__.py", root / "errors.py"} | {root / p.split(".")[1] / "__init__.py"
                                                                   for p in PUBLIC_PACKAGES[2:]}
    declaring = [str(f.relative_to(root)) for f in root.rglob("*.py") if f not in public_files
                 and any(isinstance(n, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in n.targets)
                         for n in ast.parse(f.read_text()).body)]
    assert not declaring, f"internal modules declaring a public surface: {declaring}"


def test_an_unknown_top_level_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'partitions'"):
        autopipe.partitions  # noqa: B018


def test_importing_autopipe_does_not_import_torch():
    code = "import sys, autopipe; autopipe.Device; autopipe.ProfileOptions; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "False"


# --------------------------------------------------------------------------- the new keywords


def test_one_device_stands_for_every_rank_and_memory_fills_it_in(small_transformer, costs):
    model, args = small_transformer
    one = Device(bandwidth="10GB", latency_s=1e-5, action_overhead_s=1e-3)
    plan = autopipe.partition(model, 2, args, planner=PlannerOptions(cost=costs, memory="1GiB", devices=one))
    each = autopipe.partition(model, 2, args, planner=PlannerOptions(cost=costs, devices=[
        Device(memory="1GiB", bandwidth="10GB", latency_s=1e-5, action_overhead_s=1e-3) for _ in range(2)]))
    assert _figures(plan) == _figures(each)
    assert plan.action_overhead_s() == [1e-3, 1e-3] and plan.memory_limit_bytes == [2**30, 2**30]
    slow_link = autopipe.partition(model, 2, args,
                                   planner=PlannerOptions(cost=costs, devices=Device(bandwidth="1MB", action_overhead_s=1e-3)))
    assert slow_link.stages[0].comm_s > plan.stages[0].comm_s


def test_resolve_devices():
    two = resolve_devices(2, Device(speed=2.0), ["1GiB", "2GiB"])
    assert [d.speed for d in two] == [2.0, 2.0] and [d.memory for d in two] == [2**30, 2**31]
    assert two[0] is not two[1]
    assert resolve_devices(2, None, None) == [Device(), Device()]
    with pytest.raises(ValueError, match="not both"):
        resolve_devices(2, [Device(memory="1GiB"), Device()], "2GiB")
    with pytest.raises(ValueError, match="devices has 1 entries but n_gpus=2"):
        resolve_devices(2, [Device()], None)
    with pytest.raises(TypeError, match=r"devices\[1\]='gpu' is not an autopipe.Device"):
        resolve_devices(2, [Device(), "gpu"], None)
    with pytest.raises(TypeError, match="devices='gpu' must be an autopipe.Device"):
        resolve_devices(2, "gpu", None)


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(profiling={"warmup": 0}), TypeError, r"profiling=\{'warmup': 0\} must be an autopipe.ProfileOptions"),
    (dict(cost=3), TypeError, r"cost=3 must be one of \['measured', 'flops', 'params'\], a list"),
    (dict(cost=[1.0, 2.0]), TypeError, r"a list of one SegmentCost per segment"),
    (dict(cost="magic"), ValueError, "cost='magic' is not a cost source"),
    (dict(devices=4), TypeError, "devices=4 must be an autopipe.Device"),
])
def test_a_wrong_kind_of_argument_is_named_before_tracing(small_transformer, monkeypatch, kwargs, error, message):
    model, args = small_transformer
    monkeypatch.setattr(autopipe.planning.planner, "trace", lambda *a, **k: pytest.fail("traced first"))
    with pytest.raises(error, match=message):
        partition_with(model, 2, args, **kwargs)


def test_a_profile_of_one_size_with_auto_micro_batches_is_refused(small_transformer, costs):
    model, args = small_transformer
    with pytest.raises(ValueError, match="one micro-batch size's segment costs; with n_microbatches='auto'"):
        autopipe.partition(model, 2, args, n_microbatches="auto", planner=PlannerOptions(cost=costs, global_batch=8))


def test_a_size_scaled_profile_with_a_fixed_count_is_refused(small_transformer):
    from autopipe.planning.scaling import profile_scaling

    model, args = small_transformer
    scaled = profile_scaling(model, args, sizes=[1, 2], cost="flops", progress=False)
    with pytest.raises(ValueError, match=r"ScaledProfile, which is for n_microbatches='auto'.*costs_at\(b\)"):
        autopipe.partition(model, 2, args, n_microbatches=4, planner=PlannerOptions(cost=scaled))


@pytest.mark.parametrize("kwargs, message", [
    (dict(warmup=-1), "ProfileOptions warmup=-1 must be an integer >= 0"),
    (dict(repeats=0), "ProfileOptions repeats=0 must be an integer >= 1"),
    (dict(repeats=True), "ProfileOptions repeats=True must be an integer >= 1"),
    (dict(flush_cache=None), "ProfileOptions flush_cache=None must be True or False"),
    (dict(fit_to_whole=1), "ProfileOptions fit_to_whole=1 must be True, False or None"),
    (dict(progress="yes"), "ProfileOptions progress='yes' must be True or False"),
    (dict(device=0), "ProfileOptions device=0 must be None, a string"),
])
def test_profile_options_are_checked_where_they_are_written(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ProfileOptions(**kwargs)


def test_planner_options_are_checked_where_they_are_written():
    assert PlannerOptions.of(None) == PlannerOptions()
    with pytest.raises(TypeError, match="PlannerOptions profiling=.* must be an autopipe.ProfileOptions"):
        PlannerOptions(profiling={"warmup": 0})
    with pytest.raises(ValueError, match="PlannerOptions objective='fast'"):
        PlannerOptions(objective="fast")
    with pytest.raises(TypeError, match=r"planner=\{'memory': 1\} must be an autopipe.PlannerOptions"):
        PlannerOptions.of({"memory": 1})


# --------------------------------------------------------------------------- the previous release's keywords


# --------------------------------------------------------------------------- the shared checks


def test_check_int():
    assert check_int("n", 3) == 3 and check_int("n", np.int64(3)) == 3 and check_int("w", 0, 0) == 0
    for bad in (0, 2.5, "2", True, None):
        with pytest.raises(ValueError, match=rf"n={bad!r} must be an integer >= 1"):
            check_int("n", bad)
    with pytest.raises(ValueError, match=r"n=9 must be an integer >= 1 and <= 8 \(ranks\)"):
        check_int("n", 9, maximum=8, what="ranks")
    with pytest.raises(TypeError, match="n=1.5 must be an integer >= 1"):
        check_int("n", 1.5, not_int=TypeError)
    with pytest.raises(ValueError, match="n=0 must be"):
        check_int("n", 0, not_int=TypeError)  # out of range is a ValueError either way


def test_check_at_most_choice_and_bool():
    check_at_most("n_gpus", 8, 8, "ranks")
    with pytest.raises(ValueError, match="n_gpus=9 is more than autopipe plans for; use at most 8 ranks"):
        check_at_most("n_gpus", 9, 8, "ranks")
    assert check_choice("objective", "step", ("step", "bottleneck")) == "step"
    with pytest.raises(ValueError, match=r"objective=\['step'\] is not known; use one of \['step', 'bottleneck'\]"):
        check_choice("objective", ["step"], {"step": 1, "bottleneck": 2})
    check_bool("flag", False)
    check_bool("flag", None, allow_none=True)
    with pytest.raises(ValueError, match="flag=None must be True or False"):
        check_bool("flag", None)


def test_the_cost_source_names_the_command_line_offers_are_the_planners():
    from autopipe.planning.cost_sources import COST_SOURCES
    from autopipe.planning.options import COST_SOURCE_NAMES

    assert tuple(COST_SOURCES) == COST_SOURCE_NAMES
