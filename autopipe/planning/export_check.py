"""Check the traced program against the model itself: one forward and backward of each, compared.

Example:
    >>> model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.ReLU())
    >>> x = torch.randn(2, 3)
    >>> compare_with_eager(model, torch.export.export(model, (x,)).module(), (x,)).differing
    {}
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from . import hf_compat

#: Set to 0 to skip the comparison (a model whose eager run cannot be repeated on this device).
ENV_SWITCH = "AUTOPIPE_GRADIENT_CHECK"

# How far a traced gradient may lie from the eager one, relative to the larger of the two
# tensors' largest entries: the same ops in the same order agree to rounding, while what export
# changes moves gradients by far more (a dropped backward, a sign, a factor).
_RELATIVE_TOLERANCE = {torch.float64: 1e-6, torch.float32: 1e-4}
_HALF_TOLERANCE = 2e-2


@dataclass
class EagerComparison:
    """What running the traced program beside the model found.

    Attributes:
        ran: whether both ran; ``skipped`` says why not.
        differing: parameter name -> (largest difference, largest eager gradient entry), for
            every parameter whose traced gradient is not the model's.
        unbacked_sizes: the size each data-dependent symbol (``u0``, ...) took on the example.
    """

    ran: bool = False
    skipped: str = ""
    differing: dict[str, tuple[float, float]] = field(default_factory=dict)
    unbacked_sizes: dict[str, int] = field(default_factory=dict)


_LATER: contextvars.ContextVar[bool] = contextvars.ContextVar("autopipe_gradients_checked_later", default=False)


@contextlib.contextmanager
def gradients_checked_later() -> Iterator[None]:
    """Within it, a trace runs its program forward only (for data-dependent sizes): whoever enters
    it compares gradients itself, as the pipeline does when it builds its stages.

    Example:
        >>> with gradients_checked_later():
        ...     gradients_checked_here()
        False
    """
    token = _LATER.set(True)
    try:
        yield
    finally:
        _LATER.reset(token)


def gradients_checked_here() -> bool:
    """Whether a trace made now compares its gradients with the model's (not inside :func:`gradients_checked_later`)."""
    return not _LATER.get()


def _tolerance(dtype: torch.dtype) -> float:
    return _RELATIVE_TOLERANCE.get(dtype, _HALF_TOLERANCE)


def host_random_state() -> tuple:
    """NumPy's and Python's random generators' states, to tell whether something drew from them."""
    import numpy as np

    _, keys, pos, has_gauss, gauss = np.random.get_state()
    return random.getstate(), keys.tobytes(), pos, has_gauss, gauss


def _scalar(outputs: list[Any]) -> torch.Tensor | None:
    """A fixed random projection of the floating outputs to one number, the same for both runs."""
    total = None
    for i, out in enumerate(outputs):
        if isinstance(out, torch.Tensor) and out.is_floating_point() and out.requires_grad:
            weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(1000 + i)).to(out.device)
            term = (out.float() * weights).sum()
            total = term if total is None else total + term
    return total


class _SizeRecorder(fx.Interpreter):
    """Runs the traced program, noting the value each data-dependent size symbol takes."""

    def __init__(self, module: fx.GraphModule) -> None:
        super().__init__(module)
        self.sizes: dict[str, int] = {}

    def run_node(self, n: fx.Node) -> Any:
        out = super().run_node(n)
        val = n.meta.get("val")
        if isinstance(val, torch.Tensor) and isinstance(out, torch.Tensor) and val.dim() == out.dim():
            for traced_dim, real in zip(val.shape, out.shape):
                expr = getattr(getattr(traced_dim, "node", None), "expr", None)
                if expr is not None and expr.is_Symbol:
                    self.sizes.setdefault(str(expr), int(real))
        return out


def _gradients(outputs: list[Any], params: list[torch.nn.Parameter]) -> list[torch.Tensor | None]:
    scalar = _scalar(outputs)
    if scalar is None or not params:
        return [None] * len(params)
    return list(torch.autograd.grad(scalar, params, allow_unused=True))


def _device_of(model: torch.nn.Module) -> torch.device | None:
    for t in (*model.parameters(), *model.buffers()):
        return t.device
    return None


