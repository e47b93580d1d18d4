"""A :class:`~autopipe.layouts.layout.Layout` in the words of the frameworks that run it.

- :func:`torchtitan_fields`: torchtitan 0.3.0's trainer config: its ``parallelism``,
  ``training`` and ``compile`` fields, the activation-checkpointing policy, the model
  converters.
- :func:`megatron_arguments`: Megatron-LM's command-line arguments; the parallelism and
  recomputation ones are megatron-core config fields (``--tensor-model-parallel-size`` is
  ``tensor_model_parallel_size``).
- :func:`pipeline_options`: ``autopipe.Pipeline``'s own keyword arguments.

A choice the framework cannot express is refused by name rather than dropped.

Example:
    >>> from autopipe.layouts.shapes import TransformerShape
    >>> from autopipe.layouts.layout import Layout
    >>> layout = Layout(tp=8, pp=4, dp=2, micro_batch=1, global_batch=64, schedule="Interleaved1F1B",
    ...                 virtual_stages=2, recompute="full", recompute_layers=3, sequence_parallel=True,
    ...                 dp_mode="zero1")
    >>> " ".join(megatron_arguments(layout, TransformerShape.named("llama3-70b")))[:120]
    '--tensor-model-parallel-size 8 --pipeline-model-parallel-size 4 --virtual-pipeline-model-parallel-size 2 --sequence-para'
"""

from __future__ import annotations

from typing import Any

from ..planning.options import DataParallelOptions, PlannerOptions
from .layout import Layout
from .shapes import TransformerShape


def torchtitan_fields(layout: Layout, shape: TransformerShape) -> dict[str, Any]:
    """torchtitan 0.3.0's trainer config for ``layout``: the fields of its ``parallelism``,
    ``training`` and ``compile`` sections, the ``activation_checkpoint`` policy
    (``"selective"``, ``"full"`` or ``"none"``, its subcommand names) and the model
    converters (``Float8LinearConverter`` for float8).

    Raises:
        ValueError: ZeRO-1 (torchtitan shards with FSDP or replicates), checkpointing only
            some blocks (torchtitan 0.3.0 applies one policy to every block), or
            ``sp_regather`` (torch's tensor-parallel API keeps the gathered inputs).
    """
    if layout.dp_mode == "zero1":
        raise ValueError("Layout dp_mode='zero1' has no torchtitan equivalent: torchtitan replicates "
                         "(data_parallel_replicate_degree) or shards with FSDP (data_parallel_shard_degree)")
    if layout.sp_regather and layout.sequence_parallel:
        raise ValueError("Layout sp_regather=True: torchtitan keeps the inputs sequence parallelism gathers "
                         "(torch's tensor-parallel API); charge sp_regather=False to export")
    if layout.recompute_layers is not None and layout.recompute != "none":
        raise ValueError(f"Layout recompute_layers={layout.recompute_layers}: torchtitan 0.3.0 checkpoints every "
                         "block with one policy; export recompute_layers=None (all blocks) instead")
    parallelism: dict[str, Any] = {
        "data_parallel_replicate_degree": layout.dp if layout.dp_mode == "replicate" else 1,
        "data_parallel_shard_degree": layout.dp if layout.dp_mode == "fsdp" else 1,
        "tensor_parallel_degree": layout.tp,
        "enable_sequence_parallel": layout.sequence_parallel,
        "pipeline_parallel_degree": layout.pp,
    }
    if layout.pp > 1:
        parallelism["pipeline_parallel_schedule"] = layout.schedule
        parallelism["pipeline_parallel_microbatch_size"] = layout.micro_batch
        parallelism["pipeline_parallel_layers_per_stage"] = layout.blocks_per_rank(shape.layers) // layout.virtual_stages
    fields: dict[str, Any] = {
        "parallelism": parallelism,
        "training": {"local_batch_size": layout.global_batch // layout.dp, "global_batch_size": layout.global_batch,
                     "seq_len": shape.seq_len},
        "compile": {"enable": layout.compiled, "enable_async_tensor_parallel": layout.async_tp},
        "activation_checkpoint": layout.recompute,
    }
    if layout.float8:
        fields["model_converters"] = ["Float8LinearConverter"]
    return fields


