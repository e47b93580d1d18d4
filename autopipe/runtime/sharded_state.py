"""Checkpoints that reshard: the model and optimizer state of a pipeline, by original name."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from .._checks import listed
from .checkpoint_files import checkpoint_to_read, load_into, save_replacing
from .data_parallel import placed_like, stored_form
from .distributed import raise_on_every_rank
from .materialize import check_state_fits
from .model_state import load_local_state
from .params import StateNames


_STATE = "state"
_GROUPS = "param_groups"



@dataclass(frozen=True)
class RankState:
    """This rank's tensors under the model's names: what its state dicts and checkpoints read and write."""

    names: StateNames
    held: dict[str, torch.Tensor]  # by canonical name: the tensors this rank's stages hold
    unheld: dict[str, torch.Tensor]  # this rank's tensors no stage reads (kept for a full state dict)
    rank: int
    world_size: int

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return [(n, t) for n, t in self.held.items() if n in self.names.parameter_names]


def model_state_dict(local: RankState) -> dict[str, torch.Tensor]:
    """This rank's part of the model's checkpoint: what ``dcp.save`` writes and ``dcp.load`` fills."""
    names: StateNames = local.names
    out: dict[str, torch.Tensor] = {}
    for key in names.state_dict_keys:
        canon = names.canonical.get(key, key)
        tensor = local.held.get(canon)
        if tensor is None:
            tensor = local.unheld.get(canon)
        if tensor is not None:
            out[key] = stored_form(tensor.detach())
    return out


@torch.no_grad()
def load_model_state_dict(local: RankState, state_dict: Mapping[str, torch.Tensor], *, strict: bool = True) -> None:
    """Copy a model checkpoint into this rank's tensors (and the ones no stage reads)."""
    names: StateNames = local.names
    targets = {**local.unheld, **{n: t for n, t in local.held.items() if n in names.canonical}}
    load_local_state(targets, names, state_dict, strict=strict, where=f" (rank {local.rank})")


