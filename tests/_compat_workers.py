"""Tiny Hugging Face models for tests/test_torch_compat.py, and what each rank runs there.

The models are built from configs with random weights (hidden size 32, 2 layers,
vocabulary 64) and no dropout, so the unsplit model in the same process is the reference.
Workers are spawned by ``tests/_dist_utils.run_world`` and must be importable by name.
"""

from __future__ import annotations

import torch
import torch.nn as nn

VOCAB = 64
SEQ = 8
MICROBATCH = 2
N_MICROBATCHES = 4


def tiny_llama(*, tie: bool = False, seed: int = 0) -> nn.Module:
    """``LlamaForCausalLM`` with rotary embeddings; ``use_cache=False`` (the cache does not export)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, use_cache=False, tie_word_embeddings=tie)
    return LlamaForCausalLM(config).eval()


def tiny_bert(*, seed: int = 0) -> nn.Module:
    """``BertForMaskedLM``: its ``BertAttention`` has a submodule named ``self``; decoder tied to the embedding."""
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(seed)
    config = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=32, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0)
    return BertForMaskedLM(config).eval()


def token_batch(rows: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (rows, SEQ), generator=torch.Generator().manual_seed(seed))


def logits_of(out):
    """The logits, whatever the last stage or the model returns (ModelOutput, tuple or tensor)."""
    return out.logits if hasattr(out, "logits") else (out[0] if isinstance(out, (tuple, list)) else out)


def lm_loss(out, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits_of(out).reshape(-1, VOCAB), target.reshape(-1))


# ---------------------------------------------------------------------- workers
def llama_1f1b_run(rank: int, world_size: int) -> dict:
    """One 1F1B step of a tiny Llama on 2 ranks; loss and gradients next to the unsplit model's."""
    from _runtime_workers import against_reference

    from autopipe.runtime import Pipeline

    model = tiny_llama().train()  # no dropout in Llama: train and eval compute alike
    pipe = Pipeline(model, example_args=(token_batch(MICROBATCH),), loss_fn=lm_loss, schedule="1F1B",
                    n_microbatches=N_MICROBATCHES, split_points=["model.layers.1"])
    x, y = token_batch(MICROBATCH * N_MICROBATCHES, seed=2), token_batch(MICROBATCH * N_MICROBATCHES, seed=3)
    loss = pipe.step(x, target=y)
    return against_reference(pipe, model, loss, lm_loss(model(x), y))


class EncoderDecoder(nn.Module):
    """An encoder and a decoder embedding that need nothing from each other until the decoder's layers.

    Cut before ``dec_embed`` and ``dec.0``, the second stage takes nothing the first computes:
    the shape torch's ``pipeline()`` calls out of order (autopipe.runtime.compat.stages_in_split_order).
    """

    SPLIT = ["dec_embed", "dec.0"]

    def __init__(self, width: int = 8, dropout: float = 0.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.enc = nn.Sequential(nn.Linear(width, width), nn.Dropout(dropout), nn.Linear(width, width))
        self.dec_embed = nn.Sequential(nn.Linear(width, width), nn.Dropout(dropout))
        self.dec = nn.ModuleList([nn.Linear(width, width) for _ in range(2)])
        self.head = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        e = self.enc(x)
        d = self.dec_embed(y)
        for layer in self.dec:
            d = torch.tanh(layer(d) + e)
        return self.head(d)


def mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def encoder_decoder_run(rank: int, world_size: int) -> dict:
    """An interleaved step (4 stages on 2 ranks) of :class:`EncoderDecoder` cut so stage 1 needs nothing of stage 0."""
    from _runtime_workers import against_reference

    from autopipe.runtime import Pipeline

    model = EncoderDecoder()
    mb = (torch.randn(MICROBATCH, 8), torch.randn(MICROBATCH, 8))
    pipe = Pipeline(model, example_args=mb, loss_fn=mse, schedule="Interleaved1F1B", n_microbatches=N_MICROBATCHES,
                    split_points=[*EncoderDecoder.SPLIT, "dec.1"])
    g = torch.Generator().manual_seed(5)
    rows = MICROBATCH * N_MICROBATCHES
    x, y, t = (torch.randn(rows, 8, generator=g), torch.randn(rows, 8, generator=g),
               torch.randn(rows, 4, generator=g))
    loss = pipe.step(x, y, target=t)
    return against_reference(pipe, model, loss, mse(model(x, y), t))
