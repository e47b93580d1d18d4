"""The loss the last stage is costed with when the caller names none.

Example:
    >>> from autopipe.models import seed_transformer
    >>> from autopipe.planning.tracing import trace
    >>> model, args = seed_transformer(vocab_size=100, num_layers=1, seq_len=8)
    >>> chosen = assumed_loss(model, trace(model, args))
    >>> chosen.loss_fn is token_cross_entropy, tuple(chosen.target.shape), chosen.vocabulary
    (True, (4, 8), 100)
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch.export.graph_signature import OutputKind
from torch.utils._pytree import tree_leaves, tree_map, tree_unflatten

from .cost_sources import CostSource
from .profile import LossCost, model_output, profile_loss
from .segment_graphs import on_meta_device
from .tracing import TracedModel

#: The start of the plan note for a last stage costed without a loss.
NO_LOSS_NOTE = "loss: none costed"
#: The start of the plan note for a loss assumed from the model's kind.
ASSUMED_LOSS_NOTE = "loss: assumed token cross-entropy"

# Random targets are drawn from a fixed seed so the same model always gets the same target.
_TARGET_SEED = 0


def token_cross_entropy(output: Any, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of every position's logits against integer targets (a language model's loss).

    Example:
        >>> round(token_cross_entropy(torch.zeros(2, 3, 4), torch.zeros(2, 3, dtype=torch.long)).item(), 4)
        1.3863
    """
    logits = logits_of(output)
    if logits is None:
        raise ValueError(f"token_cross_entropy needs logits: a tensor, or an output with a 'logits' field; "
                         f"got {type(output).__name__}")
    return F.cross_entropy(logits.flatten(0, -2), target.flatten())


def logits_of(output: Any) -> torch.Tensor | None:
    """The logits in a model's output: the output itself if a floating tensor, else its ``logits`` field.

    Example:
        >>> logits_of({"logits": torch.zeros(2, 5)}).shape, logits_of((1, 2))
        (torch.Size([2, 5]), None)
    """
    if isinstance(output, torch.Tensor):
        found = output
    elif isinstance(output, Mapping):
        found = output.get("logits")
    else:
        found = getattr(output, "logits", None)
    if isinstance(found, torch.Tensor) and found.is_floating_point() and found.dim() >= 2:
        return found
    return None


