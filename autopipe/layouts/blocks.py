"""What one Transformer block computes, stores and communicates at tensor-parallel degree t.

The block is described as the matrix multiplications it runs (:class:`Matmul`, each with
how tensor parallelism shards it, Megatron-LM style), its attention core and its
memory-bound work. From that description come, per token and per rank:

- forward FLOPs (:func:`block_flops`), sharded matmuls at 1/t, the rest whole;
- parameters held (:func:`block_params_per_rank`);
- bytes kept for the backward under each activation-checkpointing mode
  (:func:`activation_bytes`), with and without sequence parallelism;
- the collectives tensor parallelism adds (:func:`tp_collectives`).

Sharding, as Megatron-LM (Shoeybi et al. 2019) and torchtitan shard a block: the query,
key-value, gate and up projections column-wise (each rank computes 1/t of the output
features), the attention output and the down projection row-wise (1/t of the input
features, then an all-reduce, or a reduce-scatter with sequence parallelism), so each
attention and feed-forward half needs one collective in the forward and one in the
backward. Norms are replicated, or sharded along the sequence with sequence parallelism.

Example:
    >>> from autopipe.layouts.shapes import TransformerShape
    >>> s = TransformerShape.named("llama3-8b")
    >>> [m.name for m in block_matmuls(s)]
    ['q', 'kv', 'out', 'gate_up', 'down']
    >>> block_flops(s, tp=1)["matmul"] == 2 * block_matmul_params(s)   # 2 FLOPs per weight per token
    True
"""

from __future__ import annotations

from dataclasses import dataclass

from ..planning.options import BLOCK_RECOMPUTE
from .shapes import TransformerShape

#: Activation-checkpointing modes of a block: ``"none"`` keeps everything the backward
#: reads, ``"selective"`` recomputes the cheap parts (the attention core and its softmax for a
#: GPT, as Korthikanti et al. 2022; for a Llama block, torchtitan's op-level policy: the
#: element-wise ops and every second matmul), ``"full"`` keeps only the block's input.
RECOMPUTE_MODES = ("none", *BLOCK_RECOMPUTE)


@dataclass(frozen=True)
class Matmul:
    """One weight matrix of a block: ``out_features x in_features`` applied to every token.

    ``shard`` is how tensor parallelism splits it: ``"column"`` (output features),
    ``"row"`` (input features).
    """

    name: str
    out_features: int
    in_features: int
    shard: str

    def flops_per_token(self, tp: int) -> float:
        return 2.0 * self.out_features * self.in_features / tp

    def shape_at(self, tp: int) -> tuple[int, int]:
        """``(n, k)`` of the GEMM a rank runs: its output and its reduction width."""
        if self.shard == "column":
            return self.out_features // tp, self.in_features
        return self.out_features, self.in_features // tp


def block_matmuls(shape: TransformerShape) -> list[Matmul]:
    """The block's weight matrices in forward order, each with its sharding."""
    h, f, kv = shape.hidden, shape.ffn, shape.kv_width
    if shape.kind == "gpt":
        return [Matmul("qkv", h + 2 * kv, h, "column"), Matmul("out", h, h, "row"),
                Matmul("fc1", f, h, "column"), Matmul("fc2", h, f, "row")]
    return [Matmul("q", h, h, "column"), Matmul("kv", 2 * kv, h, "column"), Matmul("out", h, h, "row"),
            Matmul("gate_up", 2 * f, h, "column"), Matmul("down", h, f, "row")]


def block_matmul_params(shape: TransformerShape) -> int:
    return sum(m.out_features * m.in_features for m in block_matmuls(shape))


def tp_divides(shape: TransformerShape, tp: int) -> str | None:
    """None when every sharded dimension divides by ``tp``, else why not."""
    if shape.heads % tp:
        return f"{shape.heads} attention heads do not divide by tp={tp}"
    if shape.kv_heads % tp:
        return f"{shape.kv_heads} key-value heads do not divide by tp={tp}"
    if shape.ffn % tp:
        return f"the feed-forward width {shape.ffn} does not divide by tp={tp}"
    return None


def attention_flops_per_token(shape: TransformerShape, tp: int, *, causal_skip: bool) -> float:
    """Forward FLOPs of the attention core (scores and weighted values) per token and rank.

    ``causal_skip``: the kernel skips the masked half (flash attention with a causal mask);
    otherwise the full ``seq_len x seq_len`` scores are computed, as published FLOP counts
    assume.
    """
    full = 4.0 * shape.seq_len * shape.hidden / tp
    return full / 2 if causal_skip else full


def block_flops(shape: TransformerShape, tp: int, *, causal_skip: bool = False) -> dict[str, float]:
    """Forward FLOPs per token and rank: ``{"matmul": ..., "attention": ...}``."""
    return {"matmul": sum(m.flops_per_token(tp) for m in block_matmuls(shape)),
            "attention": attention_flops_per_token(shape, tp, causal_skip=causal_skip)}