def compare_with_eager(model: torch.nn.Module, program: fx.GraphModule, example_args: tuple[Any, ...],
                       example_kwargs: dict[str, Any] | None = None, *, gradients: bool = True) -> EagerComparison:
    """Run the traced ``program`` and ``model`` on the example micro-batch; compare their gradients.

    Neither run touches ``.grad``; buffers the forward writes (batch-norm statistics) and the
    random generators are put back as they were.

    Args:
        model: the model that was traced.
        program: what ``torch.export`` captured of it, as a module (``ExportedProgram.module()``),
            sharing the model's parameters.
        example_args / example_kwargs: the micro-batch it was traced with.
        gradients: False to run the traced program alone, forward only, for the sizes its
            data-dependent symbols take (``ran`` stays False).

    Returns:
        An :class:`EagerComparison`: the parameters whose gradients differ, and the sizes the
        data-dependent symbols took.

    Example:
        >>> model = torch.nn.Linear(3, 1)
        >>> x = torch.randn(2, 3)
        >>> compare_with_eager(model, torch.export.export(model, (x,)).module(), (x,)).ran
        True
    """
    result = EagerComparison()
    example_kwargs = dict(example_kwargs or {})
    if gradients and os.environ.get(ENV_SWITCH, "1") == "0":
        result.skipped = f"{ENV_SWITCH}=0"
        gradients = False
    inputs = [x for x in pytree.tree_leaves((example_args, example_kwargs)) if isinstance(x, torch.Tensor)]
    if any(t.is_meta for t in [*model.parameters(), *model.buffers(), *inputs]):
        result.skipped = "the model or its example inputs are on the meta device"
        return result
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    params = [p for p in model.parameters() if p.requires_grad] if gradients else []
    saved_buffers = [(b, b.detach().clone()) for b in model.buffers()]
    device = _device_of(model)
    devices = [device] if device is not None and device.type == "cuda" else []
    host_before = host_random_state()
    try:
        with torch.random.fork_rng(devices=devices), torch.set_grad_enabled(gradients):
            seed = torch.initial_seed() % (2 ** 31)
            torch.manual_seed(seed)
            recorder = _SizeRecorder(program)
            outputs = pytree.tree_leaves(recorder.run(*_flat_inputs(program, example_args, example_kwargs)))
            result.unbacked_sizes = recorder.sizes
            if not gradients:
                return result
            traced_grads = _gradients(outputs, params)
            for b, value in saved_buffers:
                b.data.copy_(value)
            torch.manual_seed(seed)
            with hf_compat.training_config(model):
                eager_out = pytree.tree_leaves(model(*example_args, **example_kwargs))
            eager_grads = _gradients(eager_out, params)
    except torch.OutOfMemoryError:
        result.skipped = "the device ran out of memory running the whole model on the example micro-batch"
        return result
    finally:
        for b, value in saved_buffers:
            b.data.copy_(value)
    if host_random_state() != host_before:
        result.skipped = "the model draws random numbers with NumPy or Python (see FrozenRandomnessWarning)"
        return result
    if [_shape(x) for x in outputs] != [_shape(x) for x in eager_out]:
        result.skipped = "the traced program returns other outputs than the model's forward"
        return result
    result.ran = True
    for name, p, a, b in zip(names, params, traced_grads, eager_grads):
        a = torch.zeros_like(p) if a is None else a
        b = torch.zeros_like(p) if b is None else b
        scale = max(a.abs().max().item(), b.abs().max().item()) if p.numel() else 0.0
        diff = (a.float() - b.float()).abs().max().item() if p.numel() else 0.0
        if diff > _tolerance(p.dtype) * scale + 1e-12:
            result.differing[name] = (diff, b.abs().max().item())
    return result


def _shape(x: Any) -> Any:
    return (tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else type(x).__name__


def _flat_inputs(program: fx.GraphModule, example_args: tuple, example_kwargs: dict) -> list[Any]:
    import torch.fx._pytree as fx_pytree

    return list(fx_pytree.tree_flatten_spec((tuple(example_args), example_kwargs), program._in_spec))


def gradient_mismatch_message(model_name: str, comparison: EagerComparison, kept_functions: list[str]) -> str:
    """The refusal a model gets when its traced program's gradients are not its own.

    Example:
        >>> c = EagerComparison(ran=True, differing={"a.weight": (0.5, 1.0)})
        >>> print(gradient_mismatch_message("Net", c, []).splitlines()[0])
        The program torch.export captured of Net trains with other gradients than Net itself, on the example micro-batch:
    """
    rows = sorted(comparison.differing.items(), key=lambda kv: -kv[1][0])
    listed = "\n".join(f"  {name}: differs by up to {diff:.3g} (its largest entry {scale:.3g})"
                       for name, (diff, scale) in rows[:10])
    more = f"\n  ... and {len(rows) - 10} more" if len(rows) > 10 else ""
    kept = (f" The custom autograd Functions {', '.join(kept_functions)} were kept with their own backward; the "
            f"difference lies elsewhere." if kept_functions else "")
    return (
        f"The program torch.export captured of {model_name} trains with other gradients than {model_name} itself, "
        f"on the example micro-batch:\n{listed}{more}\n"
        f"A pipeline of it would not train the model, so autopipe refuses it.{kept} What export changes without an "
        f"error: a hook registered on a tensor inside forward (Tensor.register_hook) is dropped; a custom autograd "
        f"Function that overrides apply, or one defined in torch itself, loses its backward; module backward hooks "
        f"do not run. What to do: move such gradient changes into a torch.autograd.Function (autopipe keeps its "
        f"backward), or apply them to the parameters' gradients between the step and the "
        f"optimizer. To skip this check (the gradients then go unchecked), set {ENV_SWITCH}=0."
    )
