"""Pipeline x data parallel planned together: ``partition(..., global_batch=B, data_parallel="auto")``.

Costs are FLOP-counted once (a profile passed as ``cost=``), never measured time.
"""

from __future__ import annotations

import pytest

import autopipe
from autopipe import DataParallelOptions
from autopipe.machine.device import Device
from autopipe.machine.topology import Topology
from autopipe.models import seed_transformer
from autopipe.planning import costmodel
from autopipe.planning.plan import Plan
from autopipe.planning.profile import profile_segments
from autopipe.planning.tracing import trace
from autopipe.reporting.data import report_data
from autopipe.reporting.markdown import plan_to_markdown
from _planning import partition_with

pytestmark = pytest.mark.unit

QUIET = autopipe.ProfileOptions(progress=False)


@pytest.fixture(scope="module")
def model_costs():
    model, args = seed_transformer(vocab_size=100, num_layers=8, seq_len=16)  # micro-batch of 4 samples
    return model, args, profile_segments(trace(model, args), cost="flops", progress=False)


def _plan(model_costs, n_gpus=8, **kw):
    model, args, costs = model_costs
    return partition_with(model, n_gpus, args, cost=costs, profiling=QUIET, **kw)


@pytest.fixture(scope="module")
def ranked(model_costs):
    """8 GPUs of 15 MB: the model (about 20 MB per rank unsplit) fits from 2 pipeline stages on."""
    dev = Device(memory="15MB", action_overhead_s=1e-3, bandwidth=1e9, latency_s=1e-5)
    return _plan(model_costs, global_batch=32, data_parallel="auto", devices=dev)


def test_auto_ranks_every_factorization(ranked):
    rows = ranked.data_parallel.factorizations
    assert sorted((r.pp, r.dp) for r in rows) == [(1, 8), (2, 4), (4, 2), (8, 1)]
    usable = [r for r in rows if r.fits]
    assert [r.step_s for r in usable] == sorted(r.step_s for r in usable)  # fastest first
    assert all(r.peak_bytes and r.peak_bytes <= 15e6 for r in usable)
    one_stage = next(r for r in rows if r.pp == 1)
    assert not one_stage.fits and one_stage.reason.startswith("does not fit")
    assert one_stage.min_memory_bytes > 15e6  # the least memory it would need, for a study to show
    assert all(r.reason.startswith("slower") for r in usable[1:])
    best = usable[0]
    assert (ranked.pp_degree, ranked.dp_degree, ranked.dp_mode) == (best.pp, best.dp, "fsdp")
    assert ranked.n_microbatches == 32 // (best.dp * 4) and ranked.microbatch_size == 4
    assert ranked.data_parallel.reduction_s == pytest.approx(best.reduction_s) and best.reduction_s > 0
    text, markdown = ranked.report(), plan_to_markdown(report_data(ranked))
    for out in (text, markdown):
        assert "pipeline x data parallel" in out.lower()
        assert all(f"{r.pp} x {r.dp}" in out for r in rows)  # every factorization, with its step and memory
    assert "does not fit" in text and "slower" in text


def test_plan_file_round_trip(ranked, tmp_path):
    path = tmp_path / "plan.json"
    ranked.save(path)
    again = Plan.load(path)
    assert again == ranked and again.dp_degree == ranked.dp_degree and again.pp_degree == ranked.pp_degree
    old = ranked.to_dict()
    for key in ("dp_degree", "dp_mode", "data_parallel"):
        old.pop(key)
    assert Plan.from_dict(old).dp_degree == 1  # files without the fields are one replica


@pytest.mark.slow  # many plans: the unit lane keeps to quick checks
def test_slower_dp_link_chooses_deeper_pipelines(model_costs):
    """The reduction costs 2 (dp-1)/dp x (parameter bytes / pp) / bandwidth per step, so a slower
    link between nodes (which every dp group of 16 GPUs in nodes of 8 crosses) favours fewer
    replicas of longer pipelines, whose ranks each hold and reduce less; the pipeline sends stay
    inside a node on the fast link."""
    chosen = []
    for inter in (1e11, 1e8):
        topo = Topology(Device(action_overhead_s=0.0), gpus_per_node=8, intra=(1e11, 1e-6), inter=(inter, 1e-6))
        plan = _plan(model_costs, 16, global_batch=256, data_parallel="auto", devices=topo)
        assert plan.data_parallel.crossing in ("dp", "none")
        chosen.append(plan.pp_degree)
    assert chosen[1] > chosen[0]


@pytest.mark.slow  # many plans: the unit lane keeps to quick checks
def test_larger_global_batch_chooses_more_replicas(model_costs):
    """Per replica the step runs m = B / (dp x 4) micro-batches; the bubble and the reduction do not
    grow with B, but every micro-batch pays each action's overhead and its sends, so as B grows
    these per-micro-batch costs dominate and layouts with more replicas (fewer micro-batches
    each) win."""
    dev = Device(action_overhead_s=1e-3, bandwidth=3e8, latency_s=1e-5)
    small = _plan(model_costs, global_batch=32, data_parallel="auto", devices=dev)
    large = _plan(model_costs, global_batch=1024, data_parallel="auto", devices=dev)
    assert large.dp_degree > small.dp_degree


