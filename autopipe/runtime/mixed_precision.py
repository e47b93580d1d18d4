"""Mixed precision: the stages run under ``torch.autocast``, and their boundaries carry what autocast produces.

A pipeline is traced in the model's own precision (float32), so torch's stages size every
receive buffer for a float32 tensor. Under autocast a stage may send bfloat16 (a linear
layer's output) or float32 (a layer norm's): :func:`carry_autocast_dtypes` runs the stage
chain once on fake tensors under autocast and writes those dtypes into the stage graphs'
boundary metadata, so a bfloat16 activation crosses the cut in bfloat16 and its gradient
comes back in bfloat16, as in the unsplit model under the same autocast.

Example::

    carry_autocast_dtypes([pipe.get_stage_module(s) for s in range(pipe.num_stages)], inputs, "bf16",
                          torch.device("cpu"))
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.func import functional_call
from torch.utils._pytree import tree_flatten

from ..machine.precision import mixed_precision_context


def carry_autocast_dtypes(stage_modules: Sequence[nn.Module], inputs: Sequence[Any], precision: str,
                          device: torch.device) -> list[list[torch.dtype | None]]:
    """Write into each stage graph the dtypes its boundary tensors have under autocast; return them per stage.

    Each stage runs once, in order, on fake tensors placed on ``device`` (nothing is
    computed, nothing allocated), every stage taking what the one before it returned, as
    the split pipe's stages do after ``relay_skip_connections``. A floating output of
    stage ``s`` (and so input of stage ``s + 1``) gets the dtype autocast gave it.
    """
    fake = FakeTensorMode(allow_non_fake_inputs=True)

    def on_device(value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        return fake.from_tensor(value).to(device) if value.device.type != "meta" else \
            torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=device)

    found: list[list[torch.dtype | None]] = []
    with fake, mixed_precision_context(precision, device):
        values = tuple(on_device(t) for t in inputs)
        for module in stage_modules:
            state = {name: on_device(t) for name, t in [*module.named_parameters(remove_duplicate=False),
                                                         *module.named_buffers(remove_duplicate=False)]}
            out = functional_call(module, state, values, strict=False, tie_weights=False)
            values = out if isinstance(out, tuple) else (out,)
            found.append([v.dtype if isinstance(v, torch.Tensor) else None for v in tree_flatten(values)[0]])
    for s, module in enumerate(stage_modules):
        _set_dtypes(module, outputs=found[s] if s < len(stage_modules) - 1 else None,
                    inputs=found[s - 1] if s > 0 else None)
    return found


def _set_dtypes(module: nn.Module, *, outputs: list[torch.dtype | None] | None,
                inputs: list[torch.dtype | None] | None) -> None:
    """Give the floating boundary values of ``module``'s graph the dtypes found under autocast."""
    graph = module.graph

    def retype(node: Any, dtype: torch.dtype | None) -> None:
        val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
        if isinstance(val, torch.Tensor) and val.is_floating_point() and dtype is not None \
                and dtype.is_floating_point and dtype != val.dtype:
            node.meta["val"] = val.to(dtype)

    if inputs is not None:
        for node, dtype in zip([n for n in graph.nodes if n.op == "placeholder"], inputs):
            retype(node, dtype)
    if outputs is not None:
        output = next(n for n in graph.nodes if n.op == "output")
        for node, dtype in zip(tree_flatten(output.args[0])[0], outputs):
            retype(node, dtype)
