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


def _model(name: str) -> tuple[nn.Module, tuple]:
    if name == "seed_transformer":
        return seed_transformer(num_layers=2, dropout=0.0)
    from zoo.hf import llama_from_config  # grouped-query attention: 4 query heads, 2 key-value heads
    return llama_from_config(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                             vocab_size=128, seq_len=16)


def stage_run(rank: int, world_size: int, name: str) -> dict:
    """Loss and every gradient of the sharded stage against the unsplit model's."""
    model, args = _model(name)
    reference = copy.deepcopy(model)
    plan = find_tensor_parallel(trace(model, args).exported)
    stage = split_model(model, {}, (args, {}), training=True, expected=1).get_stage_module(0)
    sharded = parallelize_stage(stage, init_device_mesh("cpu", (world_size,)), plan)
    with tensor_parallel_context(torch.device("cpu")):
        out = stage(*args)
        out = out[0] if isinstance(out, tuple) else out
        loss = out.float().pow(2).mean()
        loss.backward()
    expected = reference(*args)
    expected = expected[0] if isinstance(expected, tuple) else expected
    expected_loss = expected.float().pow(2).mean()
    expected_loss.backward()
    grads = dict(reference.named_parameters())
    worst, local_shapes = 0.0, {}
    for pname, p in stage.named_parameters():
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        worst = max(worst, (grad - grads[pname].grad).abs().max().item())
        if isinstance(p, DTensor):
            local_shapes[pname] = (tuple(p.to_local().shape), tuple(p.shape))
    return {"loss": loss.item(), "expected_loss": expected_loss.item(), "worst_grad": worst,
            "sharded": sharded, "local_shapes": local_shapes, "out_type": type(out).__name__}