def lm_vocabulary(model: torch.nn.Module, inputs: Sequence[Any], output: Any) -> int | None:
    """The vocabulary size if ``output`` is a language model's logits over it, else None.

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Embedding(50, 8), torch.nn.Linear(8, 50))
        >>> tokens = torch.zeros(2, 6, dtype=torch.long)
        >>> lm_vocabulary(model, (tokens,), torch.zeros(2, 6, 50)), lm_vocabulary(model, (tokens,), torch.zeros(2, 50))
        (50, None)
    """
    logits = logits_of(output)
    if logits is None:
        return None
    vocabulary = int(logits.shape[-1])
    token_shapes = {tuple(t.shape) for t in tree_leaves(list(inputs)) if isinstance(t, torch.Tensor)
                    and not t.is_floating_point() and not t.is_complex() and t.dtype != torch.bool}
    if tuple(logits.shape[:-1]) not in token_shapes:
        return None
    embeddings = {m.num_embeddings for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    if vocabulary in embeddings or (linears and linears[-1].out_features == vocabulary):
        return vocabulary
    return None


def traced_output(traced: TracedModel) -> Any:
    """The model's output as the trace knows it: its structure, with tensors on the meta device.

    Example:
        >>> from autopipe.planning.tracing import trace
        >>> traced = trace(torch.nn.Linear(4, 3), (torch.randn(2, 4),))
        >>> out = traced_output(traced)
        >>> out.shape, out.device.type
        (torch.Size([2, 3]), 'meta')
    """
    exported = traced.exported
    node = next(n for n in exported.graph.nodes if n.op == "output")
    values = [a.meta.get("val") if hasattr(a, "meta") else a for a in node.args[0]]
    kinds = [spec.kind for spec in exported.graph_signature.output_specs]
    user = [v for v, k in zip(values, kinds) if k == OutputKind.USER_OUTPUT]
    user = [torch.empty(v.shape, dtype=v.dtype, device="meta") if isinstance(v, torch.Tensor) else v for v in user]
    return tree_unflatten(user, exported.call_spec.out_spec)


@dataclass
class AssumedLoss:
    """What :func:`autopipe.partition` charges the last stage with when given no ``loss_fn``."""

    loss_fn: Callable[[Any, Any], torch.Tensor] | None
    target: torch.Tensor | None
    vocabulary: int | None
    note: str


def assumed_loss(model: torch.nn.Module, traced: TracedModel) -> AssumedLoss:
    """The loss a model of this kind trains with, or none, with the note the plan records.

    Example:
        >>> from autopipe.planning.tracing import trace
        >>> model, x = torch.nn.Linear(4, 3), torch.randn(2, 4)
        >>> chosen = assumed_loss(model, trace(model, (x,)))
        >>> chosen.loss_fn is None, chosen.note.startswith(NO_LOSS_NOTE)
        (True, True)
    """
    output = traced_output(traced)
    inputs = (traced.example_args, traced.example_kwargs)
    vocabulary = lm_vocabulary(model, inputs, output)
    if vocabulary is None:
        return AssumedLoss(None, None, None, (
            f"{NO_LOSS_NOTE}: no loss_fn was given and the output is not a language model's logits, so the last "
            "stage is costed without the loss's time and memory; pass loss_fn= and example_target= (one "
            "micro-batch's target) to partition() or Pipeline to charge it"))
    shape = tuple(logits_of(output).shape[:-1])
    target = torch.randint(0, vocabulary, shape, generator=torch.Generator().manual_seed(_TARGET_SEED))
    return AssumedLoss(token_cross_entropy, target, vocabulary, (
        f"{ASSUMED_LOSS_NOTE} over the {vocabulary}-token vocabulary (the output is a language model's "
        "logits and no loss_fn was given); pass loss_fn= and example_target= to cost your own loss, or "
        "loss_fn=False to cost the last stage without one"))


def example_target_for(model: torch.nn.Module, example_args: Sequence[Any], example_kwargs: Mapping[str, Any] | None,
                       loss_fn: Callable[[Any, Any], torch.Tensor], output: Any = None) -> tuple[Any, Any]:
    """One micro-batch's target that ``loss_fn`` accepts, derived from the model's output.

    Example:
        >>> model, x = torch.nn.Linear(4, 3), torch.randn(2, 4)
        >>> target, _ = example_target_for(model, (x,), None, torch.nn.functional.mse_loss)
        >>> target.shape, target.dtype
        (torch.Size([2, 3]), torch.float32)
    """
    if output is None:
        output = model_output(model, example_args, example_kwargs)
    generator = torch.Generator().manual_seed(_TARGET_SEED)
    candidates = []
    logits = logits_of(output)
    vocabulary = lm_vocabulary(model, (tuple(example_args), dict(example_kwargs or {})), output)
    if vocabulary is not None:
        candidates.append(torch.randint(0, vocabulary, tuple(logits.shape[:-1]), generator=generator))
    first = next((t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.is_floating_point()), None)
    if first is not None:
        candidates.append(torch.rand(first.shape, dtype=first.dtype, generator=generator))
    if logits is not None and vocabulary is None:
        candidates.append(torch.randint(0, int(logits.shape[-1]), tuple(logits.shape[:-1]), generator=generator))
    for candidate in candidates:
        if _accepts(loss_fn, output, candidate.to(first.device if first is not None else "cpu")):
            return candidate, output
    return None, output


def _accepts(loss_fn: Callable[[Any, Any], torch.Tensor], output: Any, target: torch.Tensor) -> bool:
    """Whether ``loss_fn(output, target)`` runs and gives a tensor that depends on the output."""
    out = tree_map(lambda t: t.detach().requires_grad_(True)
                   if isinstance(t, torch.Tensor) and t.is_floating_point() else t, output)
    try:
        with warnings.catch_warnings():  # a candidate of the wrong shape may warn before it fails
            warnings.simplefilter("ignore")
            loss = loss_fn(out, target)
    except Exception:  # noqa: BLE001 - a candidate the loss refuses: try the next one
        return False
    return isinstance(loss, torch.Tensor) and loss.requires_grad and loss.numel() == 1


def charged_loss(
    model: torch.nn.Module, traced: TracedModel, loss_fn: Any, example_target: Any, *,
    device: torch.device, warmup: int, repeats: int, cost_source: CostSource, profile_given: bool,
) -> tuple[LossCost | None, str | None]:
    """What :func:`autopipe.partition` charges the last stage for the loss, and the plan note about it.

    Example:
        >>> from autopipe.models import seed_transformer
        >>> from autopipe.planning.cost_sources import FLOPS
        >>> from autopipe.planning.tracing import trace
        >>> model, args = seed_transformer(vocab_size=100, num_layers=1, seq_len=8)
        >>> loss, note = charged_loss(model, trace(model, args), None, None, device=torch.device("cpu"),
        ...                           warmup=0, repeats=1, cost_source=FLOPS, profile_given=False)
        >>> loss.act_bytes >= 4 * 8 * 100 * 4, loss.fwd_s, note.startswith(ASSUMED_LOSS_NOTE)
        (True, 0.0, True)
    """
    if loss_fn is False:
        return None, None
    note = None
    if loss_fn is None:
        chosen = assumed_loss(model, traced)
        if chosen.loss_fn is None:
            return None, chosen.note
        loss_fn, example_target, note = chosen.loss_fn, chosen.target, chosen.note
    # A model on the meta device is not run (its eager code may read values, as Hugging Face
    # masks do): the loss gets the output's shapes from the trace, and stand-in values where timed.
    output = traced_output(traced) if on_meta_device(model) else None
    loss = profile_loss(model, traced.example_args, traced.example_kwargs, loss_fn, example_target,
                        device=device, warmup=warmup, repeats=repeats, output=output)
    if not cost_source.measured or (note is not None and profile_given):
        loss = replace(loss, fwd_s=0.0, bwd_s=0.0)  # its bytes stay
        if note is not None and cost_source.measured:
            note += " (its saved bytes only: the profile given as cost= holds no time for it)"
    return loss, note


def pipeline_loss(model: torch.nn.Module, example_args: Sequence[Any], example_kwargs: Mapping[str, Any] | None,
                  loss_fn: Callable[[Any, Any], torch.Tensor] | None,
                  example_target: Any = None, output: Any = None) -> tuple[dict[str, Any], str | None]:
    """The loss keywords for :func:`autopipe.partition` when a pipeline that runs ``loss_fn`` plans.

    Example:
        >>> model, x = torch.nn.Linear(4, 3), torch.randn(2, 4)
        >>> kwargs, note = pipeline_loss(model, (x,), None, torch.nn.functional.mse_loss)
        >>> kwargs["example_target"].shape, note
        (torch.Size([2, 3]), None)
    """
    if loss_fn is None:
        if example_target is not None:
            raise ValueError("example_target=... was given but the pipeline has no loss_fn to "
                             "compare it with; pass loss_fn= to the pipeline, or drop example_target")
        return {"loss_fn": False}, None
    if example_target is not None:
        return {"loss_fn": loss_fn, "example_target": example_target}, None
    target, _ = example_target_for(model, example_args, example_kwargs, loss_fn, output)
    if target is not None:
        return {"loss_fn": loss_fn, "example_target": target}, None
    return {"loss_fn": False}, (
        f"{NO_LOSS_NOTE}: no target that loss_fn accepts could be derived from the model's output (token ids, a "
        "tensor shaped like the output, class indices were tried), so the last stage is costed without the "
        "loss's time and memory; pass example_target=... (one micro-batch's target) to charge it")
