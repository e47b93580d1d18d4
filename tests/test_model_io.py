"""The first stage gets each input by name; loss_fn and forward() get what the unsplit model returns."""

from __future__ import annotations

import functools

import pytest
import torch

from autopipe.runtime.model_io import ModelIO

import _io_workers as workers
from _dist_utils import run_world


# ---------------------------------------------------------------------- ModelIO alone
def test_keywords_are_flattened_in_traced_order_whatever_the_call_order():
    io = ModelIO.from_example((torch.zeros(1),), {"a": torch.zeros(1), "b": torch.zeros(1)}, None)
    flat = io.flatten_inputs((torch.tensor([0.0]),), {"b": torch.tensor([2.0]), "a": torch.tensor([1.0])})
    assert [t.item() for t in flat] == [0.0, 1.0, 2.0]


def test_a_missing_or_unknown_keyword_is_named_in_the_error():
    io = ModelIO.from_example((), {"mask": torch.zeros(1)}, None)
    with pytest.raises(ValueError, match=r"missing \['mask'\], unknown \['masks'\]"):
        io.flatten_inputs((), {"masks": torch.zeros(1)})


def test_differently_nested_inputs_are_refused():
    io = ModelIO.from_example(((torch.zeros(1), torch.zeros(1)),), {}, None)
    with pytest.raises(ValueError, match="structured as"):
        io.flatten_inputs((torch.zeros(1), torch.zeros(1)), {})


def test_output_is_rebuilt_in_the_models_structure():
    model = workers.LateKeywordDictOutput()
    x = torch.zeros(2, workers.WIDTH)
    exported = torch.export.export(model, (x,), {"scale": x, "decoder_input": x})
    io = ModelIO.from_example((x,), {"scale": x, "decoder_input": x}, exported)
    out = io.unflatten_output((torch.ones(1), torch.zeros(1)))
    assert isinstance(out, dict) and set(out) == {"logits", "memory"}


# ---------------------------------------------------------------------- 2 ranks
@functools.lru_cache(maxsize=None)
def swapped(schedule: str, split: str) -> tuple:
    return tuple(run_world(workers.swapped_inputs_run, 2, schedule, split, timeout_s=240))


@functools.lru_cache(maxsize=None)
def keyword_dict(schedule: str, reorder: bool) -> tuple:
    return tuple(run_world(workers.keyword_dict_run, 2, schedule, reorder, timeout_s=240))


@pytest.mark.distributed
@pytest.mark.parametrize("split", ["block", "head"])
def test_inputs_used_out_of_order_train_on_the_right_inputs(split):
    for r in swapped("1F1B", split):
        # The swapped loss differs clearly, so equality below cannot happen by chance.
        assert abs(r["swapped_loss"] - r["ref_loss"]) > 1e-3
        assert abs(r["loss"] - r["ref_loss"]) <= 1e-5
        assert max(r["grad_diff"].values()) <= 1e-5


@pytest.mark.distributed
@pytest.mark.parametrize("schedule", ["1F1B", "GPipe"])
@pytest.mark.parametrize("reorder", [False, True])
def test_keyword_read_by_a_later_stage_is_relayed_and_matched_by_name(schedule, reorder):
    for r in keyword_dict(schedule, reorder):
        assert abs(r["loss"] - r["ref_loss"]) <= 1e-5
        assert max(r["grad_diff"].values()) <= 1e-5


@pytest.mark.distributed
def test_loss_fn_and_forward_get_the_models_dict_output():
    results = keyword_dict("1F1B", False)
    last = results[-1]
    assert last["loss_fn_saw"] == ["dict"]
    assert last["output_type"] == "dict" and last["output_diff"] <= 1e-6
    assert results[0]["output_type"] is None  # forward() returns the output on the last stage's rank only


@functools.lru_cache(maxsize=None)
def bad_batches() -> tuple:
    return tuple(run_world(workers.bad_batches_run, 2, timeout_s=240))


@pytest.mark.distributed
def test_a_non_tensor_input_other_than_traced_is_refused_on_every_rank():
    for r in bad_batches():
        assert "input double=False" in r["flag"] and "traced with True" in r["flag"]


@pytest.mark.distributed
def test_a_batch_of_another_dtype_is_refused_on_every_rank_and_the_pipeline_steps_on():
    for r in bad_batches():
        assert "input args[0] has dtype torch.float64" in r["dtype"] and "torch.float32" in r["dtype"]
        assert isinstance(r["still_steps"], float)


@pytest.mark.distributed
def test_a_float64_models_loss_comes_back_as_float64_on_every_rank():
    for r in run_world(workers.float64_run, 2, timeout_s=240):
        assert r["dtype"] == "torch.float64"
        assert r["diff"] <= 1e-12  # float32 would round it at about 1e-8


@pytest.mark.distributed
def test_batchnorm_equals_the_unsplit_model_run_micro_batch_by_micro_batch():
    for r in run_world(workers.batchnorm_run, 2, timeout_s=240):
        assert abs(r["loss"] - r["ref_loss"]) <= 1e-5
        assert max(r["grad_diff"].values()) <= 1e-5
        assert r["stats_diff"] is not None and r["stats_diff"] <= 1e-6  # running statistics too
        assert abs(r["whole_batch_loss"] - r["ref_loss"]) > 1e-4  # one pass over the batch is different
