"""A model built on the meta device: each rank materializes, initializes or loads only its own stages.

Unit tests check the pieces in this process (the sentinel check, the default init, reading
weights from a dict, a .safetensors file and a DCP directory); the distributed ones run
``Pipeline``s from meta models on 2 gloo ranks against the unsplit model.
"""

from __future__ import annotations

import functools
import math
import warnings

import pytest
import torch
import torch.nn as nn

from autopipe.runtime.materialize import (UnwrittenTensorsError, check_weight_arguments, default_init,
                                          materialize_rank, read_weights)
from autopipe.runtime.params import model_state_names

import _materialize_workers as workers
from _dist_utils import run_world

TOL = 1e-5


def _tied_meta() -> nn.Module:
    with torch.device("meta"):
        model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 4), nn.Linear(4, 10, bias=False))
    model[2].weight = model[0].weight
    return model


# ---------------------------------------------------------------------- unit
@pytest.mark.unit
def test_only_the_requested_tensors_become_real_and_ties_point_at_one_tensor():
    model = _tied_meta()
    names = model_state_names(model)
    local, extra = materialize_rank(model, names, ["0.weight"], device=torch.device("cpu"), extra=["1.bias"])
    assert set(local) == {"0.weight"} and set(extra) == {"1.bias"}
    assert not local["0.weight"].is_meta and isinstance(local["0.weight"], nn.Parameter)
    assert all(t.is_meta for t in model.parameters()), "the user's model stays on the meta device"


@pytest.mark.unit
def test_the_default_init_does_not_depend_on_which_other_tensors_are_real():
    model = _tied_meta()
    names = model_state_names(model)
    alone, _ = materialize_rank(model, names, ["1.weight"], device=torch.device("cpu"))
    together, _ = materialize_rank(model, names, ["0.weight", "1.weight", "1.bias"], device=torch.device("cpu"))
    assert torch.equal(alone["1.weight"], together["1.weight"])
    real = nn.Sequential(nn.Linear(3, 3))
    before = real[0].weight.clone()
    assert default_init(real) == ["0"] and not torch.equal(before, real[0].weight)


@pytest.mark.unit
def test_tensors_no_init_writes_are_an_error_naming_them_and_the_fix():
    class Table(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("pe", torch.arange(4.0))
            self.lin = nn.Linear(4, 4)

    with torch.device("meta"):
        model = Table()
    names = model_state_names(model)
    with pytest.raises(UnwrittenTensorsError, match=r"\['pe'\].*give weights= \(a function init\(model\)"):
        materialize_rank(model, names, ["pe", "lin.weight"], device=torch.device("cpu"))
    # A hook that writes it, or weights holding it, fix it.
    local, _ = materialize_rank(model, names, ["pe"], device=torch.device("cpu"),
                                init_weights=lambda m: m.pe.copy_(torch.arange(4.0)))
    assert torch.equal(local["pe"], torch.arange(4.0))


@pytest.mark.unit
def test_weights_missing_a_tensor_or_of_another_shape_are_refused():
    model = _tied_meta()
    names = model_state_names(model)
    with pytest.raises(KeyError, match=r"lacks 1 tensors.*\['1.bias'\]"):
        materialize_rank(model, names, ["1.weight", "1.bias"], device=torch.device("cpu"),
                         weights={"1.weight": torch.ones(4, 4)})
    with pytest.raises(ValueError, match=r"'1.weight' has shape \(2, 2\)"):
        materialize_rank(model, names, ["1.weight"], device=torch.device("cpu"), weights={"1.weight": torch.ones(2, 2)})
    # Any alias of a tied tensor will do.
    local, _ = materialize_rank(model, names, ["0.weight"], device=torch.device("cpu"),
                                weights={"2.weight": torch.ones(10, 4)})
    assert torch.equal(local["0.weight"], torch.ones(10, 4))


@pytest.mark.unit
def test_weights_are_read_from_a_safetensors_file_and_a_dcp_directory(tmp_path):
    safetensors = pytest.importorskip("safetensors.torch")
    import torch.distributed.checkpoint as dcp

    state = nn.Linear(3, 2).state_dict()
    safetensors.save_file(state, str(tmp_path / "m.safetensors"))
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    for source in (tmp_path / "m.safetensors", str(tmp_path / "dcp")):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            got = read_weights(source, {"weight": ["weight"], "gone": ["gone"]})
        assert set(got) == {"weight"} and torch.equal(got["weight"], state["weight"])


@pytest.mark.unit
def test_bad_weight_arguments_are_refused_naming_them(tmp_path):
    with pytest.raises(TypeError, match="weights=3 as an init function must be callable"):
        check_weight_arguments(_tied_meta(), 3, None)
    with pytest.raises(ValueError, match="holds values already"):
        check_weight_arguments(nn.Linear(2, 2), lambda m: None, None)
    with pytest.raises(TypeError, match="weights must be"):
        check_weight_arguments(_tied_meta(), None, 5)
    with pytest.raises(FileNotFoundError, match="no such file"):
        check_weight_arguments(_tied_meta(), None, str(tmp_path / "nothing.safetensors"))


# ---------------------------------------------------------------------- distributed
@functools.lru_cache(maxsize=None)
def _seed_results(directory: str) -> list[dict]:
    return run_world(workers.seed_run, 2, f"{directory}/model.safetensors", f"{directory}/dcp", timeout_s=500)


@pytest.fixture(scope="module")
def seed_results(tmp_path_factory):
    safetensors = pytest.importorskip("safetensors.torch")
    import torch.distributed.checkpoint as dcp

    directory = tmp_path_factory.mktemp("weights")
    state = workers.seed_model(meta=False).state_dict()
    safetensors.save_file({k: v.contiguous() for k, v in state.items()}, str(directory / "model.safetensors"))
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, checkpoint_id=str(directory / "dcp"), no_dist=True)
    return _seed_results(str(directory))


