"""Original names for the tensors of pipeline stages, and which stages share a parameter.

Example:
        >>> import torch.nn as nn
        >>> model = nn.Sequential(nn.Embedding(5, 3), nn.Linear(3, 5))
        >>> model[1].weight = model[0].weight  # tied
        >>> names = model_state_names(model)
        >>> names.canonical["1.weight"]
        '0.weight'
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.fx as fx
import torch.nn as nn

@dataclass(frozen=True)
class StateNames:
    """How the original (unsplit) model names its parameters and buffers."""

    state_dict_keys: list[str]
    canonical: dict[str, str]
    aliases: dict[str, list[str]]
    parameter_names: frozenset[str]
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)

    @property
    def saved(self) -> list[str]:
        """The canonical names a state dict holds, in its order: every tensor but non-persistent buffers.

        Example:
            >>> model_state_names(nn.Linear(2, 2)).saved
            ['weight', 'bias']
        """
        return list(dict.fromkeys(self.canonical.get(k, k) for k in self.state_dict_keys))

    def of_stage_name(self, local_name: str) -> str | None:
        """The canonical name of a stage module's tensor, None for a constant made by tracing.

        Example:
            >>> names = StateNames([], {"shared.lin.weight": "shared.lin.weight"}, {}, frozenset())
            >>> names.of_stage_name("shared@1.lin@1.weight")
            'shared.lin.weight'
        """
        canon = self.canonical.get(local_name)
        if canon is None and "@" in local_name:
            canon = self.canonical.get(_CALL_INDEX.sub("", local_name))
        return canon


#: The suffix torch.export gives the second and later calls of one module (``shared@1``).
_CALL_INDEX = re.compile(r"@\d+(?=\.|$)")


def model_state_names(model: nn.Module) -> StateNames:
    """Read the names of every parameter and buffer of ``model``, grouping aliases.

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
    saved = model.state_dict()
    return StateNames(
        state_dict_keys=list(saved),
        shapes={k: tuple(v.shape) for k, v in saved.items()},
        canonical=canonical,
        aliases=dict(aliases),
        parameter_names=frozenset(parameter_names),
    )


def used_attribute_names(stage_module: nn.Module) -> set[str]:
    """Names of the tensors a stage module's code reads (``get_attr`` nodes), by full path.

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
                elif node.op == "call_module":  # an eager module in the graph (a tensor-parallel linear) uses all it holds
                    called = module.get_submodule(str(node.target))
                    if not isinstance(getattr(called, "graph", None), fx.Graph):
                        prefix = f"{scope}.{node.target}" if scope else str(node.target)
                        used.update(f"{prefix}.{n}" for n, _ in (*called.named_parameters(remove_duplicate=False),
                                                                 *called.named_buffers(remove_duplicate=False)))
        for child_name, child in module.named_children():
            stack.append((f"{scope}.{child_name}" if scope else child_name, child))
    return used


def stage_state(stage_module: nn.Module, names: StateNames) -> dict[str, tuple[str, torch.Tensor]]:
    """The parameters and buffers a stage uses, keyed by their canonical original name.

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
            canon = names.of_stage_name(local_name)
            if canon is not None and local_name in used:
                state.setdefault(canon, (local_name, tensor))
    return state


def stage_aliases(stage_module: nn.Module, names: StateNames) -> dict[str, list[str]]:
    """Every name under which a stage module holds a copy of each original tensor.

    Example:
        >>> aliases = stage_aliases(pipe.get_stage_module(1), names)  # doctest: +SKIP
        >>> aliases["shared.weight"]  # doctest: +SKIP
        ['decoder.embed_tokens.weight', 'lm_head.weight']
    """
    found: dict[str, list[str]] = defaultdict(list)
    for named in (stage_module.named_parameters(remove_duplicate=False),
                  stage_module.named_buffers(remove_duplicate=False)):
        for local_name, _ in named:
            canon = names.of_stage_name(local_name)
            if canon is not None:
                found[canon].append(local_name)
    return dict(found)


