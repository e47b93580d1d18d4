"""What each rank runs in the tensor-parallel stage tests (spawned by tests/_dist_utils.run_world).

Every rank traces the same model, keeps one stage holding all of it, shards it over a
tensor-parallel mesh of the whole world, and runs a forward and a backward. The unsplit model,
run in the same process on the same batch, is the reference.
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from autopipe.layouts.sharding import find_tensor_parallel
from autopipe.models import seed_transformer
from autopipe.planning.tracing import trace
from autopipe.runtime.stages import split_model
from autopipe.runtime.tensor_parallel import parallelize_stage, tensor_parallel_context


class _Logits(nn.Module):
    """A Hugging Face causal LM returning its logits alone."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, use_cache=False).logits


def _model(name: str, layers: int = 2) -> tuple[nn.Module, tuple]:
    if name == "seed_transformer":
        return seed_transformer(num_layers=layers, dropout=0.0)
    if name == "qwen2":  # biases on the query, key and value projections
        import transformers

        config = transformers.Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                          num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                          max_position_embeddings=32)
        with torch.random.fork_rng(devices=[]):  # the rank's own RNG is left as it was
            torch.manual_seed(0)
            return _Logits(transformers.AutoModelForCausalLM.from_config(config)), (torch.randint(0, 128, (2, 16)),)
    from zoo.hf import llama_from_config  # grouped-query attention: 4 query heads, 2 key-value heads
    return llama_from_config(num_hidden_layers=layers, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                             vocab_size=128, seq_len=16)


def _sharded_stage(model: nn.Module, args: tuple, world_size: int) -> tuple[nn.Module, dict]:
    """The model's one traced stage, sharded over a tensor-parallel mesh of the whole world."""
    plan = find_tensor_parallel(trace(model, args).exported)
    stage = split_model(model, {}, (args, {}), training=True, expected=1).get_stage_module(0)
    return stage, parallelize_stage(stage, init_device_mesh("cpu", (world_size,)), plan)


def stage_run(rank: int, world_size: int, name: str, autocast: bool = False) -> dict:
    """Loss and every gradient of the sharded stage against the unsplit model's. With
    ``autocast`` both run under bf16 autocast, and each is also compared with the unsplit
    model in fp32: how far bf16 alone moves the gradients is the yardstick."""
    model, args = _model(name)
    reference, exact = copy.deepcopy(model), copy.deepcopy(model)
    stage, sharded = _sharded_stage(model, args, world_size)
    precision = torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast)
    with tensor_parallel_context(torch.device("cpu")), precision:
        out = stage(*args)
        out = out[0] if isinstance(out, tuple) else out
        loss = _loss(out)
    with tensor_parallel_context(torch.device("cpu")):
        loss.backward()
    with precision:
        expected_loss = _loss(reference(*args))
    expected_loss.backward()
    _loss(exact(*args)).backward()
    local_shapes = {pname: (tuple(p.to_local().shape), tuple(p.shape))
                    for pname, p in stage.named_parameters() if isinstance(p, DTensor)}
    return {"loss": loss.item(), "expected_loss": expected_loss.item(), "sharded": sharded,
            "worst_grad": _worst(stage, reference), "local_shapes": local_shapes, "out_type": type(out).__name__,
            "sharded_from_fp32": _worst(stage, exact, relative=True),
            "unsplit_from_fp32": _worst(reference, exact, relative=True)}


def _loss(out) -> torch.Tensor:
    return (out[0] if isinstance(out, tuple) else out).float().pow(2).mean()


def _worst(model: nn.Module, reference: nn.Module, *, relative: bool = False) -> float:
    """The largest gradient difference, absolute or relative to the model's largest gradient element."""
    grads = dict(reference.named_parameters())
    scale = max(p.grad.abs().max().item() for p in reference.parameters()) if relative else 1.0
    worst = 0.0
    for pname, p in model.named_parameters():
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        worst = max(worst, (grad - grads[pname].grad).abs().max().item() / scale)
    return worst


