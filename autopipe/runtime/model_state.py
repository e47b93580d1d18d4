"""The whole model's gradients and state, from the parts the ranks hold."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor

from .._checks import listed
from .data_parallel import local_tensor, placed_like
from .params import StateNames, fold_use_leaf_grads

#: ``(canonical names, process group)`` for each set of parameters this rank shares with
#: other ranks; group None is the whole world.
Shared = Sequence[tuple[list[str], Any]]


def grads_before(shared: Shared, state: Mapping[str, torch.Tensor]) -> list[list[torch.Tensor | None]]:
    """Copies of the shared parameters' gradients before a step, for :func:`sum_shared_grads`.

    Example:
        >>> w = nn.Parameter(torch.ones(2)); w.grad = torch.full((2,), 3.0)
        >>> grads_before([(["w"], None)], {"w": w})
        [[tensor([3., 3.])]]
    """
    # A DTensor's (FSDP-sharded) gradient counts by its local shard: the copies on other
    # stages hold the same shard of the same parameter.
    return [[local_tensor(state[n].grad).clone() if state[n].grad is not None else None for n in names]
            for names, _ in shared]


def sum_shared_grads(shared: Shared, state: Mapping[str, torch.Tensor],
                     use_leaves: Sequence[tuple[str, nn.Parameter]], before: list[list[torch.Tensor | None]]) -> None:
    """Sum this step's gradients of every copy of a shared parameter: on this rank, then across ranks."""
    fold_use_leaf_grads(use_leaves, state)
    for (names, group), previous in zip(shared, before):
        params = [state[n] for n in names]
        deltas = []
        for p, prev in zip(params, previous):
            g = local_tensor(p.grad) if p.grad is not None else torch.zeros_like(local_tensor(p))
            deltas.append((g - prev if prev is not None else g).reshape(-1))
        flat = torch.cat(deltas)
        dist.all_reduce(flat, group=group)
        offset = 0
        for p, prev in zip(params, previous):
            local = local_tensor(p)
            chunk = flat[offset: offset + local.numel()].view_as(local)
            offset += local.numel()
            summed = chunk.clone() if prev is None else prev + chunk
            if p.grad is not None and local_tensor(p.grad) is not p.grad:
                local_tensor(p.grad).copy_(summed)  # a sharded gradient keeps its DTensor
            else:
                p.grad = summed


def clip_grad_norm(named_parameters: Sequence[tuple[str, nn.Parameter]], first_use: Mapping[str, int], *,
                   rank: int, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                   device: torch.device, counts: Callable[[torch.Tensor], bool] = lambda p: True) -> torch.Tensor:
    """Scale this rank's gradients so that the norm over every rank's is at most ``max_norm``;
    ``counts(p)``: whether this rank's ``p`` adds to the norm (a copy held elsewhere too counts once)."""
    for arg, value in (("max_norm", max_norm), ("norm_type", norm_type)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"{arg}={value!r} must be a number > 0 (norm_type may be float('inf'))")
    if not math.isfinite(max_norm):
        raise ValueError(f"max_norm={max_norm!r} must be finite")
    norm_type = float(norm_type)
    counted = [local_tensor(p.grad) for name, p in named_parameters
               if p.grad is not None and first_use.get(name, rank) == rank and counts(p)]
    if norm_type == math.inf:
        local = max((g.detach().abs().max().double() for g in counted), default=torch.zeros((), dtype=torch.float64))
        total = local.to(device).reshape(1)
        dist.all_reduce(total, op=dist.ReduceOp.MAX)
        total = total[0]
    else:
        local = sum((torch.linalg.vector_norm(g.detach(), norm_type).double() ** norm_type for g in counted),
                    torch.zeros((), dtype=torch.float64))
        total = local.to(device).reshape(1)
        dist.all_reduce(total)
        total = total[0] ** (1.0 / norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"the global {norm_type}-norm of the gradients is {total.item()}; "
                           f"error_if_nonfinite=True refuses to clip by it")
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for _, p in named_parameters:
        if p.grad is not None:
            local_tensor(p.grad).detach().mul_(coef.to(device=p.grad.device, dtype=p.grad.dtype))
    dtype = counted[0].dtype if counted else torch.float32
    return total.to(dtype)


def full_state_dict(local: Mapping[str, torch.Tensor], unheld: Mapping[str, torch.Tensor], names: StateNames,
                    world_size: int, *, sends: bool = True) -> dict[str, torch.Tensor]:
    """The whole model's state dict on every rank, on the CPU, with every key of the unsplit model's."""
    gathered: list[dict[str, torch.Tensor] | None] = [None] * world_size
    dist.all_gather_object(gathered, {n: t.cpu().clone() for n, t in local.items()} if sends else {})
    merged: dict[str, torch.Tensor] = dict(unheld)
    for part in gathered:
        for n, t in part.items():
            merged.setdefault(n, t)
    return {key: merged[names.canonical.get(key, key)] for key in names.state_dict_keys}


@torch.no_grad()
def load_local_state(state: Mapping[str, torch.Tensor], names: StateNames, state_dict: Mapping[str, torch.Tensor],
                     *, strict: bool, where: str = "") -> None:
    """Copy into ``state`` (this rank's tensors by canonical name) what ``state_dict`` holds for them.

    Example:
        >>> from autopipe.runtime.params import model_state_names
        >>> model = nn.Linear(2, 2); state = dict(model.named_parameters())
        >>> load_local_state(state, model_state_names(model), nn.Linear(2, 2).state_dict(), strict=True)
    """
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"state_dict must be a mapping of the model's names to tensors, got {type(state_dict).__name__}")
    unknown = sorted(k for k in state_dict if k not in names.canonical)
    by_canon: dict[str, torch.Tensor] = {}
    for key, value in state_dict.items():
        if key in names.canonical:
            by_canon.setdefault(names.canonical[key], value)
    saved = set(names.saved)  # non-persistent buffers (Llama's rotary inv_freq) are in no state dict
    missing = sorted(n for n in state if n not in by_canon and n in saved)
    if strict and (unknown or missing):
        raise KeyError(f"the state dict does not fit this pipeline{where}: missing names {listed(missing)}, "
                       f"names the model does not have {listed(unknown)}")
    for name, tensor in state.items():  # every value checked before any is written
        value = by_canon.get(name, tensor)
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"state_dict[{name!r}] must be a tensor, got {type(value).__name__}")
        if tuple(value.shape) != tuple(tensor.shape):  # a DTensor's shape is the full one
            raise ValueError(f"{name!r} has shape {tuple(value.shape)} in the state dict but "
                             f"{tuple(tensor.shape)} in the model")
    for name, tensor in state.items():
        if name in by_canon:
            value = by_canon[name]
            if value is tensor:
                continue
            if isinstance(tensor, DTensor):  # this rank's shard of the full value, no communication
                if not isinstance(value, DTensor):
                    value = distribute_tensor(value.to(tensor.device), tensor.device_mesh, tensor.placements,
                                              src_data_rank=None)
                tensor.to_local().copy_(placed_like(value, tensor).to_local())
            elif value is not tensor and value.data_ptr() != tensor.data_ptr():
                tensor.copy_(value)
