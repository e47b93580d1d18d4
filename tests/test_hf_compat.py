"""Hugging Face models as they come (KV cache on), and torch.export failures explained.

The Hugging Face tests build tiny models from transformers' own config classes with their
defaults (``use_cache=True``); nothing is downloaded.
"""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

import autopipe
from autopipe.planning import hf_compat
from autopipe.errors import MissingExampleInputsError, ModelExportError
from autopipe.planning.hf_compat import CACHE_NOTE
from autopipe.reporting.data import report_data
from autopipe.planning.tracing import export_failure_kind, trace

from _dist_utils import run_world
from _planning import partition_with

needs_transformers = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                        reason="transformers is not installed")

VOCAB = 64


def _ids(batch: int = 2, seq: int = 8, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _gpt2(**overrides):
    from transformers import GPT2Config, GPT2LMHeadModel

    # Token ids inside the tiny vocabulary (the defaults name GPT-2's 50256).
    config = GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=VOCAB, n_positions=32,
                        bos_token_id=0, eos_token_id=0, **overrides)
    return GPT2LMHeadModel(config), {"input_ids": _ids()}


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, vocab_size=VOCAB, max_position_embeddings=32)
    return LlamaForCausalLM(config), {"input_ids": _ids()}


def _t5():
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(d_model=32, d_ff=64, d_kv=16, num_layers=2, num_heads=2, vocab_size=VOCAB)
    return T5ForConditionalGeneration(config), {"input_ids": _ids(), "decoder_input_ids": _ids(seq=6, seed=1)}


def _whisper():
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    config = WhisperConfig(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
                           decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=8,
                           vocab_size=VOCAB, max_source_positions=8, max_target_positions=16, pad_token_id=0,
                           bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)
    features = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(2))  # 2 x mel bins x 2 * positions
    return WhisperForConditionalGeneration(config), {"input_features": features, "decoder_input_ids": _ids(seq=4)}


def _cache_settings(model: nn.Module) -> dict[str, object]:
    return {path: config.use_cache for path, config in hf_compat.cache_configs(model)}


def _partition(model: nn.Module, kwargs: dict, **extra: object) -> autopipe.Plan:
    return partition_with(model, 2, example_kwargs=kwargs, cost="flops",
                              profiling=autopipe.ProfileOptions(progress=False), **extra)


# --------------------------------------------------------------------------- Hugging Face models


@needs_transformers
@pytest.mark.parametrize("make", [_gpt2, _llama, _whisper], ids=["gpt2", "llama", "whisper"])
def test_hf_model_with_default_config_partitions_and_keeps_its_cache_setting(make):
    model, kwargs = make()
    assert model.config.use_cache is True  # the default this is about
    before = _cache_settings(model)
    plan = _partition(model, kwargs)
    assert plan.num_stages == 2
    report = plan.report()
    assert report.count(CACHE_NOTE) == 1
    assert "config.use_cache" in plan.notes[0]
    assert _cache_settings(model) == before
    assert model.config.use_cache is True
    assert any(CACHE_NOTE in n for n in report_data(plan)["summary"]["notes"])  # the terminal/HTML reports


@needs_transformers
def test_t5_decoder_keeps_its_own_config_and_both_are_turned_off_and_restored():
    model, kwargs = _t5()
    assert model.decoder.config is not model.config and model.decoder.config.use_cache is True
    plan = _partition(model, kwargs)
    note = plan.notes[0]
    assert "decoder.config.use_cache" in note and note.startswith(CACHE_NOTE)
    assert plan.report().count(CACHE_NOTE) == 1
    assert model.config.use_cache is True and model.decoder.config.use_cache is True
    assert model.encoder.config.use_cache is False  # T5's encoder has it off by design: left alone


@needs_transformers
def test_explicit_use_cache_true_in_example_kwargs_is_traced_without_the_cache():
    model, kwargs = _gpt2()
    model.config.use_cache = False  # only the keyword asks for the cache
    given = {**kwargs, "use_cache": True}
    plan = _partition(model, given)
    assert given["use_cache"] is True  # the caller's dict is not modified
    assert "example_kwargs['use_cache']" in plan.notes[0]
    assert "config.use_cache" not in plan.notes[0].replace("example_kwargs", "")
    assert plan.report().count(CACHE_NOTE) == 1