def test_default_is_todays_plan(model_costs):
    today = _plan(model_costs, 4)
    assert today.dp_degree == 1 and today.data_parallel is None and today.dp_mode == ""
    again = _plan(model_costs, 4, data_parallel=1)
    today.planner_s = again.planner_s = 0.0
    today.planning_peak_rss_bytes = again.planning_peak_rss_bytes = None
    assert again == today


def test_fixed_replicas_and_replicate_mode(model_costs):
    plan = _plan(model_costs, global_batch=64, data_parallel=DataParallelOptions(degree=2, mode="replicate"))
    assert (plan.pp_degree, plan.dp_degree, plan.dp_mode) == (4, 2, "replicate")
    assert [r.dp for r in plan.data_parallel.factorizations] == [2]


@pytest.mark.parametrize("kw, match", [
    (dict(data_parallel=3, global_batch=48), "data_parallel=3 is not accepted"),
    (dict(data_parallel="most", global_batch=48), "data_parallel='most'"),
    (dict(data_parallel=2), "needs global_batch"),
    (dict(data_parallel=DataParallelOptions(2, "ddp"), global_batch=64), "DataParallelOptions mode='ddp'"),
    (dict(data_parallel=DataParallelOptions(2, mesh=object()), global_batch=64), "is for a Pipeline"),
    (dict(data_parallel=2, global_batch=64, n_microbatches=4), "n_microbatches=4 cannot be fixed"),
    (dict(data_parallel="auto", global_batch=6), "global_batch=6 does not split"),
    (dict(data_parallel=2, global_batch=64, devices=[Device()] * 4), "one Device"),
])
def test_errors_before_any_work(model_costs, kw, match, monkeypatch):
    monkeypatch.setattr("autopipe.planning.planner.trace", lambda *a, **k: pytest.fail("traced before the check"))
    with pytest.raises(ValueError, match=match):
        _plan(model_costs, **kw)


def test_data_parallel_of_another_kind_is_named(model_costs):
    with pytest.raises(TypeError, match=r"data_parallel=2.0 must be a replica count, 'auto' or an "
                                        r"autopipe.DataParallelOptions"):
        _plan(model_costs, data_parallel=2.0, global_batch=64)


def test_cost_model_terms():
    assert costmodel.ring_collective_s(1e9, 1, 1e9, 1e-3) == 0.0
    assert costmodel.dp_reduction_s("replicate", 8e9, 4, 1e10, 0.0) == pytest.approx(2 * 0.75 * 0.8)
    assert costmodel.dp_optimizer_factor(2.0, 8, "fsdp") == pytest.approx(0.5)
    with pytest.raises(ValueError, match="mode='ddp'"):
        costmodel.dp_reduction_s("ddp", 1.0, 2, 1.0, 0.0)


def test_topology_layout():
    topo = Topology(gpus_per_node=8, intra="nvlink4", inter="ib-ndr")
    assert topo.crossing(pp=8, dp=2) == "dp" and topo.crossing(pp=16, dp=1) == "pp"
    assert topo.dp_link(pp=4, dp=2) == topo.intra_link and topo.dp_link(pp=4, dp=4) == topo.inter_link
    assert [d.bandwidth for d in topo.pipeline_devices(16)].count(50e9) == 1  # the send from rank 7 to 8
    with pytest.raises(ValueError, match="inter='ib-xyz'"):
        Topology(inter="ib-xyz")


def test_every_layout_is_planned_from_one_trace(model_costs, monkeypatch):
    from autopipe.planning import tracing as trace_module

    exports = []
    real = trace_module._trace
    monkeypatch.setattr(trace_module, "_trace", lambda *a, **k: exports.append(1) or real(*a, **k))
    model, args, costs = model_costs
    untraced = (model, args, list(costs))  # costs without the trace they were measured on: planning traces
    plan = _plan(untraced, global_batch=32, data_parallel="auto")
    assert len(plan.data_parallel.factorizations) == 4 and len(exports) == 1
    _plan(model_costs, global_batch=32, data_parallel="auto")  # the profile's own trace: nothing exported
    assert len(exports) == 1
    trace_module.trace(model, args)  # outside one planning call, every trace exports
    assert len(exports) == 2


def test_when_no_layout_fits_the_error_carries_every_layout_and_its_least_memory(model_costs):
    from autopipe.errors import InfeasibleMemoryError

    dev = Device(memory="1MB", action_overhead_s=1e-3, bandwidth=1e9, latency_s=1e-5)
    with pytest.raises(InfeasibleMemoryError, match="no pp x dp factorization of n_gpus=8 fits") as info:
        _plan(model_costs, global_batch=32, data_parallel="auto", devices=dev)
    rows = info.value.factorizations
    assert sorted((r.pp, r.dp) for r in rows) == [(1, 8), (2, 4), (4, 2), (8, 1)]
    assert all(not r.fits and r.min_memory_bytes > 1e6 for r in rows)
    assert info.value.min_memory_bytes == min(r.min_memory_bytes for r in rows)
