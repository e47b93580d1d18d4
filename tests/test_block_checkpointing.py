"""Per-block activation checkpointing (autopipe.runtime.checkpointing.checkpoint_blocks) on a
traced stage: the same loss and gradients, with each mode recomputing what it should."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from autopipe.models import seed_transformer
from autopipe.runtime.checkpointing import block_names, checkpoint_blocks, resolve_recompute
from autopipe.runtime.stages import split_model

BLOCKS = ["layers.0", "layers.1"]
LINEARS_PER_BLOCK = 6  # q, k, v, out, fc1, fc2
MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default}


class _CountMatmuls(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func in MATMULS
        return func(*args, **(kwargs or {}))


@functools.lru_cache(maxsize=None)
def _traced_stage() -> tuple:
    model, args = seed_transformer(num_layers=2, dropout=0.1)  # dropout: recomputation must redraw the same masks
    return split_model(model, {}, (args, {}), training=True, expected=1).get_stage_module(0), args


def _step(mode: str) -> tuple[torch.Tensor, dict[str, torch.Tensor], int, list[str]]:
    base, args = _traced_stage()
    stage = copy.deepcopy(base)
    done = checkpoint_blocks(stage, BLOCKS + ["no.such.block"], mode)
    torch.manual_seed(0)  # the same dropout masks in every mode
    out = stage(*args)
    loss = (out[0] if isinstance(out, tuple) else out).float().pow(2).mean()
    with _CountMatmuls() as counted:
        loss.backward()
    return loss.detach(), {n: p.grad for n, p in stage.named_parameters()}, counted.count, done


@pytest.mark.parametrize("mode, recomputed", [("full", 2 * LINEARS_PER_BLOCK), ("selective", LINEARS_PER_BLOCK)])
def test_each_mode_gives_the_same_numbers_and_recomputes_its_share_of_the_matmuls(mode, recomputed):
    loss, grads, backward_matmuls, done = _step(mode)
    plain_loss, plain_grads, plain_matmuls, nothing = _step("none")
    assert done == BLOCKS and nothing == []
    torch.testing.assert_close(loss, plain_loss, rtol=0, atol=1e-6)
    for name, grad in plain_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=0, atol=1e-6)
    # Full recomputes every matmul of both blocks in the backward, selective every second one.
    assert backward_matmuls - plain_matmuls == recomputed


def test_an_unknown_mode_is_refused_naming_the_modes():
    with pytest.raises(ValueError, match="mode='some'"):
        checkpoint_blocks(torch.nn.Linear(2, 2), [""], "some")


class _Experts(torch.nn.Module):
    """A block holding a list of its own (MoE experts): only the outer list's children are blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(3))


def test_the_blocks_are_the_repeated_modules_of_a_list_outside_any_other_block():
    model, _ = seed_transformer(100, d_model=16, num_heads=2, d_ff=32, num_layers=3, seq_len=4)
    assert block_names(model) == ["layers.0", "layers.1", "layers.2"]
    moe = torch.nn.Module()
    moe.layers = torch.nn.ModuleList(_Experts() for _ in range(2))
    assert block_names(moe) == ["layers.0", "layers.1"]


def test_a_per_block_mode_recomputes_no_whole_stage_and_partition_refuses_it_and_tensor_parallelism():
    import autopipe
    from autopipe.planning.options import DataParallelOptions, PlannerOptions

    assert resolve_recompute("selective", 2) == [] and resolve_recompute("full", 2) == []
    with pytest.raises(ValueError, match="or per block one of \\['selective', 'full'\\]"):
        PlannerOptions(recompute="some")
    model, args = seed_transformer(100, d_model=16, num_heads=2, d_ff=32, num_layers=2, seq_len=4)
    with pytest.raises(ValueError, match="'full' or 'selective' \\(per block\\) checkpoint a Pipeline"):
        autopipe.partition(model, 2, args, planner=PlannerOptions(recompute="full"))
    with pytest.raises(ValueError, match="tensor_parallel=2\\) is for a Pipeline.*autopipe layout"):
        autopipe.partition(model, 2, args, data_parallel=DataParallelOptions(tensor_parallel=2))
    with pytest.raises(ValueError, match="loss_parallel=True\\) is for a Pipeline.*autopipe layout"):
        autopipe.partition(model, 2, args, data_parallel=DataParallelOptions(loss_parallel=True))
    with pytest.raises(ValueError, match="DataParallelOptions tensor_parallel=0"):
        DataParallelOptions(tensor_parallel=0)
    with pytest.raises(TypeError, match="DataParallelOptions loss_parallel must be True or False, got 'yes'"):
        DataParallelOptions(loss_parallel="yes")
