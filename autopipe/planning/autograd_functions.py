"""Keep a model's own ``torch.autograd.Function`` backward through ``torch.export``.

Example:
    >>> class Reverse(torch.autograd.Function):
    ...     @staticmethod
    ...     def forward(ctx, x):
    ...         return x.clone()
    ...     @staticmethod
    ...     def backward(ctx, grad):
    ...         return -grad
    >>> class Model(torch.nn.Module):
    ...     def forward(self, x):
    ...         return Reverse.apply(x) * 2
    >>> with functions_kept():
    ...     program = torch.export.export(Model(), (torch.ones(2),))
    >>> [name.rsplit(".", 1)[-1] for name in kept_function_classes(program.graph)]
    ['Reverse']
    >>> x = torch.ones(2, requires_grad=True)
    >>> program.module()(x).sum().backward()
    >>> x.grad
    tensor([-2., -2.])
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

from ..errors import ModelExportError

#: The graph node that stands for one application of a user's Function.
OP_NAME = "autopipe::autograd_function"

_LIBRARY = torch.library.Library("autopipe", "FRAGMENT")
_LIBRARY.define("autograd_function(Tensor[] tensors, str key) -> Tensor[]")


class _TensorSlot:
    """Marks where a tensor argument goes back among a call's non-tensor arguments."""

    def __repr__(self) -> str:
        return "<tensor>"


_TENSOR = _TensorSlot()


@dataclass(frozen=True)
class _CallSite:
    """What one node calls: the Function, how its arguments nest, its non-tensor arguments."""

    function: type
    in_spec: Any
    leaves: tuple[Any, ...]  # the non-tensor arguments, _TENSOR where a tensor goes


_CALL_SITES: dict[str, _CallSite] = {}
_OUT_SPECS: dict[str, Any] = {}  # how each key's outputs nest, learnt when it first runs
_STATE = threading.local()  # .capturing: functions_kept depth in this thread; .running: inside a node's kernel
_ORIGINAL_APPLY = torch.autograd.Function.__dict__["apply"]
# Function.apply is patched while any thread captures; each thread decides for itself whether it does.
_PATCH_LOCK = threading.Lock()
_PATCH_USERS = 0


def _original_apply(function: type, *args: Any) -> Any:
    return _ORIGINAL_APPLY.__func__(function, *args)


def _run_node(tensors: list[torch.Tensor], key: str) -> list[torch.Tensor]:
    """The node's kernel: the Function's own ``apply`` on the call's arguments, outputs flattened."""
    site = _CALL_SITES[key]
    given = iter(tensors)
    args = pytree.tree_unflatten([next(given) if leaf is _TENSOR else leaf for leaf in site.leaves], site.in_spec)
    _STATE.running = getattr(_STATE, "running", 0) + 1
    try:
        out = _original_apply(site.function, *args)
    finally:
        _STATE.running -= 1
    flat, spec = pytree.tree_flatten(out)
    if not all(isinstance(x, torch.Tensor) for x in flat):
        kinds = sorted({type(x).__name__ for x in flat if not isinstance(x, torch.Tensor)})
        raise ModelExportError(
            f"{_name(site.function)}.forward returns {', '.join(kinds)} beside its tensors; autopipe keeps a "
            f"custom autograd Function's own backward through torch.export only for Functions that return "
            f"tensors (or tuples of tensors). Return only tensors from it: keep other values on ctx, or compute "
            f"them outside the Function.", kind="autograd-function")
    inputs = {id(t) for t in tensors}
    if any(id(x) in inputs for x in flat):
        raise ModelExportError(
            f"{_name(site.function)}.forward returns its own input (it writes it in place, ctx.mark_dirty): "
            f"autopipe keeps a custom Function's backward only where its outputs are new tensors. Return a "
            f"new tensor (x.clone() then the in-place op, or the out-of-place op).", kind="autograd-function")
    _OUT_SPECS[key] = spec
    return list(flat)


