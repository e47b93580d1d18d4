"""Specification of the model zoo: every factory builds a model that runs, exports and splits.

Sizes are tiny so the whole file runs in seconds; the zoo's default sizes are for benchmarks.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.distributed.pipelining import SplitPoint, pipeline

from zoo import hf
from zoo import models as zoo
from zoo import ZOO, build

TINY_LM = dict(vocab_size=64, batch=2, seq_len=8)
TINY_GPT2 = dict(n_layer=2, n_embd=16, n_head=2, **TINY_LM)
TINY_LLAMA = dict(num_hidden_layers=2, hidden_size=16, num_attention_heads=2, num_key_value_heads=1, **TINY_LM)

# zoo name -> (tiny sizes, a block boundary to cut at for a 2-stage pipeline)
CASES: dict[str, tuple[dict, str]] = {
    "seed_transformer": (dict(d_model=16, num_heads=2, d_ff=32, num_layers=2, **TINY_LM), "layers.1"),
    "gpt2_tied": (TINY_GPT2, "transformer.h.1"),
    "gpt2_untied": (TINY_GPT2, "transformer.h.1"),
    "llama": (TINY_LLAMA, "model.layers.1"),
    "cnn": (dict(image_size=16, widths=(4, 8, 16), hidden=16, batch=2), "blocks.1"),
    "unet": (dict(base_width=4, depth=2, image_size=8, batch=2), "mid"),
    "mlp": (dict(widths=(8, 80, 8, 40), batch=4), "blocks.1"),
    "mlp_sequential": (dict(widths=(8, 80, 8, 40), batch=4), "2"),
}
HF_NAMES = {"gpt2_tied", "gpt2_untied", "llama"}


def _build(name: str):
    if name in HF_NAMES and not hf.HF_AVAILABLE:
        pytest.skip("transformers is not installed")
    sizes, _ = CASES[name]
    return build(name, **sizes)


def test_cases_cover_the_whole_zoo():
    assert set(CASES) == set(ZOO)


@pytest.mark.parametrize("name", sorted(CASES))
def test_forward_on_example_args_returns_a_tensor(name):
    model, args = _build(name)
    assert isinstance(args, tuple)
    out = model(*args)
    assert isinstance(out, torch.Tensor)
    assert out.shape[0] == args[0].shape[0]  # batch first


@pytest.mark.parametrize("name", sorted(CASES))
def test_exports_and_the_exported_program_matches(name):
    model, args = _build(name)
    model.eval()  # batch norm in eval mode: the exported call does not touch the stats
    ep = torch.export.export(model, args)
    torch.testing.assert_close(ep.module()(*args), model(*args), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", sorted(CASES))
def test_two_stage_pipeline_reproduces_the_output(name):
    model, args = _build(name)
    _, split = CASES[name]
    expected = copy.deepcopy(model)(*args)
    pipe = pipeline(copy.deepcopy(model), args, split_spec={split: SplitPoint.BEGINNING})
    assert pipe.num_stages == 2
    (out,) = pipe(*args)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_factories_are_seeded_and_leave_the_global_rng_alone():
    state = torch.random.get_rng_state()
    (m1, (x1,)), (m2, (x2,)) = build("mlp", widths=(4, 8), seed=3), build("mlp", widths=(4, 8), seed=3)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert torch.equal(x1, x2)
    assert all(torch.equal(a, b) for a, b in zip(m1.parameters(), m2.parameters()))
    _, (x3,) = build("mlp", widths=(4, 8), seed=4)
    assert not torch.equal(x1, x3)


def test_unet_cut_at_the_bottleneck_carries_every_skip():
    depth = 3
    model, (x,) = zoo.unet(base_width=2, depth=depth, image_size=16, batch=2)
    pipe = pipeline(model, (x,), split_spec={"mid": SplitPoint.BEGINNING})
    crossing = pipe.split_gm.submod_pp_0(x)
    assert len(crossing) == depth + 1  # the pooled activation and one skip per level


def test_mlp_sequential_and_named_have_the_same_function():
    named, (x,) = zoo.varying_mlp(widths=(8, 80, 8), seed=1)
    flat, (y,) = zoo.varying_mlp(widths=(8, 80, 8), seed=1, as_sequential=True)
    assert isinstance(flat, torch.nn.Sequential)
    assert [n for n, _ in named.named_children()] == ["blocks", "head"]
    torch.testing.assert_close(flat(y), named(x))


def test_cnn_late_blocks_hold_the_parameters_early_blocks_the_activations():
    model, (x,) = zoo.shrinking_cnn(image_size=32, widths=(8, 16, 32, 64), batch=1)
    params = [sum(p.numel() for p in block.parameters()) for block in model.blocks]
    sizes = []
    for block in model.blocks:
        x = block(x)
        sizes.append(x.numel())
    assert params == sorted(params) and params[-1] > 50 * params[0]
    assert sizes == sorted(sizes, reverse=True)


@pytest.mark.skipif(not hf.HF_AVAILABLE, reason="transformers is not installed")
def test_tied_gpt2_shares_head_and_embedding_weights():
    model, _ = hf.gpt2_from_config(**TINY_GPT2, tie_word_embeddings=True)
    assert model.lm_head.weight is model.transformer.wte.weight


@pytest.mark.skipif(not hf.HF_AVAILABLE, reason="transformers is not installed")
def test_untied_gpt2_has_its_own_head_weights():
    model, _ = hf.gpt2_from_config(**TINY_GPT2, tie_word_embeddings=False)
    assert model.lm_head.weight.data_ptr() != model.transformer.wte.weight.data_ptr()


@pytest.mark.skipif(not hf.HF_AVAILABLE, reason="transformers is not installed")
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_llama_rotary_swap_keeps_the_stock_output(attn):
    from transformers import LlamaForCausalLM

    model, (ids,) = hf.llama_from_config(**TINY_LLAMA, attn_implementation=attn)
    stock = LlamaForCausalLM(model.config)
    stock.load_state_dict(model.state_dict())
    torch.testing.assert_close(model(ids), stock(ids).logits, atol=1e-6, rtol=1e-6)


@pytest.mark.skipif(not hf.HF_AVAILABLE, reason="transformers is not installed")
def test_hf_models_keep_their_module_names_and_dummy_inputs():
    gpt2, _ = hf.gpt2_from_config(**TINY_GPT2)
    llama, _ = hf.llama_from_config(**TINY_LLAMA)
    assert {"transformer.h.1", "lm_head"} <= dict(gpt2.named_modules()).keys()
    assert {"model.layers.1", "model.rotary_emb", "lm_head"} <= dict(llama.named_modules()).keys()
    assert "input_ids" in gpt2.dummy_inputs


def test_hf_factories_say_what_to_install_without_transformers(monkeypatch):
    monkeypatch.setattr(hf, "HF_AVAILABLE", False)
    with pytest.raises(ImportError, match="pip install transformers"):
        hf.gpt2_from_config()


def test_build_names_the_choices_for_an_unknown_model():
    with pytest.raises(KeyError, match="choose one of"):
        build("resnet")