def pipeline_run(rank: int, world_size: int, name: str, schedule: str) -> dict:
    """Loss and every gradient of a pp 2 x tp 2 pipeline (torch's schedule over sharded stages)
    against the unsplit model's, on two micro-batches."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, SplitPoint

    from autopipe.runtime.placement import layout_mesh

    model, args = _model(name)
    reference = copy.deepcopy(model)
    mesh = layout_mesh({"pp": 2, "tp": 2})
    pp_rank = mesh.get_local_rank("pp")
    plan = find_tensor_parallel(trace(model, args).exported)
    split_at = next(n for n, _ in model.named_modules() if n.endswith("layers.1"))
    micro = tuple(a[: a.shape[0] // 2] for a in args)
    pipe = split_model(model, {split_at: SplitPoint.BEGINNING}, (micro, {}), training=True, expected=2)
    module = pipe.get_stage_module(pp_rank)
    parallelize_stage(module, mesh["tp"], plan)
    stage = PipelineStage(module, pp_rank, 2, torch.device("cpu"), group=mesh["pp"].get_group())

    def loss_fn(out, target):
        return _loss(out)

    runner = {"1F1B": Schedule1F1B, "GPipe": ScheduleGPipe}[schedule](stage, n_microbatches=2, loss_fn=loss_fn)
    losses: list = []
    with tensor_parallel_context(torch.device("cpu")):
        if pp_rank == 0:
            runner.step(*args)
        else:
            runner.step(target=torch.zeros(2), losses=losses)
    expected_losses = []
    for part in range(2):
        chunk = tuple(a[part * micro[0].shape[0]:(part + 1) * micro[0].shape[0]] for a in args)
        out = reference(*chunk)
        expected_losses.append(loss_fn(out, None))
    (sum(expected_losses) / 2).backward()
    grads = dict(reference.named_parameters())
    worst = 0.0
    for pname, p in module.named_parameters():
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        worst = max(worst, (grad - grads[pname].grad).abs().max().item())
    return {"losses": [float(x) for x in losses], "expected_losses": [float(x) for x in expected_losses],
            "worst_grad": worst, "pp_rank": pp_rank, "tp_rank": mesh.get_local_rank("tp")}


def save_run(rank: int, world_size: int, name: str, checkpoint_dir: str) -> None:
    """One SGD step of the stage sharded over the world, then its state saved with DCP."""
    import torch.distributed.checkpoint as dcp

    model, args = _model(name)
    stage, _ = _sharded_stage(model, args, world_size)
    optimizer = torch.optim.SGD(stage.parameters(), lr=0.1)
    with tensor_parallel_context(torch.device("cpu")):
        _loss(stage(*args)).backward()
        optimizer.step()
    dcp.save(stage.state_dict(), checkpoint_id=checkpoint_dir)


def _split_points(model: nn.Module, stages: int) -> list[str]:
    """Cut before blocks 1 .. stages - 1 of the model's block list (its longest ``nn.ModuleList``)."""
    name, blocks = max(((n, m) for n, m in model.named_modules() if isinstance(m, nn.ModuleList)),
                       key=lambda item: len(item[1]))
    return [f"{name}.{i}" for i in range(1, stages)]


def pipe_run(rank: int, world_size: int, name: str, schedule: str, dp: int = 1, dp_mode: str = "fsdp",
             autocast: bool = False) -> dict:
    """One step of ``autopipe.Pipeline(tensor_parallel=2)`` on pp x dp x tp ranks against the unsplit
    model on the same batch: every micro-batch's loss, every gradient (gathered), the clipped norm."""
    import autopipe
    from autopipe import DataParallelOptions
    from autopipe.runtime import Pipeline

    model, args = _model(name, layers=4)
    reference = copy.deepcopy(model)
    stages_per_rank = 1 if schedule in ("GPipe", "1F1B") else 2
    pp = world_size // (2 * dp)
    n_micro = 2 * pp
    g = torch.Generator().manual_seed(7)
    batch = (torch.randint(0, 128, (n_micro * dp * args[0].shape[0], args[0].shape[1]), generator=g),)
    target = torch.zeros(batch[0].shape[0])
    with Pipeline(model, example_args=tuple(a for a in args), loss_fn=lambda out, y: _loss(out),
                  split_points=_split_points(model, pp * stages_per_rank), schedule=schedule,
                  n_microbatches=n_micro, tensor_parallel=2,
                  data_parallel=DataParallelOptions(degree=dp, mode=dp_mode, batch="global") if dp > 1 else None,
                  planner=autopipe.PlannerOptions(mixed_precision="bf16") if autocast else None) as pipe:
        loss = pipe.step(*batch, target=target)
        norm = pipe.clip_grad_norm_(1e9)
        grads = {n: data_full(p.grad) for n, p in pipe.named_parameters() if p.grad is not None}
        without_grad = [n for n, p in pipe.named_parameters() if p.grad is None]
        sharded = sorted(n for n, p in pipe.named_parameters() if isinstance(p, DTensor))
        nodes = pipe.rank_nodes
    micro = batch[0].shape[0] // (n_micro * dp)
    expected = sum(_loss(reference(batch[0][i * micro:(i + 1) * micro])) for i in range(n_micro * dp)) / (n_micro * dp)
    expected.backward()
    ref = dict(reference.named_parameters())
    worst = max((g - ref[n].grad).abs().max().item() for n, g in grads.items())
    ref_norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in reference.parameters()])).item()
    return {"loss": loss.item(), "expected_loss": expected.item(), "worst_grad": worst, "grads": sorted(grads),
            "without_grad": without_grad, "sharded": sharded, "model_params": sorted(ref),
            "norm": float(norm), "expected_norm": ref_norm, "nodes": nodes}


def data_full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t