# The node runs the Function under autograd (its real backward attaches) and below it alike.
_LIBRARY.impl("autograd_function", _run_node, "Autograd")
_LIBRARY.impl("autograd_function", _run_node, "CompositeExplicitAutograd")
torch.library.register_fake(OP_NAME, _run_node, lib=_LIBRARY)


def _name(function: type) -> str:
    return f"{function.__module__}.{function.__qualname__}"


def _kept(function: type) -> bool:
    """Whether an application of ``function`` becomes a node: Functions of torch and of autopipe's runtime stay inlined."""
    module = function.__module__ or ""
    return not (module == "torch" or module.startswith(("torch.", "autopipe.runtime.")))


def _key(site: _CallSite) -> str:
    """The table key of ``site``: the same call site gets the same key every time it is traced."""
    for key, known in _CALL_SITES.items():
        if known.function is site.function and known.in_spec == site.in_spec and _same(known.leaves, site.leaves):
            return key
    key = f"{_name(site.function)}#{sum(1 for s in _CALL_SITES.values() if s.function is site.function)}"
    _CALL_SITES[key] = site
    return key


def _same(a: tuple, b: tuple) -> bool:
    try:
        return len(a) == len(b) and all(x is y or (type(x) is type(y) and bool(x == y)) for x, y in zip(a, b))
    except Exception:  # noqa: BLE001 - values that cannot be compared are different call sites
        return False


def _apply_as_node(function: type, *args: Any) -> Any:
    """``Function.apply`` while :func:`functions_kept` is on: one node for a user's Function."""
    if not getattr(_STATE, "capturing", 0) or getattr(_STATE, "running", 0) or not _kept(function):
        return _original_apply(function, *args)
    leaves, in_spec = pytree.tree_flatten(args)
    site = _CallSite(function, in_spec, tuple(_TENSOR if isinstance(x, torch.Tensor) else x for x in leaves))
    key = _key(site)
    outs = torch.ops.autopipe.autograd_function([x for x in leaves if isinstance(x, torch.Tensor)], key)
    return pytree.tree_unflatten(list(outs), _OUT_SPECS[key])


@contextlib.contextmanager
def functions_kept() -> Iterator[None]:
    """Within it, a traced custom ``autograd.Function`` becomes one node that runs the Function itself.

    Wrap every ``torch.export`` of a model that training will run (autopipe's trace and torch's
    ``pipeline()`` alike). Functions of torch and of autopipe's runtime are left as they are;
    :func:`kept_function_classes` names those a graph keeps.

    Example:
        >>> with functions_kept():
        ...     program = torch.export.export(torch.nn.Linear(2, 2), (torch.ones(1, 2),))
        >>> kept_function_classes(program.graph)
        []
    """
    global _PATCH_USERS
    with _PATCH_LOCK:
        _PATCH_USERS += 1
        torch.autograd.Function.apply = classmethod(_apply_as_node)
    _STATE.capturing = getattr(_STATE, "capturing", 0) + 1
    try:
        yield
    finally:
        _STATE.capturing -= 1
        with _PATCH_LOCK:
            _PATCH_USERS -= 1
            if not _PATCH_USERS:
                torch.autograd.Function.apply = _ORIGINAL_APPLY


def kept_function_classes(graph: torch.fx.Graph) -> list[str]:
    """The Functions whose own backward ``graph`` keeps as nodes, by qualified name, in graph order.

    Example:
        >>> kept_function_classes(torch.export.export(torch.nn.Linear(2, 2), (torch.ones(1, 2),)).graph)
        []
    """
    names: dict[str, None] = {}
    for node in graph.nodes:
        if node.op == "call_function" and node.target is torch.ops.autopipe.autograd_function.default:
            site = _CALL_SITES.get(node.args[1])
            if site is not None:
                names.setdefault(_name(site.function), None)
    return list(names)
