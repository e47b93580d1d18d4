"""Original names for the tensors of pipeline stages, and which stages share a parameter.

``torch.distributed.pipelining.pipeline`` keeps each parameter's original name inside
its stage module (``layers.0.attention.q_linear.weight``), but three things need care:

- a tied parameter (GPT-2's ``wte.weight`` is also ``lm_head.weight``) is *replicated*
  into every stage that uses it, under whichever of its names that stage's code used;
- a stage module may carry tensors its code never reads (left over from the split);
- the model's ``state_dict`` lists every alias of a tied tensor and only persistent
  buffers.

This module answers, from the original model and the stage modules alone:
"what is the canonical name of this stage tensor", "which stage tensors does a stage
really use" and "which ranks hold a copy of the same parameter".

    >>> import torch.nn as nn
    >>> model = nn.Sequential(nn.Embedding(5, 3), nn.Linear(3, 5))
    >>> model[1].weight = model[0].weight  # tied
    >>> names = model_state_names(model)
    >>> names.canonical["1.weight"]
    '0.weight'
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.nn as nn

__all__ = ["StateNames", "model_state_names", "used_attribute_names", "stage_state",
           "shared_parameters"]


@dataclass(frozen=True)
class StateNames:
    """How the original (unsplit) model names its parameters and buffers.

    Attributes:
        state_dict_keys: ``model.state_dict()`` keys in order (tied aliases included,
            non-persistent buffers excluded): what a full checkpoint must contain.
        canonical: every parameter / buffer name, aliases included -> the first name
            ``named_parameters()`` / ``named_buffers()`` gives that tensor.
        aliases: canonical name -> all of its names, canonical first.
        parameter_names: canonical names that are parameters (the rest are buffers).
    """

    state_dict_keys: list[str]
    canonical: dict[str, str]
    aliases: dict[str, list[str]]
    parameter_names: frozenset[str]


def model_state_names(model: nn.Module) -> StateNames:
    """Read the names of every parameter and buffer of ``model``, grouping aliases.

    Args:
        model: the unsplit model.

    Returns:
        A :class:`StateNames`.

    Example:
        >>> names = model_state_names(nn.Linear(2, 2))
        >>> names.state_dict_keys
        ['weight', 'bias']
    """
    first_name: dict[int, str] = {}  # id(tensor) -> canonical name
    canonical: dict[str, str] = {}
    aliases: dict[str, list[str]] = defaultdict(list)
    parameter_names = set()
    for kind, named in (("param", model.named_parameters(remove_duplicate=False)),
                        ("buffer", model.named_buffers(remove_duplicate=False))):
        for name, tensor in named:
            canon = first_name.setdefault(id(tensor), name)
            canonical[name] = canon
            aliases[canon].append(name)
            if kind == "param":
                parameter_names.add(canon)
    return StateNames(
        state_dict_keys=list(model.state_dict().keys()),
        canonical=canonical,
        aliases=dict(aliases),
        parameter_names=frozenset(parameter_names),
    )


def used_attribute_names(stage_module: nn.Module) -> set[str]:
    """Names of the tensors a stage module's code reads (``get_attr`` nodes), by full path.

    A stage module from ``pipeline()`` is a tree of fx graphs (``GraphModule`` at the
    top, ``InterpreterModule`` below); a tensor is used when some graph reads it.

    Args:
        stage_module: ``pipe.get_stage_module(i)``.

    Returns:
        Set of dotted names relative to ``stage_module``.

    Example:
        >>> used = used_attribute_names(pipe.get_stage_module(0))  # doctest: +SKIP
    """
    used: set[str] = set()
    stack: list[tuple[str, nn.Module]] = [("", stage_module)]
    while stack:
        scope, module = stack.pop()
        graph = getattr(module, "graph", None)
        if isinstance(graph, fx.Graph):
            for node in graph.nodes:
                if node.op == "get_attr":
                    used.add(f"{scope}.{node.target}" if scope else str(node.target))
        for child_name, child in module.named_children():
            stack.append((f"{scope}.{child_name}" if scope else child_name, child))
    return used


def stage_state(stage_module: nn.Module, names: StateNames) -> dict[str, tuple[str, torch.Tensor]]:
    """The parameters and buffers a stage uses, keyed by their canonical original name.

    Tensors the stage's code never reads, and tensors the original model did not have
    (constants created by tracing), are left out.

    Args:
        stage_module: ``pipe.get_stage_module(i)``.
        names: :func:`model_state_names` of the original model.

    Returns:
        ``{canonical name: (name inside the stage module, tensor)}``.

    Example:
        >>> state = stage_state(pipe.get_stage_module(1), names)  # doctest: +SKIP
        >>> state["embedding.weight"][0]  # doctest: +SKIP
        'out_linear.weight'
    """
    used = used_attribute_names(stage_module)
    state: dict[str, tuple[str, torch.Tensor]] = {}
    for named in (stage_module.named_parameters(remove_duplicate=False),
                  stage_module.named_buffers(remove_duplicate=False)):
        for local_name, tensor in named:
            canon = names.canonical.get(local_name)
            if canon is not None and local_name in used:
                state.setdefault(canon, (local_name, tensor))
    return state


def shared_parameters(
    stage_params: Sequence[Iterable[str]], stage_ranks: Sequence[int]
) -> list[tuple[tuple[int, ...], list[str]]]:
    """Parameters held by stages on more than one rank, grouped by the set of ranks.

    Their gradients must be summed over those ranks after every backward so that the
    copies, updated by identical optimizers, stay identical.

    Args:
        stage_params: for each stage, the canonical names of the parameters it uses.
        stage_ranks: ``stage_ranks[s]`` is the rank that runs stage ``s``.

    Returns:
        ``[(ranks, names), ...]`` sorted, so that every rank computes the same list (the
        process groups made from it must be created in the same order everywhere).

    Example:
        >>> shared_parameters([["wte", "h0"], ["h1", "wte"]], [0, 1])
        [((0, 1), ['wte'])]
    """
    holders: dict[str, set[int]] = defaultdict(set)
    for stage, params in enumerate(stage_params):
        for name in params:
            holders[name].add(stage_ranks[stage])
    groups: dict[tuple[int, ...], list[str]] = defaultdict(list)
    for name in sorted(holders):
        ranks = tuple(sorted(holders[name]))
        if len(ranks) > 1:
            groups[ranks].append(name)
    return sorted(groups.items())