def _check_equal_to_unsplit(per_rank: list[dict]) -> None:
    for result in per_rank:
        assert math.isclose(result["loss"], result["ref_loss"], abs_tol=TOL)
        assert result["grad_diff"] and max(result["grad_diff"].values()) <= TOL
    held = set().union(*(r["grad_diff"] for r in per_rank))
    assert held == set(per_rank[0]["all_param_names"])


@pytest.mark.parametrize("case", ["dict-1F1B-planned", "dict-ZBV", "safetensors-Interleaved", "dcp-1F1B"])
def test_a_meta_model_loaded_by_each_rank_trains_as_the_unsplit_model(seed_results, case):
    _check_equal_to_unsplit([r[case] for r in seed_results])


def test_an_init_function_as_weights_gives_the_values_every_rank_trains_from(seed_results):
    _check_equal_to_unsplit([r["hook-1F1B"] for r in seed_results])


def test_weights_replace_the_values_of_a_real_model(seed_results):
    _check_equal_to_unsplit([r["real-model-dict"] for r in seed_results])


def test_the_eval_trace_of_a_meta_model_reads_the_loaded_tensors(seed_results):
    for result in (r["dropout-eval"] for r in seed_results):
        assert result["loss"] == pytest.approx(result["ref_loss"], abs=TOL)


def test_a_tensor_the_default_init_leaves_unwritten_fails_the_first_step_and_saves_on_every_rank_until_loaded(
        tmp_path):
    results = run_world(workers.unwritten_run, 2, str(tmp_path / "ckpt"), timeout_s=200)
    first = [r["first_step"] for r in results]
    assert first[0].startswith("UnwrittenTensorsError") and "pos_encoding.pe" in first[0]
    assert first[1].startswith("PipelineStepError: step() call 1 was refused on rank 0") and "pos_encoding.pe" in first[1]
    for what, words in (("full_state_dict", "before you gather the full state dict"),
                        ("save_checkpoint", "before you save a checkpoint")):
        assert results[0][what].startswith("UnwrittenTensorsError") and words in results[0][what]
        assert results[1][what].startswith("RuntimeError: rank 0 could not") and "pos_encoding.pe" in results[1][what]
    assert not (tmp_path / "ckpt").exists()
    for r in results:
        after = r["after_load"]
        assert abs(after["loss"] - after["ref_loss"]) < TOL and max(after["grad_diff"].values()) < TOL, after


@functools.lru_cache(maxsize=None)
def _llama_results() -> list[dict]:
    pytest.importorskip("transformers")
    return run_world(workers.llama_run, 2, timeout_s=500)


@pytest.mark.parametrize("schedule", ["1F1B", "ZBVZeroBubble"])
def test_a_meta_llama_loaded_from_a_state_dict_trains_as_the_unsplit_model(schedule):
    _check_equal_to_unsplit([r[f"weights-{schedule}"] for r in _llama_results()])


def test_the_default_init_of_a_meta_llama_is_the_same_under_two_splits_rotary_buffers_included():
    for result in (r["default"] for r in _llama_results()):
        assert result["keys_equal"] and result["finite"] and result["max_diff"] == 0.0
        assert result["losses"][0] == pytest.approx(result["losses"][1], abs=TOL)
        assert result["losses"][0] == pytest.approx(result["ref_loss"], abs=TOL)
