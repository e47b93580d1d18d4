"""Code run on each rank by tests/test_frameworks.py: a plan's boundaries handed to DeepSpeed's PipelineModule."""

from __future__ import annotations

import torch
import torch.nn as nn

import autopipe


def uneven_layers() -> list[nn.Module]:
    """Eight layers whose widths differ, so that an equal count of layers per stage is not the plan."""
    widths = [16, 256, 256, 16, 16, 16, 16, 16, 16]
    return [nn.Sequential(nn.Linear(a, b), nn.ReLU()) for a, b in zip(widths, widths[1:])]


def deepspeed_stages(rank: int, world_size: int) -> dict:
    import deepspeed
    from deepspeed.pipe import PipelineModule

    torch.manual_seed(0)
    layers = uneven_layers()
    plan = autopipe.partition(nn.Sequential(*layers), world_size, (torch.randn(4, 16),),
                              planner=autopipe.PlannerOptions(target="deepspeed", cost="flops",
                                                              profiling=autopipe.ProfileOptions(progress=False)))
    parts = plan.to_deepspeed(num_layers=len(layers))["parts"]

    class Planned(PipelineModule):
        def _partition_layers(self, method: str = "uniform") -> None:  # DeepSpeed's hook for the boundaries
            self.parts = list(parts)
            stage = self._topo.get_coord(self.global_rank).pipe
            self._set_bounds(start=self.parts[stage], stop=self.parts[stage + 1])

    deepspeed.init_distributed(dist_backend="gloo")
    module = Planned(layers=layers, num_stages=world_size)
    held = {id(p) for p in module.parameters()}
    local = [k for k, layer in enumerate(layers) if any(id(p) in held for p in layer.parameters())]
    return {"parts": parts, "split": plan.split_points, "local": local,
            "stage_fqns": [s.fqns for s in plan.stages]}


# --------------------------------------------------------------------------- torchtitan
VOCAB, DIM, LAYERS, SEQ = 64, 32, 4, 16
MAX_SEQ = 256  # positions the rotary tables hold


def _sdpa(layers: list) -> list:
    """Causal SDPA for each block: torchtitan 0.3.0's LM backends (flex, varlen) need a GPU's block masks."""
    from torchtitan.models.common.attention import ScaledDotProductAttention

    for layer in layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return layers


def titan_model(family: str, *, layers: int = LAYERS, dim: int = DIM, vocab: int = VOCAB, seed: int = 0) -> nn.Module:
    """torchtitan 0.3.0's own ``llama3`` or ``qwen3`` model definition, built small with its own initialisation."""
    from torchtitan.models.common import Embedding, Linear, RMSNorm
    from torchtitan.models.common.rope import ComplexRoPE, CosSinRoPE

    heads = 4
    embedding = Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init={"weight": nn.init.normal_})
    head = Linear.Config(in_features=dim, out_features=vocab, param_init={"weight": nn.init.normal_})
    if family == "llama3":
        from torchtitan.models.llama3 import Llama3Model, _build_llama3_layers

        config = Llama3Model.Config(
            dim=dim, vocab_size=vocab, tok_embeddings=embedding, lm_head=head,
            norm=RMSNorm.Config(normalized_shape=dim, param_init={"weight": nn.init.ones_}),
            layers=_sdpa(_build_llama3_layers(
                n_layers=layers, dim=dim, n_heads=heads, hidden_dim=2 * dim, attn_backend="flex",
                rope=ComplexRoPE.Config(dim=dim // heads, max_seq_len=MAX_SEQ, theta=10000.0, scaling="none"))))
    elif family == "qwen3":
        from torchtitan.models.qwen3 import Qwen3Model, _build_qwen3_layers, _qwen3_norm

        config = Qwen3Model.Config(
            dim=dim, vocab_size=vocab, tok_embeddings=embedding, lm_head=head, norm=_qwen3_norm(dim),
            enable_weight_tying=False,  # torchtitan's pipeline splits untied models
            layers=_sdpa(_build_qwen3_layers(
                fuse_qkv=True, n_layers=layers, dim=dim, n_heads=heads, n_kv_heads=heads // 2, head_dim=dim // heads,
                hidden_dim=2 * dim, attn_backend="flex",
                rope=CosSinRoPE.Config(dim=dim // heads, max_seq_len=MAX_SEQ, theta=1000000.0))))
    else:
        raise ValueError(f"family={family!r}: 'llama3' or 'qwen3'")
    torch.manual_seed(seed)
    model = config.build()
    model.init_states()
    return model


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def torchtitan_step(rank: int, world_size: int, family: str, schedule: str, n_microbatches: int = 4) -> dict:
    """One step of torchtitan's own pipeline split, built from ``plan.to_torchtitan()``, next to the unsplit model.

    Every rank plans (FLOP costs: the same split everywhere), hands the exported
    ``module_fqns_per_model_part`` to torchtitan's ``_pipeline_module_split`` on a ``pp``
    mesh, steps torch's schedule of the exported name, and compares the loss and each held
    parameter's gradient with the unsplit model's on the same batch.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class
    from torchtitan.distributed.pipeline_parallel import _pipeline_module_split

    torch.set_num_threads(1)
    model = titan_model(family)
    rows = 2
    example = torch.randint(0, VOCAB, (rows, SEQ), generator=torch.Generator().manual_seed(1))
    plan = autopipe.partition(model, world_size, (example,), loss_fn=lm_loss, example_target=example,
                              schedule=schedule, n_microbatches=n_microbatches,
                              planner=autopipe.PlannerOptions(target="torchtitan", cost="flops",
                                                              profiling=autopipe.ProfileOptions(progress=False)))
    config = plan.to_torchtitan()["parallelism"]
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("pp",))
    stages, chunks = _pipeline_module_split(model, mesh, config["pipeline_parallel_schedule"], torch.device("cpu"),
                                            config["module_fqns_per_model_part"])
    cls = get_schedule_class(config["pipeline_parallel_schedule"])
    batch = config["pipeline_parallel_microbatch_size"] * n_microbatches
    pipe = cls(stages[0] if issubclass(cls, PipelineScheduleSingle) else stages, n_microbatches=n_microbatches,
               loss_fn=lm_loss)
    g = torch.Generator().manual_seed(2)
    tokens, labels = torch.randint(0, VOCAB, (batch, SEQ), generator=g), torch.randint(0, VOCAB, (batch, SEQ), generator=g)
    losses: list[torch.Tensor] = []
    first, last = any(s.is_first for s in stages), any(s.is_last for s in stages)
    pipe.step(*((tokens,) if first else ()), target=labels if last else None, losses=losses if last else None)

    reference = lm_loss(model(tokens), labels)
    reference.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    diff = {n: float("inf") if p.grad is None else (p.grad - grads[n]).abs().max().item()
            for chunk in chunks for n, p in chunk.named_parameters()}
    return {"parts": config["module_fqns_per_model_part"], "loss": torch.stack(losses).mean().item() if last else None,
            "ref_loss": reference.item(), "grad_diff": diff, "all": sorted(grads)}
