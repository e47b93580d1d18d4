"""The default link between co-located CPU ranks: assumed, or measured where it decides the split.

Unit tests hand the planner a link through the seams (``choose_link``'s and
``loopback_link``'s ``measure=``, ``remember_link``) and inject segment costs, so nothing
is timed; one distributed-lane test runs the real measurement.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import autopipe
from autopipe import Device, ProfileOptions
from autopipe.machine.device import CPU_STEP_MESSAGE_S, default_link
from autopipe.machine.link import LinkMeasurement
from autopipe.planning.cost_sources import COST_SOURCES
from autopipe.machine.link_cache import (cache_file, forget_links, host_key, loopback_link, measure_in_fresh_process,
                                          remember_link)
from autopipe.planning.costgraph import SegmentCost
from autopipe.planning.link_choice import FREE_LINK, choose_link, link_mode
from autopipe.planning.plan import Plan
from _planning import partition_with

#: The assumed CPU link: 2 GB/s, and a message as it costs inside a step.
ASSUMED = default_link("cpu")
WIDE = 50_000  # the one wide tensor: 2 x 50000 float32 = 400 kB across the balanced cut


def fake_link(bandwidth: float = 1e12, latency_s: float = 1e-6) -> LinkMeasurement:
    """A measurement as ``measure_link`` returns one, with the figures given."""
    sizes = [1024, 1 << 20]
    times = [latency_s + s / bandwidth for s in sizes]
    return LinkMeasurement(bandwidth, latency_s, sizes, times, [[t] for t in times], 0.0, "gloo", ("cpu", "cpu"))


class Counted:
    """A ``measure`` seam that counts its calls."""

    def __init__(self, link: LinkMeasurement | None = None) -> None:
        self.link = link or fake_link()
        self.calls = 0

    def __call__(self) -> LinkMeasurement:
        self.calls += 1
        return self.link


def never_measure() -> LinkMeasurement:
    raise AssertionError("the link was measured where it should not have been")


@pytest.fixture(autouse=True)
def _clean_link_state(tmp_path, monkeypatch):
    """No measurement kept across tests; the cache file, when a test turns it on, in tmp_path."""
    monkeypatch.setenv("AUTOPIPE_CACHE_DIR", str(tmp_path / "cache"))
    forget_links()
    yield
    forget_links()


def wide_cut_model() -> tuple[nn.Module, tuple[torch.Tensor]]:
    """Four layers of equal (injected) cost; the balanced 2-stage cut carries the one wide tensor."""
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, WIDE), nn.Linear(WIDE, 8), nn.Linear(8, 8))
    return model, (torch.randn(2, 8),)


def equal_costs(n: int = 4) -> list[SegmentCost]:
    return [SegmentCost(fwd_s=1e-4, bwd_s=2e-4, param_bytes=288, act_bytes=64, out_bytes=64) for _ in range(n)]


def plan_wide(**profiling) -> Plan:
    model, args = wide_cut_model()
    return autopipe.partition(model, 2, example_args=args, schedule="1F1B", n_microbatches=4, loss_fn=False,
                              planner=autopipe.PlannerOptions(cost=equal_costs(), profiling=ProfileOptions(progress=False, **profiling)))


# ---------------------------------------------------------------- choose_link


def test_the_same_split_with_free_communication_measures_nothing_and_says_so():
    seen = []

    def search(link):
        seen.append(link)
        return "plan", (2,)

    choice, result = choose_link(search, assumed=ASSUMED, mode="auto", measure=never_measure)
    assert result == "plan" and seen == [ASSUMED, FREE_LINK]
    assert choice.source == "assumed" and choice.link == ASSUMED and choice.measurement is None
    assert "assumed" in choice.note() and "same with free communication" in choice.note()


def by_link(link):
    """A search whose split moves when a byte costs more than 0.2 ns."""
    cuts = (2,) if 1 / link[0] < 2e-10 else (1,)
    return ("plan", cuts), cuts


def test_a_different_split_charges_the_link_measured_before_and_planning_never_measures():
    measure = Counted()
    choice, (_, cuts) = choose_link(by_link, assumed=ASSUMED, mode="auto", measure=measure, known=lambda: None)
    assert measure.calls == 0 and cuts == (1,) and choice.source == "assumed"
    assert "[1]" in choice.reason and "[2]" in choice.reason and "autopipe measure" in choice.reason
    link = fake_link()
    choice, (_, cuts) = choose_link(by_link, assumed=ASSUMED, mode="auto", known=lambda: link)
    assert cuts == (2,) and choice.measurement is link
    # An idle ping-pong's 1 us is what the wire costs; inside a step a CPU message costs more.
    assert choice.source == "measured" and choice.link == (1e12, CPU_STEP_MESSAGE_S)
    assert "measured on this host" in choice.note()


def test_the_cache_file_keeps_the_link_for_later_processes(monkeypatch, tmp_path):
    monkeypatch.setenv("AUTOPIPE_LINK_CACHE", "1")
    path = cache_file()
    assert path == tmp_path / "cache" / "links.json"
    first = loopback_link("cpu", measure=Counted(fake_link(3e9, 2e-5)))
    stored = json.loads(path.read_text())
    assert list(stored) == [f"{host_key()}|cpu"]
    forget_links()  # as a new process would start: only the file holds it
    assert loopback_link("cpu", measure=never_measure) == first


def test_autopipe_link_cache_0_turns_the_file_off(monkeypatch, tmp_path):
    monkeypatch.setenv("AUTOPIPE_LINK_CACHE", "0")
    assert cache_file() is None
    measure = Counted()
    loopback_link("cpu", measure=measure)
    forget_links()
    loopback_link("cpu", measure=measure)
    assert measure.calls == 2 and not (tmp_path / "cache").exists()


@pytest.mark.parametrize("content", ["{not json", "[1, 2]", json.dumps({"KEY": {"bandwidth_bytes_per_s": 1}}),
                                     json.dumps({"KEY": {"bandwidth_bytes_per_s": -1.0}})])
def test_a_damaged_cache_file_is_ignored_and_rewritten(monkeypatch, content):
    monkeypatch.setenv("AUTOPIPE_LINK_CACHE", "1")
    path = cache_file()
    path.parent.mkdir(parents=True)
    path.write_text(content.replace("KEY", f"{host_key()}|cpu"))
    measure = Counted()
    assert loopback_link("cpu", measure=measure) == measure.link and measure.calls == 1
    forget_links()
    assert loopback_link("cpu", measure=never_measure) == measure.link  # the file holds a good entry again


def test_remember_link_hands_the_planner_a_link_and_checks_its_type():
    remember_link(fake_link(4e9))
    assert loopback_link("cpu", measure=never_measure).bandwidth_bytes_per_s == 4e9
    with pytest.raises(TypeError, match="link=.*LinkMeasurement"):
        remember_link({"bandwidth_bytes_per_s": 4e9})


def test_a_measure_seam_must_return_a_measurement_and_the_device_type_is_checked():
    with pytest.raises(TypeError, match="measure returned"):
        loopback_link("cpu", measure=lambda: (1e9, 1e-4), use_file=False)
    with pytest.raises(ValueError, match="device_type='mps'"):
        loopback_link("mps", measure=never_measure)


def test_a_failed_measurement_asked_for_raises():
    def broken():
        raise RuntimeError("the link measurement failed:\nrank 1 died")

    with pytest.raises(RuntimeError, match="rank 1 died"):
        choose_link(by_link, assumed=ASSUMED, mode="always", measure=broken)


def test_modes():
    measure = Counted()
    assert choose_link(by_link, assumed=ASSUMED, mode="never", measure=measure)[0].source == "assumed"
    assert measure.calls == 0
    choice, _ = choose_link(lambda link: ("plan", (1,)), assumed=ASSUMED, mode="always", measure=measure)
    assert choice.source == "measured" and measure.calls == 1  # measured even though the split cannot move
    with pytest.raises(ValueError, match="mode='sometimes'.*'auto', 'always', 'never'"):
        choose_link(by_link, assumed=ASSUMED, mode="sometimes")


# ---------------------------------------------------------------- LinkMeasurement.from_dict


def test_link_measurement_round_trips_through_a_dict_and_json():
    link = fake_link(5e9, 3e-5)
    assert LinkMeasurement.from_dict(json.loads(json.dumps(link.to_dict()))) == link


@pytest.mark.parametrize("change, message", [
    (lambda d: d.pop("latency_s"), r"missing \['latency_s'\]"),
    (lambda d: d.update(bandwidth_bytes_per_s=0.0), "bandwidth_bytes_per_s=0.0 must be a finite number > 0"),
    (lambda d: d.update(bandwidth_bytes_per_s="fast"), "bandwidth_bytes_per_s='fast'"),
    (lambda d: d.update(latency_s=-1e-6), "latency_s=-1e-06 must be a finite number >= 0"),
    (lambda d: d.update(latency_s=float("inf")), "latency_s=inf"),
])
def test_link_measurement_from_dict_names_the_bad_field(change, message):
    raw = fake_link().to_dict()
    change(raw)
    with pytest.raises(ValueError, match=message):
        LinkMeasurement.from_dict(raw)


def test_link_measurement_from_dict_refuses_what_is_not_a_dict():
    with pytest.raises(ValueError, match="needs the fields"):
        LinkMeasurement.from_dict([1, 2])


# ---------------------------------------------------------------- link_mode


def mode_of(measure_link=None, *, device_type="cpu", cost_source="measured", devices=(Device(), Device()),
            in_process_group=False) -> tuple[str, str]:
    return link_mode(measure_link, device_type=device_type, cost_source=COST_SOURCES[cost_source],
                     devices=list(devices), in_process_group=in_process_group)


@pytest.mark.parametrize("kwargs, mode, why", [
    ({}, "auto", "may decide the split"),
    ({"devices": [Device(bandwidth=1e10), Device()]}, "never", "a Device gives its link"),
    ({"devices": [Device(latency_s=1e-5)] * 2}, "never", "a Device gives its link"),
    ({"cost_source": "flops"}, "never", "estimated"),
    ({"cost_source": "params"}, "never", "estimated"),
    ({"device_type": "cuda"}, "never", "cuda ranks"),
    ({"in_process_group": True}, "never", "process group"),
    ({"devices": [Device()]}, "never", "one rank"),
    ({"measure_link": False}, "never", "measure_link=False"),
    ({"measure_link": True}, "always", "measure_link=True"),
    ({"measure_link": True, "device_type": "cuda", "in_process_group": True}, "always", "measure_link=True"),
    ({"measure_link": True, "cost_source": "flops"}, "always", "measure_link=True"),
    ({"measure_link": True, "devices": [Device(bandwidth=1e10, latency_s=1e-5)] * 2}, "never", "every Device"),
    ({"measure_link": True, "devices": [Device()]}, "never", "one rank"),
])
def test_link_mode_for_each_condition(kwargs, mode, why, monkeypatch):
    monkeypatch.setenv("AUTOPIPE_MEASURE_LINK", "1")  # the suite turns it off (conftest.py)
    got, reason = mode_of(**kwargs)
    assert got == mode and why in reason


def test_the_environment_turns_the_automatic_measurement_off(monkeypatch):
    monkeypatch.setenv("AUTOPIPE_MEASURE_LINK", "0")
    assert mode_of() == ("never", "AUTOPIPE_MEASURE_LINK=0")
    assert mode_of(True)[0] == "always"  # asked for by name: the environment does not overrule it
    monkeypatch.setenv("AUTOPIPE_MEASURE_LINK", "1")
    assert mode_of()[0] == "auto"


@pytest.mark.parametrize("bad", ["yes", 1, 0.0])
def test_a_bad_measure_link_names_the_field(bad):
    with pytest.raises(ValueError, match=rf"ProfileOptions measure_link={bad!r} must be True, False or None"):
        ProfileOptions(measure_link=bad)
    with pytest.raises(ValueError, match="measure_link"):
        mode_of(bad)


def test_measure_link_true_on_a_device_type_without_a_loopback_measurement_says_what_to_do():
    with pytest.raises(ValueError, match="measure_link=True.*'mps'.*Device\\(bandwidth="):
        mode_of(True, device_type="mps")


# ---------------------------------------------------------------- the planner


def test_the_assumed_link_moves_the_wide_cut_and_free_communication_does_not():
    """The premise of the tests below: with these costs the link decides the split."""
    model, args = wide_cut_model()
    kwargs = dict(example_args=args, cost=equal_costs(), schedule="1F1B", n_microbatches=4, loss_fn=False,
                  profiling=ProfileOptions(progress=False, measure_link=False))
    assumed = partition_with(model, 2, **kwargs)
    free = partition_with(model, 2, devices=Device(bandwidth=1e15, latency_s=0.0), **kwargs)
    assert assumed.split_points != free.split_points == ["2"]
    assert not any("link" in n for n in assumed.notes)  # measure_link=False: the plan keeps quiet


def test_a_measured_link_is_recorded_in_the_plan_its_notes_and_its_file(tmp_path):
    remember_link(fake_link(1e12, 1e-6))
    plan = plan_wide(measure_link=True)
    assert plan.split_points == ["2"]
    assert [(lk.bandwidth, lk.latency_s) for lk in plan.links()] == [(1e12, CPU_STEP_MESSAGE_S)]
    note = [n for n in plan.notes if n.startswith("link between ranks")]
    assert note == ["link between ranks measured on this host: 1e+03 GB/s and 500 us per message (idle 1 us; a "
                    "message inside a step waits for a core) (ProfileOptions(measure_link=True))"]
    assert note[0] in plan.report()
    # The report re-costs on the recorded link: the same step the search predicted.
    assert plan.simulated_step_s() == pytest.approx(plan.predicted_step_s, rel=1e-9)
    plan.save(tmp_path / "plan.json")
    loaded = Plan.load(tmp_path / "plan.json")
    assert loaded.links() == plan.links() and note[0] in loaded.notes


def test_the_automatic_choice_measures_when_the_link_decides_and_says_both_splits(monkeypatch):
    monkeypatch.setenv("AUTOPIPE_MEASURE_LINK", "1")
    remember_link(fake_link(1e12, 1e-6))
    plan = plan_wide()
    assert plan.split_points == ["2"] and plan.links()[0].bandwidth == 1e12
    note = next(n for n in plan.notes if n.startswith("link between ranks"))
    assert note.startswith("link between ranks measured on this host") and "gave the split ['3'] (1F1B, 4 micro-batches), free communication ['2'] (1F1B, 4 micro-batches)" in note


def test_without_a_measurement_the_plan_keeps_the_assumed_link_and_says_how_to_measure(monkeypatch):
    monkeypatch.setenv("AUTOPIPE_MEASURE_LINK", "1")
    monkeypatch.setenv("AUTOPIPE_LINK_CACHE", "0")
    plan = plan_wide()  # nothing kept: planning starts no process (the unit lane would fail on one)
    assert plan.links()[0].bandwidth == ASSUMED[0] and plan.split_points != ["2"]
    note = next(n for n in plan.notes if n.startswith("link between ranks"))
    assert note.startswith("link between ranks assumed") and "run `autopipe measure`" in note


def test_the_automatic_choice_keeps_the_assumed_link_where_it_decides_nothing(monkeypatch):
    monkeypatch.setenv("AUTOPIPE_MEASURE_LINK", "1")
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])  # every cut 64 bytes: the link cannot matter
    plan = autopipe.partition(model, 2, example_args=(torch.randn(2, 8),), schedule="1F1B", n_microbatches=4,
                              loss_fn=False,
                              planner=autopipe.PlannerOptions(cost=equal_costs(), profiling=ProfileOptions(progress=False)))
    # Nothing was kept, so a measurement would have started a process: the unit lane fails on that.
    assert plan.links()[0].bandwidth == ASSUMED[0]
    assert "link between ranks assumed: 2 GB/s and 500 us per message (the split is the same with free " \
           "communication)" in plan.notes


def test_a_plan_made_with_the_measurement_off_by_environment_keeps_the_assumed_link():
    remember_link(fake_link(1e12, 1e-6))  # kept, yet not used: conftest sets AUTOPIPE_MEASURE_LINK=0
    plan = plan_wide()
    assert plan.split_points != ["2"] and plan.links()[0].bandwidth == ASSUMED[0]
    assert not any(n.startswith("link between ranks") for n in plan.notes)


def test_planning_inside_a_process_group_keeps_the_assumed_link(monkeypatch, tmp_path):
    """As Pipeline plans, on rank 0 of its group: the other ranks wait, so nothing is measured."""
    import torch.distributed as dist

    monkeypatch.setenv("AUTOPIPE_MEASURE_LINK", "1")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        plan = plan_wide()  # nothing kept: a measurement would start a process, which fails the unit lane
    finally:
        dist.destroy_process_group()
    assert plan.links()[0].bandwidth == ASSUMED[0]
    assert not any(n.startswith("link between ranks") for n in plan.notes)


# ---------------------------------------------------------------- the real measurement


@pytest.mark.distributed
def test_the_planner_measures_this_hosts_link_for_real_when_asked(monkeypatch):
    """Two spawned gloo processes (from a fresh interpreter) measure the loopback link once;
    the plan charges it and its notes say so."""
    monkeypatch.setenv("AUTOPIPE_LINK_CACHE", "0")
    plan = plan_wide(measure_link=True)
    note = next(n for n in plan.notes if n.startswith("link between ranks"))
    assert note.startswith("link between ranks measured on this host"), note
    kept = loopback_link("cpu", measure=never_measure, use_file=False)
    assert kept.backend == "gloo" and kept.bandwidth_bytes_per_s > 0
    assert plan.links()[0].bandwidth == kept.bandwidth_bytes_per_s


@pytest.mark.distributed
def test_a_measurement_that_fails_in_the_fresh_interpreter_raises_with_its_output():
    with pytest.raises(RuntimeError, match=r"(?s)the link measurement failed \(exit code 1\):.*device='tpu' is not a torch device"):
        measure_in_fresh_process("tpu", timeout_s=120)
