"""The memory a backward needs beyond the activations saved for it: its working set.

Example:
    >>> layer = torch.nn.Linear(8, 8)
    >>> backward_working_bytes(layer, [torch.randn(4, 8, requires_grad=True)]).accumulating > 0
    True
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from .passes import storage_key

def _storage_bytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes() if t.layout == torch.strided else t.numel() * t.element_size()


class LiveStorage(TorchDispatchMode):
    """Bytes of tensor storage allocated inside the block and still alive; ``peak`` is their high-water mark.

    Example:
        >>> with LiveStorage() as live:
        ...     y = torch.ones(256) * 2.0  # two 1 KiB storages: the ones, then the product
        >>> live.peak
        2048
    """

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._seen: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._refs: dict[int, weakref.ref] = {}

    def _gone(self, key: int, nbytes: int) -> None:
        self.live -= nbytes
        self._refs.pop(key, None)

    def watch(self, t: torch.Tensor) -> None:
        """Count ``t``'s storage (made before the block) as given back when Python frees it."""
        st = t.untyped_storage()
        if st in self._seen:
            return
        n = _storage_bytes(t)
        self._seen[st] = n
        key = id(st)
        self._refs[key] = weakref.ref(st, lambda _r, key=key, n=n: self._gone(key, n))
        # Charged now and uncharged when freed, with the start point lowered to match: the
        # block's own peak then moves only by what it frees.
        self.live += n
        self._offset = getattr(self, "_offset", 0) + n

    def _record(self, st: Any, n: int) -> None:
        self._seen[st] = n
        key = id(st)
        self._refs[key] = weakref.ref(st, lambda _r, key=key, n=n: self._gone(key, n))
        self.live += n
        self.peak = max(self.peak, self.live - getattr(self, "_offset", 0))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        out = func(*args, **(kwargs or {}))
        inputs = {storage_key(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.layout != torch.strided:
                continue
            st = t.untyped_storage()
            if st in self._seen or (storage_key(t) in inputs and st.nbytes() > 0):
                continue
            self._record(st, st.nbytes())
        return out


@dataclass(frozen=True)
class WorkingSet:
    """Peak bytes a backward allocates beyond the activations saved for it, in its two cases."""

    accumulating: int
    first: int


def backward_working_bytes(module: torch.nn.Module, inputs: list[Any]) -> WorkingSet:
    """Peak bytes one backward of ``module`` needs beyond the activations its forward saved.

    Example:
        >>> mlp = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16))
        >>> ws = backward_working_bytes(mlp, [torch.randn(8, 16)])
        >>> ws.accumulating >= 64 * 16 * 4, ws.first  # a weight's fresh gradient; the arriving gradient only
        (True, 512)
    """
    params = [p for p in module.parameters() if p.requires_grad]
    return WorkingSet(accumulating=working_bytes(lambda: module.forward(*inputs), inputs, params),
                      first=working_bytes(lambda: module.forward(*inputs), inputs, params, weights=False))


def working_bytes(forward: Callable[[], Any], inputs: Sequence[Any], params: Sequence[torch.Tensor], *,
                  weights: bool = True) -> int:
    """One case of :func:`backward_working_bytes` for any computation: ``forward()`` run on
    ``inputs`` (kept alive by the caller), ``params`` its trainable parameters; ``weights``
    False differentiates with respect to the inputs only.

    Example:
        >>> logits = torch.randn(4, 100, requires_grad=True)
        >>> target = torch.tensor([1, 2, 3, 4])
        >>> working_bytes(lambda: torch.nn.functional.cross_entropy(logits, target), [logits], []) >= 4 * 100 * 4
        True
    """
    params = list(params)
    param_keys = {storage_key(p) for p in params}
    wrt = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        if storage_key(t) not in param_keys:
            saved.append(t)
        return t

    old = [p.grad for p in params]
    old_inputs = [t.grad for t in wrt]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = forward()
        outs = [o for o in tree_leaves(out) if isinstance(o, torch.Tensor) and o.requires_grad]
        if not outs:
            return 0
        for p in params:
            p.grad = torch.zeros_like(p) if weights else None
        keep = {storage_key(o) for o in outs} | {storage_key(t) for t in inputs if isinstance(t, torch.Tensor)}
        live = LiveStorage()
        with live:
            # Only the saved tensors that are not the computation's inputs or outputs (which
            # outlive its backward) count as given back when autograd frees them.
            for t in saved:
                if storage_key(t) not in keep:
                    live.watch(t)
            saved.clear()
            grads = [torch.ones_like(o) for o in outs]
            if weights:
                torch.autograd.backward(outs, grads)
            elif wrt:  # with no input to differentiate, only the arriving gradient is there
                got = torch.autograd.grad(outs, wrt, grads, allow_unused=True)
                del got
        return max(0, live.peak)
    finally:
        for p, g in zip(params, old):
            p.grad = g
        for t, g in zip(wrt, old_inputs):
            t.grad = g
