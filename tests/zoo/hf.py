"""Small Hugging Face language models built from a config, ready to trace and pipeline.

Nothing is downloaded: each factory builds a randomly initialised GPT-2 or Llama from a
small config and returns ``(model, example_args)``, one micro-batch of token ids, the same
convention as :func:`autopipe.models.seed_transformer`. The models keep Hugging Face's
module names (``transformer.h.1``, ``model.layers.1``, ``lm_head``), so a plan's split
points read like the model's own ``named_modules()``.

Two things make a stock Hugging Face causal LM unfit for ``torch.distributed.pipelining``,
and the classes here fix both without renaming anything:

- its ``forward`` returns a ``ModelOutput`` (logits, caches, ...), where a pipeline needs a
  tensor: :class:`GPT2LogitsLM` and :class:`LlamaLogitsLM` subclass the stock models and
  return the logits alone, with the KV cache off;
- Llama's rotary embedding runs under ``@torch.no_grad()``, which ``torch.export`` records
  as a higher-order op that ``pipeline()`` cannot rebuild into a stage (it fails with
  "Expected positional argument for parameter submod_1"): :class:`LlamaLogitsLM` swaps in
  :class:`ExportableRotaryEmbedding`, the same arithmetic without the decorator.

Attention is "sdpa" by default; "eager" exports and splits as well. Under ``torch.export``
transformers builds the causal mask as a tensor, so a cut between decoder blocks carries
the hidden states, the mask and (Llama) the rotary cos/sin tables. Works with
transformers 5.x and 4.46 (the oldest tested; 4.45 is expected to work).

Like every Hugging Face model these carry ``model.dummy_inputs`` (``{"input_ids": ...}``, a
3 x 5 batch), which ``forward(input_ids=...)`` accepts. With tied embeddings (GPT-2's
default) ``pipeline()`` copies the shared weight into every stage that uses it; keeping
the copies equal during training is the runtime's job.

Example:
    >>> from zoo.hf import gpt2_from_config
    >>> model, (input_ids,) = gpt2_from_config(n_layer=2, n_embd=32, n_head=2, vocab_size=100,
    ...                                        seq_len=8)
    >>> tuple(model(input_ids).shape)
    (2, 8, 100)
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch
import torch.nn as nn

__all__ = [
    "HF_AVAILABLE",
    "gpt2_from_config",
    "llama_from_config",
    "ExportableRotaryEmbedding",
]  # plus GPT2LogitsLM and LlamaLogitsLM, defined when first used (they import transformers)

def _transformers_installed() -> bool:
    try:
        return importlib.util.find_spec("transformers") is not None
    except (ImportError, ValueError):  # ValueError: a module set to None in sys.modules
        return False


# transformers is optional and slow to import (seconds): it is imported on first use only.
HF_AVAILABLE: bool = _transformers_installed()


def _hf_classes(needed_by: str) -> dict[str, type]:
    """The Hugging Face model classes by name, defined on first call; or says what to install."""
    reason = "it is not installed"
    if HF_AVAILABLE:
        try:
            return _define_hf_classes()
        except ImportError as exc:
            reason = str(exc)
    raise ImportError(
        f"{needed_by} needs Hugging Face transformers (>= 4.45), which is not importable here "
        f"({reason}). Install it with `pip install transformers`."
    )


def _token_ids(vocab_size: int, batch: int, seq_len: int, seed: int) -> torch.Tensor:
    """One micro-batch of random token ids, reproducible from ``seed``."""
    return torch.randint(0, vocab_size, (batch, seq_len), generator=torch.Generator().manual_seed(seed))


class _LogitsOnly:
    """Mixin for a Hugging Face causal LM: ``forward(input_ids) -> logits`` tensor.

    Placed before the Hugging Face class in the bases, so parameters, buffers and module
    names stay exactly those of the stock model.
    """

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        """Next-token logits, shape (batch, seq_len, vocab_size); no KV cache."""
        return super().forward(input_ids=input_ids, use_cache=False, return_dict=True).logits  # type: ignore[misc]

    def example_input(self, batch: int = 2, seq_len: int = 32, *, seed: int = 0) -> torch.Tensor:
        """A batch of token ids of the right type for this model (one micro-batch)."""
        return _token_ids(self.config.vocab_size, batch, seq_len, seed)  # type: ignore[attr-defined]


class ExportableRotaryEmbedding(nn.Module):
    """Llama's default rotary position embedding, without ``@torch.no_grad()``.

    Computes the same ``(cos, sin)`` tables as the module it replaces, from that module's
    ``inv_freq`` buffer and ``attention_scaling``. Nothing here needs gradients (position
    ids are integers, ``inv_freq`` is a buffer), so dropping the decorator changes no
    result; it only keeps ``torch.export`` from wrapping the body in a higher-order op that
    ``torch.distributed.pipelining.pipeline`` cannot split.

    Args:
        rotary: The Hugging Face rotary module to replace; only the "default" RoPE type
            (no dynamic or scaled variants) is supported.

    Example:
        >>> from zoo.hf import llama_from_config
        >>> model, _ = llama_from_config(num_hidden_layers=1, hidden_size=16,
        ...                              num_attention_heads=2, vocab_size=50, seq_len=4)
        >>> type(model.model.rotary_emb).__name__
        'ExportableRotaryEmbedding'
    """

    def __init__(self, rotary: nn.Module) -> None:
        super().__init__()
        rope_type = getattr(rotary, "rope_type", "default")
        if rope_type != "default":
            raise ValueError(
                f"rotary has rope_type={rope_type!r}; ExportableRotaryEmbedding only reproduces "
                "the 'default' RoPE type"
            )
        self.register_buffer("inv_freq", rotary.inv_freq.detach().clone(), persistent=False)
        self.attention_scaling = float(getattr(rotary, "attention_scaling", 1.0))
        # What computes inv_freq again (reset_parameters) for a model built on the meta device.
        self._rope_init = getattr(rotary, "compute_default_rope_parameters", None)
        self._rope_config = getattr(rotary, "config", None)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Compute ``inv_freq`` from the model's config again, as the replaced module's constructor did.

        A model built on the meta device has no values; ``inv_freq`` is a non-persistent
        buffer, in no state dict, so this is how it gets them. Does nothing where the
        replaced module brought no config (older transformers releases).
        """
        if self._rope_init is None or self._rope_config is None:
            return
        inv_freq, _ = self._rope_init(self._rope_config)
        self.inv_freq.copy_(inv_freq)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # (batch, seq) x (head_dim / 2,) -> (batch, seq, head_dim / 2), angles in float32.
        freqs = position_ids[..., None].float() * self.inv_freq.float()
        angles = torch.cat((freqs, freqs), dim=-1)
        cos = angles.cos() * self.attention_scaling
        sin = angles.sin() * self.attention_scaling
        return cos.to(x.dtype), sin.to(x.dtype)