@needs_transformers
def test_loss_is_profiled_on_the_output_without_a_cache():
    model, kwargs = _gpt2()
    caches = []

    def loss_fn(out, y):
        caches.append(out.past_key_values)
        return nn.functional.cross_entropy(out.logits.reshape(-1, VOCAB), y.reshape(-1))

    plan = autopipe.partition(model, 2, example_kwargs=kwargs, loss_fn=loss_fn, example_target=kwargs["input_ids"],
                              planner=autopipe.PlannerOptions(profiling=autopipe.ProfileOptions(progress=False, warmup=0, repeats=1)))
    assert caches and all(c is None for c in caches)
    assert plan.loss is not None and model.config.use_cache is True


@needs_transformers
def test_cut_bytes_in_the_batch_size_with_use_cache_given_as_a_keyword():
    from autopipe.planning.scaling import profile_scaling

    model, kwargs = _gpt2()
    scaled = profile_scaling(model, (), {**kwargs, "use_cache": True}, sizes=(1, 2), cost="flops",
                             device_flops=1e9, progress=False)
    assert any("b" in str(f) for f in scaled.cut_fwd_bytes)  # what crosses the cuts grows with the micro-batch size b
    assert model.config.use_cache is True


def _besides_the_split(notes: list[str]) -> list[str]:
    """The notes other than one about the split itself (a close call between two splits)."""
    return [n for n in notes if not n.startswith("a close call")]


@needs_transformers
def test_hf_model_with_the_cache_already_off_gets_no_note():
    model, kwargs = _gpt2()
    model.config.use_cache = False
    plan = _partition(model, kwargs, loss_fn=False)  # no loss note either (tests/test_loss_default.py)
    assert _besides_the_split(plan.notes) == []
    assert CACHE_NOTE not in plan.report()
    assert model.config.use_cache is False


def test_model_without_hf_config_gets_no_note(small_transformer):
    model, args = small_transformer
    plan = autopipe.partition(model, 2, example_args=args, loss_fn=False,
                              planner=autopipe.PlannerOptions(cost="flops", profiling=autopipe.ProfileOptions(progress=False)))
    assert _besides_the_split(plan.notes) == []
    assert CACHE_NOTE not in plan.report()
    assert trace(model, args).notes == []


# --------------------------------------------------------------------------- hf_compat alone


def test_training_config_finds_nested_and_shared_configs_and_restores_them():
    text = SimpleNamespace(use_cache=True)
    shared = SimpleNamespace(use_cache=True, text_config=text, vision_config=SimpleNamespace(use_cache=None))
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    model.config = shared
    model[1].config = shared  # one object held by two modules: listed once
    assert [p for p, _ in hf_compat.cache_configs(model)] == ["config", "config.text_config",
                                                               "config.vision_config"]
    with hf_compat.training_config(model) as changes:
        assert [c.where for c in changes] == ["config.use_cache", "config.text_config.use_cache"]
        assert shared.use_cache is False and text.use_cache is False
        assert shared.vision_config.use_cache is None  # None builds no cache: left as it is
    assert shared.use_cache is True and text.use_cache is True


def test_training_config_restores_a_class_default_as_a_class_default():
    class Config:
        use_cache = True

    model = nn.Linear(2, 2)
    model.config = Config()
    with hf_compat.training_config(model):
        assert model.config.use_cache is False
    assert "use_cache" not in vars(model.config) and model.config.use_cache is True


def test_training_config_restores_even_when_the_block_raises():
    model = nn.Linear(2, 2)
    model.config = SimpleNamespace(use_cache=True)
    with pytest.raises(RuntimeError, match="boom"):
        with hf_compat.training_config(model):
            raise RuntimeError("boom")
    assert model.config.use_cache is True


def test_non_hf_model_is_left_alone_and_keeps_its_use_cache_keyword():
    model = nn.Linear(2, 2)
    with hf_compat.training_config(model) as changes:
        assert changes == []
    assert hf_compat.training_kwargs(model, {"use_cache": True}) == ({"use_cache": True}, [])


class _ConfiguredBranch(nn.Module):
    """A Hugging Face-like module (a config with use_cache) that export cannot capture."""

    def __init__(self) -> None:
        super().__init__()
        self.config = SimpleNamespace(use_cache=True)
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # a decision on a tensor's value
            return self.linear(x)
        return x


def test_cache_setting_is_restored_when_export_fails():
    model = _ConfiguredBranch()
    with pytest.raises(ModelExportError):
        trace(model, (torch.ones(2, 4),))
    assert model.config.use_cache is True


# --------------------------------------------------------------------------- export errors


class _Branch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return self.linear(x)
        return x


class _Box:
    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