def block_params_per_rank(shape: TransformerShape, tp: int) -> float:
    """Parameters of one block a rank holds: matrices and their biases at 1/t, norms whole."""
    sharded = block_matmul_params(shape)
    if shape.kind == "gpt":
        sharded += shape.hidden + 2 * shape.kv_width + shape.ffn  # column-parallel biases
    return sharded / tp + (shape.block_params() - sharded)


def activation_bytes(shape: TransformerShape, tp: int, *, recompute: str, sequence_parallel: bool,
                     flash: bool, dtype_bytes: int = 2, sp_regather: bool = False) -> float:
    """Bytes one block keeps for its backward, per token and rank.

    A GPT block follows Korthikanti et al. 2022 (Sec. 4, per token: 34h with dropout masks,
    plus 5as for the unfused attention's scores, softmax and its dropout; 10h of it is
    replicated across tensor-parallel ranks unless sequence parallelism shards it). A Llama
    block, as torch's tensor-parallel API runs it, keeps per token both norm inputs, both
    norm outputs as the column-parallel projections gathered them (whole even with sequence
    parallelism, unless ``sp_regather``), q, k, v, the attention output, and the
    feed-forward's gate, up, activation and product (4f). Selective checkpointing is
    torchtitan's op-level policy: the input, every other matmul's output in forward order (q,
    v, gate, down before its reduction) and the attention output are kept.

    Args:
        recompute: one of :data:`RECOMPUTE_MODES`.
        sequence_parallel: norms and residuals sharded along the sequence (tp > 1).
        flash: the attention kernel keeps no ``seq x seq`` scores.
        sp_regather: with sequence parallelism, the backward gathers the norm outputs again
            rather than keep them whole (Megatron-LM; Korthikanti's count assumes it).
    """
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"recompute={recompute!r} is not a checkpointing mode; use one of {RECOMPUTE_MODES}")
    h, f, kv, a, s = shape.hidden, shape.ffn, shape.kv_width, shape.heads, shape.seq_len
    replicated_share = 1 / tp if sequence_parallel else 1.0
    gathered_share = replicated_share if sp_regather else 1.0  # the two norm outputs
    if recompute == "full":  # the block's input, the residual stream
        return dtype_bytes * h * replicated_share
    scores = 0.0 if flash else 2.5 * a * s / tp  # 5as bytes at two-byte elements: scores, softmax, mask
    if shape.kind == "gpt":
        # Korthikanti's 34h at two-byte elements: 10h replicated (2h of it the norm outputs), 24h sharded.
        kept = 3 * h * replicated_share + 2 * h * gathered_share + 12 * h / tp
        if recompute == "selective":  # the attention core is recomputed: its scores go
            return dtype_bytes * kept
        return dtype_bytes * (kept + scores)
    if recompute == "selective":
        return dtype_bytes * (h * replicated_share + (2 * h + kv + f) / tp + h + scores)
    norms = 2 * h * replicated_share + 2 * h * gathered_share
    return dtype_bytes * (norms + (2 * h + 2 * kv) / tp + 4 * f / tp + scores)


def memory_bound_bytes(shape: TransformerShape, tp: int, *, sequence_parallel: bool, dtype_bytes: int = 2
                       ) -> float:
    """Bytes the block's element-wise work (norms, rotary, activation, residuals, dropout)
    reads and writes in the forward, per token and rank."""
    h, f, kv = shape.hidden, shape.ffn, shape.kv_width
    replicated_share = 1 / tp if sequence_parallel else 1.0
    per_h = 10 * h  # two norms (read, write) and two residual adds (read two, write one)
    if shape.kind == "gpt":
        per_h += 6 * h  # dropouts after attention and feed-forward, with their masks
        sharded = 3 * f + (h + 2 * kv)  # GeLU (read, write, bias) and the qkv bias add
    else:
        sharded = 3 * f + 2 * (h + kv)  # SiLU gate times up; rotary on q and k
    return dtype_bytes * (per_h * replicated_share + sharded / tp)


def tp_collectives(tp: int, *, recompute: str) -> dict[str, int]:
    """Collectives over the tensor-parallel group per block and micro-batch, each moving the
    block's ``tokens x hidden`` activation: ``{"forward": n, "backward": n}``.

    Two in the forward (after attention, after the feed-forward) and two in the backward (the
    gradients of the column-parallel inputs); full recomputation runs the forward's twice
    more. With sequence parallelism each is a reduce-scatter or an all-gather of the same
    total bytes as an all-reduce's two phases.
    """
    if tp == 1:
        return {"forward": 0, "backward": 0}
    return {"forward": 2, "backward": 2 + (2 if recompute == "full" else 0)}