def megatron_arguments(layout: Layout, shape: TransformerShape) -> list[str]:
    """Megatron-LM's arguments for ``layout``.

    Raises:
        ValueError: async tensor parallelism (Megatron overlaps its TP communication with
            its own options, not expressed here), or stages that do not divide the blocks.
    """
    chunks = layout.pp * layout.virtual_stages
    if shape.layers % chunks:
        raise ValueError(f"Layout pp x virtual_stages = {chunks} does not divide the {shape.layers} blocks: "
                         "Megatron-LM's uniform stages need it to (give an uneven split with "
                         "--pipeline-model-parallel-layout from Plan.to_megatron instead)")
    args = ["--tensor-model-parallel-size", str(layout.tp), "--pipeline-model-parallel-size", str(layout.pp)]
    if layout.virtual_stages > 1:
        args += ["--virtual-pipeline-model-parallel-size", str(layout.virtual_stages)]
    if layout.sequence_parallel:
        args.append("--sequence-parallel")
    if layout.recompute == "selective":
        args += ["--recompute-granularity", "selective"]
    elif layout.recompute == "full":
        if layout.recompute_layers is None:
            args += ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
        elif layout.recompute_layers > 0:
            args += ["--recompute-granularity", "full", "--recompute-method", "block",
                     "--recompute-num-layers", str(layout.recompute_layers)]
    args += ["--micro-batch-size", str(layout.micro_batch), "--global-batch-size", str(layout.global_batch),
             "--seq-length", str(shape.seq_len)]
    if layout.dp_mode == "zero1":
        args.append("--use-distributed-optimizer")
    elif layout.dp_mode == "fsdp":
        args.append("--use-torch-fsdp2")
    if layout.overlap_dp and layout.dp > 1:
        args.append("--overlap-grad-reduce")
    if layout.flash:
        args.append("--use-flash-attn")
    if layout.float8:
        args += ["--fp8-format", "hybrid"]  # megatron-core's TransformerConfig.fp8
    if layout.async_tp:
        raise ValueError("Layout async_tp=True: Megatron-LM overlaps tensor-parallel communication with its own "
                         "options (--tp-comm-overlap, with Transformer Engine); set async_tp=False to export")
    return args


def pipeline_options(layout: Layout) -> dict[str, Any]:
    """``autopipe.Pipeline``'s keyword arguments for ``layout``, to run it on ``layout.gpus`` ranks:
    the schedule, the micro-batches each replica runs per step, the mesh's degrees (the output
    layer sharded along the vocabulary, as every tp > 1 layout is charged) and per-block
    checkpointing. The split points are the Pipeline's own to plan.

    Raises:
        ValueError: ZeRO-1 (the Pipeline shards with FSDP2 or replicates), checkpointing only
            some blocks, float8 GEMMs, asynchronous tensor parallelism or ``sp_regather``, none of
            which the Pipeline runs.

    Example:
        >>> layout = Layout(tp=2, pp=2, dp=2, micro_batch=1, global_batch=16, recompute="selective",
        ...                 sequence_parallel=True, dp_mode="fsdp")
        >>> options = pipeline_options(layout)
        >>> options["n_microbatches"], options["data_parallel"].tensor_parallel, options["planner"].recompute
        (8, 2, 'selective')
    """
    refused = {"dp_mode='zero1'": layout.dp_mode == "zero1", "float8=True": layout.float8,
               "async_tp=True": layout.async_tp, "sp_regather=True": layout.sp_regather and layout.sequence_parallel,
               f"recompute_layers={layout.recompute_layers}": layout.recompute_layers is not None
               and layout.recompute != "none"}
    for choice, on in refused.items():
        if on:
            raise ValueError(f"Layout {choice}: autopipe.Pipeline does not run it (it shards with FSDP2 or "
                             "replicates, checkpoints every block alike, in the layout's precision, with torch's "
                             "tensor-parallel API); export the layout without it")
    data_parallel = DataParallelOptions(degree=layout.dp, mode=layout.dp_mode if layout.dp > 1 else None,
                                        tensor_parallel=layout.tp, loss_parallel=layout.tp > 1,
                                        sequence_parallel=layout.sequence_parallel and layout.tp > 1)
    return {"schedule": layout.schedule, "n_microbatches": layout.global_batch // (layout.dp * layout.micro_batch),
            "stages_per_rank": layout.virtual_stages, "data_parallel": data_parallel,
            "planner": PlannerOptions(recompute=layout.recompute if layout.recompute != "none" else False,
                                      compile=layout.compiled)}