class _ReturnsBox(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> _Box:
        return _Box(self.linear(x))


class DynamicCache:  # named like transformers' cache, which is all the message shows of it
    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


class _ReturnsCache(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> tuple:
        y = self.linear(x)
        return y, DynamicCache(y)


class _TakesBox(nn.Module):
    def forward(self, x: torch.Tensor, box: _Box) -> torch.Tensor:
        return x + box.t


class _CastsItself(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.linear = self.linear.to(torch.float64)  # as Switch Transformers' router does
        return self.linear(x.double())


X = torch.ones(2, 4)


@pytest.mark.parametrize("model, args, kind, advice", [
    (_Branch(), (X,), "data-dependent", "torch.where"),
    (_ReturnsBox(), (X,), "output-type", "Return tensors"),
    (_ReturnsCache(), (X,), "cache-output", "use_cache=False"),
    (_TakesBox(), (X, _Box(X)), "input-type", "Pass tensors and plain Python values"),
    (_CastsItself(), (X,), "parameter-change", "model.to(dtype)"),
], ids=["data-dependent", "output-type", "cache-output", "input-type", "parameter-change"])
def test_export_failure_names_the_model_the_reason_and_what_to_try(model, args, kind, advice):
    with pytest.raises(ModelExportError) as info:
        trace(model, args)
    err = info.value
    message = str(err)
    first = message.splitlines()[0]
    assert first.startswith(f"torch.export could not capture {type(model).__name__} as one graph: ")
    assert len(first) < 400  # the reason in one line, not the exporter's whole message
    assert err.kind == kind == export_failure_kind(err.__cause__)
    assert "What to try: " in message and advice in message.split("What to try: ")[1]
    assert isinstance(err.__cause__, Exception)  # the exporter's own error stays chained


def test_data_dependent_failure_points_at_the_models_line():
    with pytest.raises(ModelExportError) as info:
        trace(_Branch(), (X,))
    where = [line for line in str(info.value).splitlines() if line.startswith("Where: ")]
    assert where and "test_hf_compat.py" in where[0] and "if x.sum() > 0" in where[0]
    assert "torch.cond" in str(info.value) and "example_kwargs" in str(info.value)


def test_unrecognised_failure_gets_the_general_advice():
    assert export_failure_kind(RuntimeError("something else entirely")) == "other"


# --------------------------------------------------------------------------- Pipeline


def test_pipeline_without_any_example_inputs_says_what_to_pass():
    with pytest.raises(MissingExampleInputsError, match=r"example_args=None and example_kwargs=None for Linear"):
        autopipe.Pipeline(nn.Linear(2, 2))


def test_pipeline_takes_keyword_only_or_carried_example_inputs():
    from autopipe.runtime.plan_setup import check_model_and_inputs

    x = torch.ones(2, 4)
    assert check_model_and_inputs(nn.Linear(4, 4), None, {"input": x}, None) == ((), {"input": x})
    carrying = nn.Linear(4, 4)
    carrying.example_input_array = x
    args, kwargs = check_model_and_inputs(carrying, None, None, None)
    assert args[0] is x and not kwargs
    with pytest.raises(TypeError, match="example_args must be a tuple"):
        check_model_and_inputs(nn.Linear(4, 4), [x], None, None)


def _hf_pipeline_run(rank: int, world_size: int, ask_cache: bool = False) -> dict:
    """GPT-2 with its default config in a 2-stage pipeline, inputs by keyword only
    (with ``ask_cache``, ``use_cache=True`` given with the example and every batch)."""
    from autopipe.runtime import Pipeline

    torch.manual_seed(0)
    # No dropout, so the split and the unsplit model compute the same loss.
    model, kwargs = _gpt2(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    extra = {"use_cache": True} if ask_cache else {}
    kwargs = {**kwargs, **extra}
    loss_fn = lambda out, y: nn.functional.cross_entropy(out.logits.reshape(-1, VOCAB), y.reshape(-1))  # noqa: E731
    pipe = Pipeline(model, example_kwargs=kwargs, split_points=["transformer.h.1"], n_microbatches=2,
                    loss_fn=loss_fn)
    x, y = _ids(4, 8, seed=3), _ids(4, 8, seed=4)
    loss = pipe.step(input_ids=x, target=y, **extra)
    reference = loss_fn(model(input_ids=x, use_cache=False), y)
    return {"loss": loss.item(), "reference": reference.item(), "use_cache": model.config.use_cache}


@needs_transformers
@pytest.mark.parametrize("ask_cache", [False, True])
def test_pipeline_trains_hf_model_with_default_config_from_keyword_inputs(ask_cache):
    results = run_world(_hf_pipeline_run, 2, ask_cache, timeout_s=300)
    for r in results:
        assert r["use_cache"] is True  # the user's model is untouched
        assert r["loss"] == pytest.approx(r["reference"], rel=1e-5)
