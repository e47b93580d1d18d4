"""The shape of a decoder-only Transformer, as a layout planner needs it.

A :class:`TransformerShape` holds what decides a layout's costs at scale: the number of
blocks, the hidden, feed-forward and vocabulary sizes, the attention heads and key-value
heads, and the block's kind (``"llama"``: RMSNorm, a gated SiLU feed-forward, no biases
and no dropout; ``"gpt"``: LayerNorm, a GeLU feed-forward, biases and dropout, as
Megatron-LM's GPT). It is read from a Hugging Face ``config.json`` or named from
:data:`NAMED_SHAPES`; nothing is built or downloaded.

Example:
    >>> s = TransformerShape.named("llama3-8b")
    >>> s.layers, s.hidden, s.kv_heads, round(s.params() / 1e9, 2)
    (32, 4096, 8, 8.03)
    >>> TransformerShape.from_hf_config({"model_type": "gpt2", "n_layer": 12, "n_embd": 768,
    ...                                  "n_head": 12, "vocab_size": 50257}).ffn
    3072
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Mapping

from .._checks import check_choice, check_int

BLOCK_KINDS = ("llama", "gpt")


@dataclass(frozen=True)
class TransformerShape:
    """A decoder-only Transformer's sizes.

    Args:
        layers: Transformer blocks.
        hidden: the residual stream's width.
        heads: attention (query) heads; ``hidden`` must divide by it.
        ffn: the feed-forward's inner width.
        vocab: vocabulary size (the embedding's and the output layer's rows).
        seq_len: tokens per sequence in training.
        kv_heads: key-value heads (grouped-query attention); None = ``heads``.
        kind: ``"llama"`` or ``"gpt"`` (see the module docstring).
        tied: whether the output layer reuses the embedding's weight.
        name: shown in reports.

    Raises:
        ValueError: a size that is not a positive integer, heads that do not divide
            ``hidden``, key-value heads that do not divide ``heads``, or an unknown kind.
    """

    layers: int
    hidden: int
    heads: int
    ffn: int
    vocab: int
    seq_len: int
    kv_heads: int | None = None
    kind: str = "llama"
    tied: bool = False
    name: str = ""

    def __post_init__(self) -> None:
        for field in ("layers", "hidden", "heads", "ffn", "vocab", "seq_len"):
            check_int(f"TransformerShape {field}", getattr(self, field))
        if self.kv_heads is None:
            object.__setattr__(self, "kv_heads", self.heads)
        check_int("TransformerShape kv_heads", self.kv_heads)
        check_choice("TransformerShape kind", self.kind, BLOCK_KINDS)
        if self.hidden % self.heads:
            raise ValueError(f"TransformerShape hidden={self.hidden} must divide by heads={self.heads}")
        if self.heads % self.kv_heads:
            raise ValueError(f"TransformerShape heads={self.heads} must divide by kv_heads={self.kv_heads}")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def kv_width(self) -> int:
        """Width of the key (or the value) projection's output."""
        return self.kv_heads * self.head_dim

    @property
    def gated(self) -> bool:
        """Whether the feed-forward has a gate (three weight matrices rather than two)."""
        return self.kind == "llama"

    def block_params(self) -> int:
        """Parameters of one Transformer block, norms and biases included."""
        h, f = self.hidden, self.ffn
        attn = h * (h + 2 * self.kv_width) + h * h
        mlp = (3 if self.gated else 2) * h * f
        if self.kind == "gpt":  # biases of the four linears and two LayerNorms' weight and bias
            return attn + mlp + (h + 2 * self.kv_width) + h + f + h + 4 * h
        return attn + mlp + 2 * h  # two RMSNorm weights

    def edge_params(self) -> int:
        """Parameters outside the blocks: embedding, final norm, output layer."""
        h = self.hidden
        embedding = self.vocab * h + (self.seq_len * h if self.kind == "gpt" else 0)  # GPT learns positions
        head = 0 if self.tied else self.vocab * h
        return embedding + head + (2 * h if self.kind == "gpt" else h)

    def params(self) -> int:
        """All parameters of the model."""
        return self.layers * self.block_params() + self.edge_params()

    def with_seq_len(self, seq_len: int) -> "TransformerShape":
        return replace(self, seq_len=seq_len)

    @classmethod
    def named(cls, name: str) -> "TransformerShape":
        """A shape of :data:`NAMED_SHAPES` by name (any case)."""
        key = name.lower()
        if key not in NAMED_SHAPES:
            raise ValueError(f"TransformerShape.named name={name!r} is not a known shape; use one of "
                             f"{sorted(NAMED_SHAPES)} or TransformerShape.from_hf_config")
        return NAMED_SHAPES[key]

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any] | str | Path, *, seq_len: int | None = None,
                       name: str = "") -> "TransformerShape":
        """The shape a Hugging Face ``config.json`` describes (a dict, or a file or folder path).

        Llama-like configs (``model_type`` llama, mistral, qwen2, qwen3, gemma) read
        ``num_hidden_layers``, ``hidden_size``, ``num_attention_heads``,
        ``num_key_value_heads``, ``intermediate_size``; GPT-like ones (gpt2, gpt_neox, bloom,
        opt) read their own names. ``seq_len`` defaults to the config's
        ``max_position_embeddings`` (``n_positions`` for GPT-2).

        Raises:
            ValueError: a ``model_type`` of neither kind, or a size the config lacks.
        """
        if not isinstance(config, Mapping):
            path = Path(config)
            path = path / "config.json" if path.is_dir() else path
            config = json.loads(path.read_text())
        model_type = str(config.get("model_type", ""))

        def get(*keys: str, default: Any = None) -> Any:
            for key in keys:
                if config.get(key) is not None:
                    return config[key]
            if default is not None:
                return default
            raise ValueError(f"from_hf_config: the config (model_type={model_type!r}) has none of {list(keys)}")

        if model_type in _LLAMA_TYPES:
            hidden = get("hidden_size")
            return cls(layers=get("num_hidden_layers"), hidden=hidden, heads=get("num_attention_heads"),
                       kv_heads=get("num_key_value_heads", default=get("num_attention_heads")),
                       ffn=get("intermediate_size"), vocab=get("vocab_size"),
                       seq_len=seq_len or get("max_position_embeddings"), kind="llama",
                       tied=bool(config.get("tie_word_embeddings", False)), name=name or model_type)
        if model_type in _GPT_TYPES:
            hidden = get("n_embd", "hidden_size", "d_model")
            return cls(layers=get("n_layer", "num_hidden_layers", "num_layers"), hidden=hidden,
                       heads=get("n_head", "num_attention_heads"),
                       ffn=get("n_inner", "intermediate_size", "ffn_dim", default=4 * hidden),
                       vocab=get("vocab_size"),
                       seq_len=seq_len or get("n_positions", "max_position_embeddings", default=2048),
                       kind="gpt", tied=bool(config.get("tie_word_embeddings", True)), name=name or model_type)
        raise ValueError(f"from_hf_config: model_type={model_type!r} is not a decoder-only Transformer this "
                         f"planner knows; use one of {sorted(_LLAMA_TYPES | _GPT_TYPES)}, or build a "
                         "TransformerShape by hand")