def _define_hf_classes() -> dict[str, type]:
    """Creates :class:`GPT2LogitsLM` and :class:`LlamaLogitsLM` once, importing transformers."""
    if "GPT2LogitsLM" in globals():
        return {name: globals()[name] for name in _HF_CLASS_NAMES}
    from transformers import GPT2LMHeadModel, LlamaForCausalLM

    class GPT2LogitsLM(_LogitsOnly, GPT2LMHeadModel):
        """``transformers.GPT2LMHeadModel`` whose forward takes token ids and returns logits.

        Module names are GPT-2's own: ``transformer.wte``, ``transformer.h.0`` ..,
        ``transformer.ln_f``, ``lm_head``.
        """

    class LlamaLogitsLM(_LogitsOnly, LlamaForCausalLM):
        """``transformers.LlamaForCausalLM`` whose forward takes token ids and returns logits.

        Module names are Llama's own: ``model.embed_tokens``, ``model.rotary_emb``,
        ``model.layers.0`` .., ``model.norm``, ``lm_head``. The rotary embedding is an
        :class:`ExportableRotaryEmbedding` so the model splits with ``pipeline()``.
        """

        def __init__(self, config: Any) -> None:
            super().__init__(config)
            self.model.rotary_emb = ExportableRotaryEmbedding(self.model.rotary_emb)

    for cls in (GPT2LogitsLM, LlamaLogitsLM):
        cls.__module__ = __name__
        cls.__qualname__ = cls.__name__  # found as zoo.hf.<name>, so pickle works
        globals()[cls.__name__] = cls
    return {name: globals()[name] for name in _HF_CLASS_NAMES}


_HF_CLASS_NAMES = ("GPT2LogitsLM", "LlamaLogitsLM")


