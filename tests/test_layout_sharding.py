"""Tensor parallelism read from the traced graph: column/row pairs, heads, and the shape a
traced decoder stack has, against each model's own config."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autopipe.layouts.blocks import block_matmuls
from autopipe.layouts.shapes import TransformerShape
from autopipe.layouts.sharding import find_tensor_parallel, shape_from_graph
from autopipe.models import seed_transformer
from autopipe.planning.tracing import trace


def _hf(name: str):
    transformers = pytest.importorskip("transformers")
    small = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=96, max_position_embeddings=32)
    config = {"llama": lambda: transformers.LlamaConfig(**small),
              "qwen2": lambda: transformers.Qwen2Config(**small),
              "gpt2": lambda: transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=96, n_positions=32,
                                                      bos_token_id=0, eos_token_id=0)}[name]()
    model = transformers.AutoModelForCausalLM.from_config(config)
    return model, config, torch.randint(0, 96, (2, 16))


@pytest.fixture(scope="module", params=["llama", "qwen2", "gpt2"])
def hf_traced(request):
    model, config, x = _hf(request.param)
    return request.param, config, trace(model, (x,)).exported


def test_the_traced_stack_has_the_shape_its_config_says(hf_traced):
    name, config, exported = hf_traced
    from_graph = shape_from_graph(exported, seq_len=16)
    from_config = TransformerShape.from_hf_config(config.to_dict(), seq_len=16)
    assert from_graph == TransformerShape(**{**from_config.__dict__, "name": ""})


def test_each_block_shards_the_matrices_the_hand_description_shards(hf_traced):
    name, config, exported = hf_traced
    shape = TransformerShape.from_hf_config(config.to_dict(), seq_len=16)
    plan = find_tensor_parallel(exported)
    by_hand = {kind: sum(m.out_features * m.in_features for m in block_matmuls(shape) if m.shard == kind)
               for kind in ("column", "row")}
    for kind in ("column", "row"):
        found = sum(m.out_features * m.in_features for m in plan.matmuls if m.shard == kind)
        assert found == shape.layers * by_hand[kind], kind
    # Two groups (attention, feed-forward) per block, each with a row matrix closing it.
    groups = {m.group for m in plan.sharded()}
    assert len(groups) == 2 * shape.layers
    assert all(any(m.shard == "row" and m.group == g for m in plan.matmuls) for g in groups)
    assert set(plan.heads.values()) == {(shape.heads, shape.kv_heads)}
    assert [m.shard for m in plan.matmuls if m.out_features == shape.vocab] in (["embedding", "vocab"], ["vocab"])


def test_a_hand_written_attention_gives_its_heads_too():
    model, args = seed_transformer(vocab_size=100, d_model=32, num_heads=4, d_ff=64, num_layers=2, batch=2, seq_len=8)
    shape = shape_from_graph(trace(model, args).exported, seq_len=8, name="seed")
    assert (shape.layers, shape.hidden, shape.heads, shape.kv_heads, shape.ffn, shape.kind) == (2, 32, 4, 4, 64, "gpt")


def test_heads_that_do_not_divide_are_named(hf_traced):
    name, config, exported = hf_traced
    plan = find_tensor_parallel(exported)
    assert plan.why_not(2) is None
    q, kv = next(iter(plan.heads.values()))
    assert plan.why_not(8) == (f"{kv} key-value heads (group {min(plan.heads)}) do not divide by tp=8" if q % 8 == 0
                               else f"{q} attention heads (group {min(plan.heads)}) do not divide by tp=8")


class _NormInside(nn.Module):
    """A feed-forward with a norm over its inner features, then a plain pair."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.norm, self.down = nn.Linear(8, 32), nn.LayerNorm(32), nn.Linear(32, 8)
        self.up2, self.down2 = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        x = x + self.down(self.norm(self.up(x)))
        return x + self.down2(torch.relu(self.up2(x)))


def test_a_norm_over_the_sliced_features_keeps_its_pair_whole_and_says_why():
    plan = find_tensor_parallel(torch.export.export(_NormInside(), (torch.randn(2, 8),)))
    shards = {m.parameter: m.shard for m in plan.matmuls}
    assert shards["up.weight"] == "whole" and shards["up2.weight"] == "column" and shards["down2.weight"] == "row"
    assert "layer_norm" in plan.refused["up.weight"]


def test_a_model_with_nothing_to_shard_says_so():
    conv = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU())
    plan = find_tensor_parallel(torch.export.export(conv, (torch.randn(1, 3, 8, 8),)))
    assert plan.why_not(2) == "nothing to shard: no column/row pair of weight matrices"
    with pytest.raises(ValueError, match="no attention followed by a feed-forward"):
        shape_from_graph(torch.export.export(conv, (torch.randn(1, 3, 8, 8),)), seq_len=8)


class _TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.up, self.down, self.head = nn.Embedding(50, 8), nn.Linear(8, 32), nn.Linear(32, 8), nn.Linear(8, 50)

    def forward(self, x, y):
        h = self.emb(x)
        h = h + self.down(torch.relu(self.up(h)))
        return nn.functional.cross_entropy(self.head(h).flatten(0, 1), y.flatten())


def test_an_output_layer_whose_loss_is_traced_shards_over_the_vocabulary():
    ids = torch.randint(0, 50, (2, 4))
    plan = find_tensor_parallel(torch.export.export(_TinyLM(), (ids, ids)))
    assert {m.parameter: m.shard for m in plan.matmuls} == {"emb.weight": "embedding", "up.weight": "column",
                                                            "down.weight": "row", "head.weight": "vocab"}


def test_a_batch_of_one_sequence_reads_the_same_shape():
    # Dimensions of size 1 start at every offset of a reshape: the heads must still be found.
    model, config, _ = _hf("llama")
    exported = trace(model, (torch.randint(0, 96, (1, 16)),)).exported
    assert shape_from_graph(exported, seq_len=16) == TransformerShape(
        **{**TransformerShape.from_hf_config(config.to_dict(), seq_len=16).__dict__, "name": ""})