def optimizer_state_dict(local: RankState, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """This rank's optimizer state, flattened by parameter name as torch's ``get_optimizer_state_dict``."""
    groups = _group_names(local, optimizer)
    _initialize_state(optimizer)
    flat: dict[str, Any] = {}
    for group, fqns in zip(optimizer.param_groups, groups):
        for param, fqn in zip(group["params"], fqns):
            for name, value in optimizer.state.get(param, {}).items():
                _flatten(f"{_STATE}.{fqn}.{name}", stored_form(value), flat)
    for group, fqns in zip(optimizer.param_groups, groups):
        for fqn in fqns:
            for key, value in group.items():
                if key != "params":
                    flat[f"{_GROUPS}.{fqn}.{key}"] = value
    return flat


def load_optimizer_state_dict(local: RankState, optimizer: torch.optim.Optimizer, state: Mapping[str, Any]) -> None:
    """Load flattened optimizer state (by parameter name) into ``optimizer``."""
    if not isinstance(state, Mapping):
        raise TypeError(f"state must be a mapping of flattened optimizer keys to values, got {type(state).__name__}")
    groups = _group_names(local, optimizer)
    names: StateNames = local.names
    unknown = [k for k in state if _key_parameter(k, names) is None]
    template = optimizer_state_dict(local, optimizer)  # gives a fresh optimizer its state
    missing = [k for k in template if k not in state]
    if unknown or missing:
        raise KeyError(f"the optimizer state does not fit this pipeline (rank {local.rank}): missing keys "
                       f"{listed(missing)}, keys naming no parameter of the model {listed(unknown)}")
    loaded_state: dict[int, dict[str, Any]] = {}
    loaded_groups: list[dict[str, Any]] = []
    index = 0
    for group, fqns in zip(optimizer.param_groups, groups):
        hyper: dict[str, Any] = {}
        for key in group:
            if key == "params":
                continue
            values = [(fqn, state[f"{_GROUPS}.{fqn}.{key}"]) for fqn in fqns]
            for fqn, value in values[1:]:
                if not _same(value, values[0][1]):
                    raise ValueError(f"parameters {values[0][0]!r} and {fqn!r} share a parameter group but were "
                                     f"saved with {key}={values[0][1]!r} and {key}={value!r}")
            hyper[key] = values[0][1] if values else group[key]
        loaded_groups.append({**hyper, "params": list(range(index, index + len(fqns)))})
        for param, fqn in zip(group["params"], fqns):
            entries = optimizer.state.get(param, {})
            if entries:
                loaded_state[index] = {name: placed_like(_unflatten(f"{_STATE}.{fqn}.{name}", value, state), value)
                                       for name, value in entries.items()}
            index += 1
    optimizer.load_state_dict({"state": loaded_state, "param_groups": loaded_groups})


# ---------------------------------------------------------------------------- helpers
def _group_names(local: RankState, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    """The canonical name of every parameter of every group of ``optimizer``."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    by_id = {id(p): n for n, p in local.named_parameters()}
    groups: list[list[str]] = []
    foreign = []
    for g, group in enumerate(optimizer.param_groups):
        fqns = []
        for i, param in enumerate(group["params"]):
            name = by_id.get(id(param))
            if name is None:
                foreign.append(f"param_groups[{g}]['params'][{i}] (shape {tuple(param.shape)})")
            fqns.append(name)
        groups.append(fqns)
    if foreign:
        raise ValueError(f"the optimizer holds parameters that are not this pipeline's (rank {local.rank}): "
                         f"{listed(foreign)}; build it over pipe.parameters()")
    return groups


@torch.no_grad()
def _initialize_state(optimizer: torch.optim.Optimizer) -> None:
    """Give a fresh optimizer its state: one step with zero gradients at learning rate 0."""
    if optimizer.state:
        return
    params = [p for group in optimizer.param_groups for p in group["params"]]
    grads = [p.grad for p in params]
    lrs = [group.get("lr") for group in optimizer.param_groups]
    try:
        for p in params:
            p.grad = torch.zeros_like(p) if p.requires_grad else None
        for group in optimizer.param_groups:
            if "lr" in group:
                group["lr"] = torch.tensor(0.0) if isinstance(group["lr"], torch.Tensor) else 0.0
        optimizer.step()
    finally:
        for group, lr in zip(optimizer.param_groups, lrs):
            if lr is not None:
                group["lr"] = lr
        for p, grad in zip(params, grads):
            p.grad = grad


def _flatten(prefix: str, value: Any, out: dict[str, Any]) -> None:
    if isinstance(value, Mapping):
        for key, inner in value.items():
            _flatten(f"{prefix}.{key}", inner, out)
    else:
        out[prefix] = value


def _unflatten(prefix: str, template: Any, flat: Mapping[str, Any]) -> Any:
    if isinstance(template, Mapping):
        return {key: _unflatten(f"{prefix}.{key}", inner, flat) for key, inner in template.items()}
    return flat[prefix]


def _key_parameter(key: str, names: StateNames) -> str | None:
    """The parameter a flattened optimizer key is about (``state.<fqn>.…``), or None."""
    section, _, rest = key.partition(".")
    if section not in (_STATE, _GROUPS):
        return None
    cut = rest.rfind(".")
    while cut > 0:  # the longest name that is a parameter: an fqn itself has dots
        head = rest[:cut]
        if head in names.canonical and names.canonical[head] in names.parameter_names:
            return names.canonical[head]
        cut = rest.rfind(".", 0, cut)
    return None


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    return bool(a == b)


def save_checkpoint(local: RankState, checkpoint_id: str | os.PathLike,
                    optimizer: torch.optim.Optimizer | None = None) -> None:
    """``dcp.save`` of ``{"model": model_state_dict(local), "optim": optimizer_state_dict(local, optimizer)}``,
    written beside the target and swapped in once every rank wrote (:func:`~autopipe.runtime.checkpoint_files.save_replacing`)."""
    save_replacing(lambda: _checkpoint_state(local, optimizer), checkpoint_id, rank=local.rank,
                   world_size=local.world_size)


def read_checkpoint(local: RankState, checkpoint_id: str | os.PathLike,
                    optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any]:
    """A checkpoint of :func:`save_checkpoint`, checked whole and against the whole model on every rank, read for this rank."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    error: Exception | None = None
    try:
        path, metadata = checkpoint_to_read(checkpoint_id)
        stored = metadata.state_dict_metadata
        model = {k[len("model."):]: tuple(m.size) for k, m in stored.items()
                 if k.startswith("model.") and isinstance(m, TensorStorageMetadata)}
        check_state_fits(model, local.names, f"checkpoint {os.fspath(checkpoint_id)!r}")
    except Exception as e:  # noqa: BLE001 - raised below, on every rank
        error = e
    raise_on_every_rank(error, rank=local.rank, world_size=local.world_size, what="use the checkpoint")
    state = _checkpoint_state(local, optimizer)
    load_into(state, path)
    return state


def _checkpoint_state(local: RankState, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    state: dict[str, Any] = {"model": model_state_dict(local)}
    if optimizer is not None:
        state["optim"] = optimizer_state_dict(local, optimizer)
    return state
