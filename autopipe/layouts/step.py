"""A layout's training step on N GPUs: time, memory per GPU and what limits it.

:func:`predict_step` charges a :class:`~autopipe.layouts.layout.Layout` on a
:class:`~autopipe.layouts.gpu.GpuCosts`:

- each rank's forward and backward per micro-batch: its blocks (:mod:`.blocks`), and the
  embedding or the output layer and loss on the first and last rank; recomputation in the
  backward; tensor-parallel collectives on the critical path (half hidden with async TP);
  the sends to the pipeline neighbours;
- the schedule: ``m`` micro-batches through ``p`` ranks take ``m x slowest + (p - 1) / v x
  mean`` (1F1B and GPipe: ``v = 1``; Interleaved 1F1B with ``v`` stages per rank);
- data parallelism: gradients all-reduced (replicate), reduce-scattered with parameters
  all-gathered (ZeRO-1, FSDP), hidden behind the backward where the runtime overlaps them;
- the optimizer step, memory-bound over the rank's shard of the parameters.

Ranks are ordered tensor-parallel first, then data-parallel, then pipeline (Megatron-LM's
and torchtitan's order), so a tensor-parallel group shares a node whenever ``tp <=
gpus_per_node``.

Example:
    >>> from autopipe.layouts.shapes import TransformerShape
    >>> from autopipe.layouts.gpu import GpuCosts
    >>> from autopipe.layouts.layout import Layout
    >>> from autopipe.machine.topology import Topology
    >>> gpu = GpuCosts("H100", Topology(gpus_per_node=8))
    >>> shape = TransformerShape.named("llama3-8b")
    >>> p = predict_step(shape, Layout(dp=8, micro_batch=2, global_batch=16, dp_mode="fsdp",
    ...                                recompute="selective"), gpu)
    >>> p.layout.n_microbatches, p.tokens_per_s_per_gpu > 0, sorted(p.memory_parts)
    (1, True, ['activations', 'logits', 'parameters_and_optimizer', 'reserved'])
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from .blocks import (activation_bytes, attention_flops_per_token, block_matmul_params, block_matmuls,
                     block_params_per_rank, memory_bound_bytes, tp_collectives, tp_divides)
from .exports import megatron_arguments, pipeline_options, torchtitan_fields
from .gpu import GpuCosts
from .layout import Layout
from .shapes import TransformerShape

#: Bytes of state per parameter beside the bf16/fp16 weight, by data-parallel mode: an fp32
#: gradient, an fp32 master copy and Adam's two fp32 moments (Megatron-LM's mixed precision).
GRAD_BYTES, MASTER_AND_ADAM_BYTES = 4, 12
#: Bytes the optimizer step reads and writes per parameter it updates (master, moments,
#: gradient in fp32; the new low-precision weight).
OPTIMIZER_STEP_BYTES = 30
#: Memory every rank holds beyond the model: the CUDA context, NCCL's buffers, allocator slack.
RESERVED_BYTES = 3e9
#: Share of the tensor-parallel collectives left on the critical path with async TP
#: (torchtitan's micro-pipelined all-gather and reduce-scatter): stated, not fitted.
ASYNC_TP_EXPOSED = 0.5


@dataclass
class StepPrediction:
    """What :func:`predict_step` charges a layout: seconds, bytes and their parts."""

    layout: Layout
    shape: TransformerShape  # the model it was charged for
    step_s: float
    tokens_per_s_per_gpu: float
    mfu: float  # model FLOPs (6 N + attention, no recomputation) per second over the dense peak
    memory_bytes: float  # on the fullest rank
    parts_s: dict[str, float] = field(default_factory=dict)  # compute, recompute, tp_comm, pp_comm, bubble, dp_comm, optimizer
    memory_parts: dict[str, float] = field(default_factory=dict)

    def to_torchtitan(self) -> dict[str, Any]:
        """This layout as torchtitan's config fields.

        Returns:
            torchtitan's config sections; a choice torchtitan cannot express raises ValueError
            naming it (:func:`~autopipe.layouts.exports.torchtitan_fields`).

        Example:
            >>> from autopipe.machine.topology import Topology
            >>> layout = Layout(tp=8, dp=32, micro_batch=16, global_batch=512, dp_mode="fsdp", recompute="full")
            >>> p = predict_step(TransformerShape.named("llama3-70b"), layout, GpuCosts("H100", Topology()))
            >>> p.to_torchtitan()["parallelism"]["tensor_parallel_degree"], p.to_torchtitan()["activation_checkpoint"]
            (8, 'full')
        """
        return torchtitan_fields(self.layout, self.shape)

    def to_megatron(self) -> list[str]:
        """This layout as Megatron-LM's arguments.

        Returns:
            The arguments, each flag followed by its value; a choice Megatron-LM cannot express
            raises ValueError naming it (:func:`~autopipe.layouts.exports.megatron_arguments`).

        Example:
            >>> from autopipe.machine.topology import Topology
            >>> layout = Layout(tp=4, pp=2, dp=4, micro_batch=1, global_batch=64, dp_mode="zero1")
            >>> p = predict_step(TransformerShape.named("llama3-8b"), layout, GpuCosts("A100", Topology()))
            >>> p.to_megatron()[:4]
            ['--tensor-model-parallel-size', '4', '--pipeline-model-parallel-size', '2']
        """
        return megatron_arguments(self.layout, self.shape)

    def to_pipeline(self) -> dict[str, Any]:
        """This layout as ``autopipe.Pipeline``'s keyword arguments.

        Returns:
            ``schedule``, ``n_microbatches``, ``stages_per_rank``, ``data_parallel`` and
            ``planner``; a choice the Pipeline does not run raises ValueError naming it
            (:func:`~autopipe.layouts.exports.pipeline_options`).

        Example:
            >>> from autopipe.machine.topology import Topology
            >>> layout = Layout(tp=2, pp=2, dp=2, micro_batch=1, global_batch=16, dp_mode="fsdp")
            >>> p = predict_step(TransformerShape.named("llama3-8b"), layout, GpuCosts("A100", Topology()))
            >>> p.to_pipeline()["data_parallel"].loss_parallel
            True
        """
        return pipeline_options(self.layout)

    def to_dict(self) -> dict:
        return {"layout": asdict(self.layout), "describe": self.layout.describe(), "step_s": self.step_s,
                "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu, "mfu": self.mfu,
                "memory_bytes": self.memory_bytes, "parts_s": dict(self.parts_s),
                "memory_parts": dict(self.memory_parts)}


def layout_problem(shape: TransformerShape, layout: Layout, gpus_per_node: int) -> str | None:
    """None when ``layout`` can run ``shape``, else why not (a sentence naming the degree)."""
    if layout.tp > 1:
        why = tp_divides(shape, layout.tp)
        if why:
            return why
    if layout.tp > gpus_per_node:
        return f"tp={layout.tp} spans more than one node of {gpus_per_node} GPUs"
    chunks = layout.pp * layout.virtual_stages
    if chunks > shape.layers:
        return f"pp x virtual stages = {chunks} exceeds the {shape.layers} blocks"
    return None


def model_flops_per_token(shape: TransformerShape) -> float:
    """Training FLOPs per token without recomputation: 6 x matrix parameters (output layer
    included) plus the attention core's 12 x layers x hidden x seq_len (no causal discount,
    as torchtitan and the Llama 3 paper count MFU)."""
    matrix = shape.layers * block_matmul_params(shape)
    return 6.0 * (matrix + shape.vocab * shape.hidden) + 12.0 * shape.layers * shape.hidden * shape.seq_len


def block_times(shape: TransformerShape, layout: Layout, gpu: GpuCosts, tokens: int) -> dict[str, float]:
    """Seconds of one block of ``shape`` for a micro-batch of ``tokens`` tokens under
    ``layout``'s degree and options: ``{"fwd", "bwd", "full", "selective",
    "tp_collective_s"}`` (forward and backward compute, what full and selective
    recomputation re-run, one tensor-parallel collective's exposed seconds)."""
    t = layout.tp
    mm_s = {m.name: gpu.gemm_s(tokens, *m.shape_at(t), fp8=layout.float8) for m in block_matmuls(shape)}
    fwd_mm = sum(mm_s.values())
    if layout.float8:  # casts of each GEMM's activation input to float8 (read bf16, write fp8) and amax
        fwd_mm += gpu.memory_s(sum(3.0 * tokens * m.shape_at(t)[1] for m in block_matmuls(shape)))
    if layout.flash:
        attn_f = gpu.flash_attention_s(tokens * attention_flops_per_token(shape, t, causal_skip=True))
        attn_b = 2.5 * attn_f  # the backward recomputes the scores: 5 GEMM-sized passes to the forward's 2
    else:  # scores materialized: batched GEMMs at the GEMM rate, softmax and mask over the scores
        scores = tokens * shape.heads / t * shape.seq_len * gpu.dtype_bytes
        attn_f = tokens * attention_flops_per_token(shape, t, causal_skip=False) / gpu.gemm_rate() \
            + gpu.memory_s(4 * scores)
        attn_b = 2 * attn_f
    elementwise = gpu.memory_s(tokens * memory_bound_bytes(shape, t, sequence_parallel=layout.sequence_parallel,
                                                           dtype_bytes=gpu.dtype_bytes))
    if layout.compiled:
        elementwise *= gpu.efficiency.compiled_memory
    fwd = fwd_mm + attn_f + elementwise
    bwd = 2 * fwd_mm + attn_b + 2 * elementwise
    # Selective recomputation re-runs the cheap part: the attention core of a GPT block
    # (Korthikanti et al.); for a Llama block (torchtitan's op-level policy) the element-wise
    # ops and the matmuls whose outputs it drops, k, out and up (halves of the fused kv and
    # gate_up GEMMs here).
    if shape.kind == "gpt":
        selective = attn_f + elementwise
    else:
        selective = elementwise + mm_s["kv"] / 2 + mm_s["out"] + mm_s["gate_up"] / 2
    message = tokens * shape.hidden * gpu.dtype_bytes
    one = gpu.allreduce_s(message, t, crosses_nodes=t > gpu.topology.gpus_per_node)
    exposed = ASYNC_TP_EXPOSED if layout.async_tp else 1.0
    return {"fwd": fwd, "bwd": bwd, "full": fwd, "selective": selective, "tp_collective_s": one * exposed}


def predict_step(shape: TransformerShape, layout: Layout, gpu: GpuCosts) -> StepPrediction:
    """Charge one training step of ``shape`` under ``layout`` on ``gpu``'s cluster.

    Args:
        shape: the model.
        layout: every degree and option (see :class:`Layout`).
        gpu: the accelerator, its links and the efficiency shares.

    Returns:
        A :class:`StepPrediction`: step seconds with their parts, tokens/s per GPU, MFU,
        and the bytes of the fullest rank with their parts.

    Raises:
        ValueError: a layout that cannot run ``shape`` (:func:`layout_problem` says why).
    """
    why = layout_problem(shape, layout, gpu.topology.gpus_per_node)
    if why:
        raise ValueError(f"predict_step layout={layout.describe()!r} cannot run {shape.name or 'the model'}: {why}")
    t, p, d, v = layout.tp, layout.pp, layout.dp, layout.virtual_stages
    m = layout.n_microbatches
    tokens = layout.micro_batch * shape.seq_len
    node = gpu.topology.gpus_per_node
    blk = block_times(shape, layout, gpu, tokens)
    blocks = layout.blocks_per_rank(shape.layers)
    checkpointed = blocks if layout.recompute_layers is None else min(layout.recompute_layers, blocks)
    recompute_s = checkpointed * blk[layout.recompute] if layout.recompute != "none" else 0.0
    # Checkpointed blocks run their mode's collectives, the others those of no recomputation.
    kept, plain = tp_collectives(t, recompute=layout.recompute), tp_collectives(t, recompute="none")
    tp_fwd = blocks * plain["forward"] * blk["tp_collective_s"]
    tp_bwd = (checkpointed * kept["backward"] + (blocks - checkpointed) * plain["backward"]) * blk["tp_collective_s"]

    # The output layer and its loss (last rank): a vocabulary-sharded GEMM and the softmax over it.
    head_f = gpu.gemm_s(tokens, shape.vocab / t, shape.hidden) + gpu.memory_s(tokens * shape.vocab / t * 4 * 3)
    head_b = 2 * head_f
    # Sends to the pipeline neighbours: one activation per micro-batch and stage boundary each way,
    # split over the tensor-parallel ranks (Megatron's scatter-gather); crossing nodes when a
    # pipeline neighbour is tp x dp ranks away.
    send = 0.0
    if p > 1:
        send = v * gpu.send_s(tokens * shape.hidden * gpu.dtype_bytes / t, crosses_nodes=t * d >= node)
    fwd_body = blocks * blk["fwd"] + tp_fwd + send
    bwd_body = blocks * blk["bwd"] + recompute_s + tp_bwd + send
    last = fwd_body + bwd_body + head_f + head_b
    mean = (p * (fwd_body + bwd_body) + head_f + head_b) / p
    pipeline_s = m * last + (p - 1) / v * mean

    # Data parallelism over the rank's parameters.
    params = blocks * block_params_per_rank(shape, t) + shape.vocab * shape.hidden / t
    dp_cross = t * d > node
    dp_s = 0.0
    if d > 1:
        if layout.dp_mode == "replicate":
            dp_s = gpu.allreduce_s(params * GRAD_BYTES, d, crosses_nodes=dp_cross)
        else:
            gathers = 1 if layout.dp_mode == "zero1" or p > 1 else 2  # FSDP re-gathers for the backward
            dp_s = gpu.allgather_s(params * gpu.dtype_bytes, d, crosses_nodes=dp_cross) * gathers \
                + gpu.allgather_s(params * GRAD_BYTES, d, crosses_nodes=dp_cross)
    if layout.overlap_dp and d > 1:
        # Hidden behind the compute it overlaps (the step's backward; FSDP also the forward),
        # but for one block's share, which waits on the first gather or the last reduction.
        window = m * (bwd_body + (fwd_body if layout.dp_mode == "fsdp" else 0.0))
        dp_exposed = max(dp_s - window, dp_s / max(blocks, 1))
    else:
        dp_exposed = dp_s
    sharded_state = d if layout.dp_mode in ("zero1", "fsdp") else 1
    optimizer_s = gpu.memory_s(params / sharded_state * OPTIMIZER_STEP_BYTES)
    step_s = pipeline_s + dp_exposed + optimizer_s

    compute = m * (blocks * (blk["fwd"] + blk["bwd"]) + head_f + head_b)
    parts = {"compute": compute, "recompute": m * recompute_s, "tp_comm": m * (tp_fwd + tp_bwd),
             "pp_comm": m * 2 * send, "bubble": pipeline_s - m * last, "dp_comm": dp_exposed, "optimizer": optimizer_s}
    memory = _memory(shape, layout, params, blocks, checkpointed, tokens, gpu)
    tokens_per_s = layout.global_batch * shape.seq_len / step_s / layout.n_gpus
    mfu = tokens_per_s * model_flops_per_token(shape) / gpu.peak
    return StepPrediction(layout, shape, step_s, tokens_per_s, mfu, sum(memory.values()), parts, memory)


def _memory(shape: TransformerShape, layout: Layout, params: float, blocks: int, checkpointed: int,
            tokens: int, gpu: GpuCosts) -> dict[str, float]:
    """Bytes on the fullest rank: weights, gradients and optimizer state, activations in
    flight (the first rank's), the loss's logits, and what every process reserves."""
    t, p, d, v = layout.tp, layout.pp, layout.dp, layout.virtual_stages
    w = gpu.dtype_bytes
    if layout.dp_mode == "fsdp":
        state = params * (w + GRAD_BYTES + MASTER_AND_ADAM_BYTES) / d
        # Gathered low-precision weights: one block at a time; with a pipeline, the whole
        # rank's, and their gradients unsharded too, as torchtitan keeps both between
        # micro-batches (no re-sharding, one gradient reduction on the last micro-batch).
        state += params * w * 2 if p > 1 else params / blocks * w * 2
    elif layout.dp_mode == "zero1":
        state = params * (w + GRAD_BYTES) + params * MASTER_AND_ADAM_BYTES / d
    else:
        state = params * (w + GRAD_BYTES + MASTER_AND_ADAM_BYTES)
    m = layout.n_microbatches
    if layout.schedule == "GPipe":
        in_flight = m * v
    elif v > 1:  # Interleaved 1F1B's warm-up on the first rank, in stage-chunks of blocks / v
        in_flight = min(m * v, 2 * (p - 1) + (v - 1) * p + 1)
    else:
        in_flight = min(m, p)
    per_chunk = blocks / v
    sp, flash = layout.sequence_parallel, layout.flash
    kept = activation_bytes(shape, t, recompute=layout.recompute, sequence_parallel=sp, flash=flash,
                            sp_regather=layout.sp_regather)
    whole = activation_bytes(shape, t, recompute="none", sequence_parallel=sp, flash=flash,
                             sp_regather=layout.sp_regather)
    frac = checkpointed / blocks
    per_block = frac * kept + (1 - frac) * whole
    activations = in_flight * per_chunk * per_block * tokens
    if layout.recompute != "none":
        activations += whole * tokens  # the block being recomputed holds its whole activations
    # The loss as torchtitan computes it, cross_entropy(logits.float()): the logits, their fp32
    # copy and log-softmax in the forward; the log-softmax, its gradient and the logits'
    # gradient, all fp32, in the backward.
    logits = tokens * shape.vocab / t * max(w + 8, 12)
    return {"parameters_and_optimizer": state, "activations": activations, "logits": logits,
            "reserved": RESERVED_BYTES}