def shared_parameters(
    stage_params: Sequence[Iterable[str]], stage_ranks: Sequence[int]
) -> list[tuple[tuple[int, ...], list[str]]]:
    """Parameters held by stages on more than one rank, grouped by the set of ranks.

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


def first_use_ranks(stage_params: Sequence[Iterable[str]], stage_ranks: Sequence[int]) -> dict[str, int]:
    """For each parameter, the rank running the lowest-numbered stage that uses it.

    Example:
        >>> first_use_ranks([["h0"], ["wte", "h1"], ["wte"]], [0, 1, 0])
        {'h0': 0, 'wte': 1, 'h1': 1}
    """
    first: dict[str, int] = {}
    for stage, params in enumerate(stage_params):
        for name in params:
            first.setdefault(name, stage_ranks[stage])
    return first


#: ``(name, "parameter" or "buffer", shape, dtype, canonical name)``: one entry of a model signature.
SignatureEntry = tuple[str, str, tuple[int, ...], str, str]


def model_signature(model: nn.Module) -> list[SignatureEntry]:
    """What two ranks' models must agree on to be split the same way: every tensor name,
    kind, shape and dtype, and which names are tied to which.

    Example:
        >>> model_signature(nn.Linear(2, 3))[0]
        ('weight', 'parameter', (3, 2), 'torch.float32', 'weight')
    """
    names = model_state_names(model)
    signature: list[SignatureEntry] = []
    for kind, named in (("parameter", model.named_parameters(remove_duplicate=False)),
                        ("buffer", model.named_buffers(remove_duplicate=False))):
        for name, tensor in named:
            signature.append((name, kind, tuple(tensor.shape), str(tensor.dtype), names.canonical[name]))
    return signature


def first_model_difference(signatures: Sequence[Sequence[SignatureEntry]]) -> str | None:
    """Where the ranks' models first differ, in words; None when they agree.

    Example:
        >>> a, b = model_signature(nn.Linear(2, 3)), model_signature(nn.Linear(2, 4))
        >>> first_model_difference([a, b])
        "'weight': rank 0 has a parameter of shape (3, 2), dtype torch.float32; rank 1 has a parameter of shape (4, 2), dtype torch.float32"
    """
    def describe(entry: SignatureEntry | None) -> str:
        if entry is None:
            return "no such tensor"
        name, kind, shape, dtype, canon = entry
        tied = "" if canon == name else f", tied to {canon!r}"
        return f"a {kind} of shape {shape}, dtype {dtype}{tied}"

    reference = signatures[0]
    for rank, signature in enumerate(signatures[1:], start=1):
        for i in range(max(len(reference), len(signature))):
            ours = reference[i] if i < len(reference) else None
            theirs = signature[i] if i < len(signature) else None
            if ours == theirs:
                continue
            if ours is not None and theirs is not None and ours[0] != theirs[0]:
                return (f"tensor {i} is {ours[0]!r} on rank 0 but {theirs[0]!r} on rank {rank} "
                        f"(the models have different parameter or buffer names)")
            name = (ours or theirs)[0]
            return f"{name!r}: rank 0 has {describe(ours)}; rank {rank} has {describe(theirs)}"
    return None


def tie_aliases(module: nn.Module, names: StateNames, state: Mapping[str, torch.Tensor], *,
                leaf_per_use: bool = False) -> list[tuple[str, nn.Parameter]]:
    """Point every name in ``module`` of a tensor in ``state`` (canonical name -> tensor) at it.

    Example:
        >>> class Scale(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.a, self.b = nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(2))
        ...     def forward(self, x):
        ...         return x * self.a * self.b
        >>> tied = Scale(); tied.b = tied.a  # the original model: a and b are one parameter
        >>> names = model_state_names(tied)
        >>> stage = fx.symbolic_trace(Scale())  # a stage reading two copies of it
        >>> tie_aliases(stage, names, {"a": stage.a}), stage.b is stage.a
        ([], True)
        >>> stage = fx.symbolic_trace(Scale())
        >>> [c for c, _ in tie_aliases(stage, names, {"a": stage.a}, leaf_per_use=True)]
        ['a']
        >>> stage.b is stage.a, stage.b.data_ptr() == stage.a.data_ptr()
        (False, True)
    """
    leaves: list[tuple[str, nn.Parameter]] = []
    used = used_attribute_names(module)
    for canon, local_names in stage_aliases(module, names).items():
        target = state.get(canon)
        if target is None:
            continue
        reads = 0
        for local_name in local_names:
            reads += local_name in used
            if local_name in used and reads > 1 and leaf_per_use and isinstance(target, nn.Parameter):
                leaf = nn.Parameter(target.detach(), requires_grad=target.requires_grad)  # shares the memory
                set_tensor(module, local_name, leaf)
                leaves.append((canon, leaf))
            else:
                set_tensor(module, local_name, target)
    return leaves


def fold_use_leaf_grads(leaves: Sequence[tuple[str, nn.Parameter]], state: Mapping[str, torch.Tensor]) -> None:
    """Add each per-use Parameter's gradient to its parameter's (``state[canonical name]``) and clear it.

    Example:
        >>> p = nn.Parameter(torch.zeros(2)); leaf = nn.Parameter(p.detach())
        >>> p.grad, leaf.grad = torch.ones(2), torch.full((2,), 2.0)
        >>> fold_use_leaf_grads([("w", leaf)], {"w": p})
        >>> p.grad, leaf.grad
        (tensor([3., 3.]), None)
    """
    for canon, leaf in leaves:
        if leaf.grad is None:
            continue
        target = state[canon]
        target.grad = leaf.grad if target.grad is None else target.grad + leaf.grad
        leaf.grad = None


def set_tensor(module: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Make ``module``'s parameter or buffer ``name`` be ``tensor`` (the same object).

    Example:
        >>> lin = nn.Linear(2, 2); w = nn.Parameter(torch.zeros(2, 2))
        >>> set_tensor(lin, "weight", w); lin.weight is w
        True
    """
    prefix, _, leaf = name.rpartition(".")
    parent = module.get_submodule(prefix) if prefix else module
    if leaf in parent._parameters:
        parent._parameters[leaf] = tensor
    else:
        parent._buffers[leaf] = tensor
