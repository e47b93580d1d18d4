"""Device presets: published figures turned into Devices, and counted costs charged at their rates."""

from __future__ import annotations

import pytest

import autopipe
from autopipe import Device
from autopipe.machine.presets import ACCELERATORS, DEFAULT_EFFICIENCY, LINKS
from autopipe.models import seed_transformer

QUIET = autopipe.ProfileOptions(progress=False)


def test_a_preset_carries_the_data_sheet_memory_link_and_the_charged_share_of_the_peak():
    h100 = Device.preset("H100")
    assert h100.memory_bytes == 80e9 and h100.name == "H100"
    assert h100.flops == pytest.approx(DEFAULT_EFFICIENCY * ACCELERATORS["H100"].peak_flops["bf16"])
    assert (h100.bandwidth, h100.latency_s) == (LINKS["nvlink4"].bandwidth, LINKS["nvlink4"].latency_s)
    across = Device.preset("a100", dtype="fp32", efficiency=1.0, link="ib-hdr", memory="40GB")
    assert across.flops == 156e12 and across.bandwidth == 25e9 and across.memory_bytes == 40e9


@pytest.mark.parametrize("kw, match", [
    (dict(name="V100"), "name='V100'.*A100"),
    (dict(name="H100", dtype="int8"), "dtype='int8'.*bf16"),
    (dict(name="H100", efficiency=1.5), r"efficiency=1.5.*\(0, 1\]"),
    (dict(name="H100", link="ethernet"), "link='ethernet'.*nvlink4"),
])
def test_a_bad_preset_names_the_argument_and_what_is_known(kw, match):
    with pytest.raises(ValueError, match=match):
        Device.preset(kw.pop("name"), **kw)


def test_device_flops_must_be_a_positive_rate():
    with pytest.raises(ValueError, match="flops=-1"):
        Device(flops=-1)


def test_counted_costs_are_charged_at_the_presets_rate():
    model, args = seed_transformer(vocab_size=500, num_layers=4, seq_len=16)
    h100 = Device.preset("H100")
    plan = autopipe.partition(model, 2, args, n_microbatches=4, loss_fn=False,
                              planner=autopipe.PlannerOptions(cost="flops", devices=h100, profiling=QUIET))
    flops = sum(s.flops for s in plan.segments)
    fwd = sum(s.fwd_s for s in plan.segments)
    assert fwd == pytest.approx(flops / 3 / h100.flops)


def test_mixed_accelerators_get_speeds_from_their_rates():
    model, args = seed_transformer(vocab_size=500, num_layers=6, seq_len=16)
    devices = [Device.preset("A100"), Device.preset("H100")]
    plan = autopipe.partition(model, 2, args, n_microbatches=4, loss_fn=False,
                              planner=autopipe.PlannerOptions(cost="flops", devices=devices, profiling=QUIET))
    # The faster H100 runs the second stage: it gets the larger share of the compute.
    first, second = plan.stages
    assert second.fwd_s * (989 / 312) == pytest.approx(
        sum(s.fwd_s for s in plan.segments[second.first_segment:]), rel=1e-6)
    assert sum(s.flops for s in plan.segments[second.first_segment:]) > \
        sum(s.flops for s in plan.segments[:second.first_segment])


def test_some_devices_with_rates_and_some_without_are_refused():
    model, args = seed_transformer(vocab_size=100, num_layers=2, seq_len=8)
    with pytest.raises(ValueError, match=r"devices \[1\] give no flops"):
        autopipe.partition(model, 2, args, n_microbatches=2,
                           planner=autopipe.PlannerOptions(cost="flops", devices=[Device.preset("H100"), Device()], profiling=QUIET))
    with pytest.raises(ValueError, match="both speed and flops"):
        autopipe.partition(model, 2, args, n_microbatches=2,
                           planner=autopipe.PlannerOptions(cost="flops", devices=Device(flops=1e12, speed=2.0), profiling=QUIET))
