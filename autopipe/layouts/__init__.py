"""Layouts at scale: tensor, pipeline and data parallelism, micro-batches, the schedule and
per-block checkpointing of a Transformer on N GPUs, charged and searched together.

In the order the data flows:

1. **Shape.** :mod:`.shapes`: the model's sizes, from a Hugging Face ``config.json`` or a
   named published shape.
2. **Block costs.** :mod:`.sharding` reads from a traced graph what tensor parallelism can
   shard (column/row pairs, heads, the output layer) and the shape of a decoder stack;
   :mod:`.blocks`: what one block computes, keeps and communicates at tensor-parallel
   degree t, under each checkpointing mode.
3. **Device costs.** :mod:`.gpu`: GEMMs, attention, element-wise work and collectives on a
   data-sheet GPU and its links, with the stated or fitted efficiency shares;
   :mod:`.calibrate` rescales them to one block measured on the GPU at hand.
4. **Step.** :mod:`.layout` holds every choice of a :class:`Layout`; :mod:`.step` charges
   one: step time, tokens/s and memory per GPU, MFU, and the parts that hold it back.
5. **Search.** :mod:`.search`: every layout of N GPUs ranked, the fastest that fits first.
6. **Exports.** :mod:`.exports`: a layout in torchtitan's config fields and Megatron-LM's
   arguments.

Example:
    >>> from autopipe.layouts import GpuCosts, Layout, TransformerShape, predict_step
    >>> from autopipe.machine.topology import Topology
    >>> gpu = GpuCosts("H100", Topology(gpus_per_node=8))
    >>> p = predict_step(TransformerShape.named("llama3-70b"),
    ...                  Layout(tp=8, dp=32, micro_batch=16, global_batch=512, dp_mode="fsdp",
    ...                         recompute="full", sequence_parallel=True), gpu)
    >>> p.layout.n_gpus
    256
"""

from __future__ import annotations

from .._lazy import lazy_exports

# Public name -> the module that defines it, loaded on first use.
_PUBLIC = {
    "TransformerShape": "shapes",
    "GpuCosts": "gpu",
    "Efficiency": "gpu",
    "Layout": "layout",
    "StepPrediction": "step",
    "predict_step": "step",
    "LayoutSearch": "search",
    "search_layouts": "search",
    "find_tensor_parallel": "sharding",
    "shape_from_graph": "sharding",
    "calibrate_on_block": "calibrate",
    "torchtitan_fields": "exports",
    "megatron_arguments": "exports",
    "pipeline_options": "exports",
}

__all__ = list(_PUBLIC)

__getattr__, __dir__ = lazy_exports(__name__, _PUBLIC)