def __getattr__(name: str) -> Any:
    # ``from zoo.hf import GPT2LogitsLM`` imports transformers at that moment.
    if name in _HF_CLASS_NAMES:
        return _hf_classes(name)[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _seeded(model_class: type, config: Any, *, batch: int, seq_len: int, seed: int) -> tuple[nn.Module, tuple[torch.Tensor]]:
    """Build ``model_class(config)`` with weights from ``seed`` (caller's RNG untouched) and one micro-batch."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_class(config)
    return model, (model.example_input(batch, seq_len, seed=seed),)


def gpt2_from_config(
    *,
    n_layer: int = 4,
    n_embd: int = 128,
    n_head: int = 4,
    vocab_size: int = 8000,
    n_positions: int = 256,
    batch: int = 2,
    seq_len: int = 32,
    tie_word_embeddings: bool = True,
    dropout: float = 0.0,
    attn_implementation: str = "sdpa",
    seed: int = 0,
) -> tuple[nn.Module, tuple[torch.Tensor]]:
    """A randomly initialised GPT-2 and one micro-batch of token ids; nothing is downloaded.

    With ``tie_word_embeddings=True`` (GPT-2's default) ``lm_head.weight`` *is*
    ``transformer.wte.weight``: a plan that puts the embedding and the head on different
    stages makes ``pipeline()`` replicate that weight on both.

    Keyword Args:
        n_layer, n_embd, n_head: Number of blocks, width, attention heads.
        vocab_size: Tokens; the embedding and the head each hold ``vocab_size * n_embd``.
        n_positions: Longest sequence the position table covers (at least ``seq_len``).
        batch, seq_len: Shape of the example micro-batch.
        tie_word_embeddings: Share the input embedding with the output head.
        dropout: Residual, embedding and attention dropout (0.0 for exact comparisons).
        attn_implementation: "sdpa" or "eager"; both export and split.
        seed: Seeds the weights and the example tokens; the global RNG is left untouched.

    Returns:
        ``(model, (input_ids,))``: ``model(input_ids)`` is a (batch, seq_len, vocab_size)
        logits tensor. Hand both to :func:`autopipe.partition` or ``pipeline()``.

    Example:
        >>> model, (ids,) = gpt2_from_config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, seq_len=8)
        >>> model.lm_head.weight is model.transformer.wte.weight
        True
    """
    model_class = _hf_classes("gpt2_from_config")["GPT2LogitsLM"]
    if seq_len > n_positions:
        raise ValueError(f"seq_len={seq_len} exceeds n_positions={n_positions}; raise n_positions")
    from transformers import GPT2Config

    config = GPT2Config(
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=n_head,
        vocab_size=vocab_size,
        n_positions=n_positions,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
        tie_word_embeddings=tie_word_embeddings,
        use_cache=False,
        bos_token_id=0,  # the stock 50256 lies outside a small vocabulary
        eos_token_id=0,
        attn_implementation=attn_implementation,
    )
    return _seeded(model_class, config, batch=batch, seq_len=seq_len, seed=seed)


def llama_from_config(
    *,
    num_hidden_layers: int = 4,
    hidden_size: int = 128,
    intermediate_size: int | None = None,
    num_attention_heads: int = 4,
    num_key_value_heads: int | None = None,
    vocab_size: int = 8000,
    max_position_embeddings: int = 256,
    batch: int = 2,
    seq_len: int = 32,
    tie_word_embeddings: bool = False,
    attn_implementation: str = "sdpa",
    seed: int = 0,
) -> tuple[nn.Module, tuple[torch.Tensor]]:
    """A randomly initialised Llama and one micro-batch of token ids; nothing is downloaded.

    Keyword Args:
        num_hidden_layers, hidden_size, num_attention_heads: Blocks, width, query heads.
        intermediate_size: Width of the SwiGLU feed-forward; default ``8/3 * hidden_size``
            rounded up to a multiple of 8, as in the Llama papers.
        num_key_value_heads: Key/value heads (grouped-query attention); default: as many
            as query heads.
        vocab_size: Tokens in the embedding and the head.
        max_position_embeddings: Longest sequence the model is configured for.
        batch, seq_len: Shape of the example micro-batch.
        tie_word_embeddings: Share the input embedding with the output head (Llama: no).
        attn_implementation: "sdpa" or "eager"; both export and split.
        seed: Seeds the weights and the example tokens; the global RNG is left untouched.

    Returns:
        ``(model, (input_ids,))``: ``model(input_ids)`` is a (batch, seq_len, vocab_size)
        logits tensor.

    Example:
        >>> model, (ids,) = llama_from_config(num_hidden_layers=2, hidden_size=32,
        ...                                   num_attention_heads=2, vocab_size=100, seq_len=8)
        >>> tuple(model(ids).shape)
        (2, 8, 100)
    """
    model_class = _hf_classes("llama_from_config")["LlamaLogitsLM"]
    if seq_len > max_position_embeddings:
        raise ValueError(
            f"seq_len={seq_len} exceeds max_position_embeddings={max_position_embeddings}"
        )
    if intermediate_size is None:
        intermediate_size = -(-(8 * hidden_size // 3) // 8) * 8
    from transformers import LlamaConfig

    config = LlamaConfig(
        num_hidden_layers=num_hidden_layers,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads or num_attention_heads,
        vocab_size=vocab_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        use_cache=False,
        bos_token_id=0,  # the stock ids (1, 2) are fine, but keep them inside tiny vocabularies
        eos_token_id=0,
        attn_implementation=attn_implementation,
    )
    return _seeded(model_class, config, batch=batch, seq_len=seq_len, seed=seed)