_LLAMA_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2"})
_GPT_TYPES = frozenset({"gpt2", "gpt_neox", "bloom", "opt", "gpt_bigcode"})


def _llama3(layers: int, hidden: int, heads: int, ffn: int, name: str) -> TransformerShape:
    return TransformerShape(layers=layers, hidden=hidden, heads=heads, kv_heads=8, ffn=ffn, vocab=128256,
                            seq_len=8192, kind="llama", name=name)


#: Shapes of published models (sizes from each model's ``config.json``, Meta's Llama 3.1 and
#: BigScience's BLOOM model cards).
NAMED_SHAPES: dict[str, TransformerShape] = {
    "llama3-8b": _llama3(32, 4096, 32, 14336, "Llama 3.1 8B"),
    "llama3-70b": _llama3(80, 8192, 64, 28672, "Llama 3.1 70B"),
    "llama3-405b": _llama3(126, 16384, 128, 53248, "Llama 3.1 405B"),
    "bloom-176b": TransformerShape(layers=70, hidden=14336, heads=112, ffn=4 * 14336, vocab=250880, seq_len=2048,
                                   kind="gpt", tied=True, name="BLOOM 176B"),
}


def megatron_gpt(layers: int, hidden: int, heads: int, *, seq_len: int = 2048, vocab: int = 51200,
                 name: str = "") -> TransformerShape:
    """A GPT as Megatron-LM's scaling studies size it: feed-forward 4 × hidden, tied embedding.

    Example:
        >>> round(megatron_gpt(96, 12288, 96).params() / 1e9, 1)   # GPT-3 175B
        174.6
    """
    return TransformerShape(layers=layers, hidden=hidden, heads=heads, ffn=4 * hidden, vocab=vocab,
                            seq_len=seq_len, kind="gpt", tied=True, name=name or f"GPT {layers}x{hidden}")
