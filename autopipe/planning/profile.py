"""Measure what every segment costs: forward and backward time, parameters, activations.

Example:
    >>> from autopipe.models import seed_transformer
    >>> from autopipe.planning.tracing import trace
    >>> from autopipe.planning.profile import profile_segments
    >>> model, args = seed_transformer(vocab_size=100, num_layers=1, seq_len=8)
    >>> costs = profile_segments(trace(model, args), repeats=1, warmup=0, progress=False)
    >>> all(c.fwd_s > 0 for c in costs)
    True
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten, tree_leaves, tree_map, tree_unflatten
from torch.utils.flop_counter import FlopCounterMode

from . import hf_compat
from .attention_count import ATTENTION_FLOPS
from .cost_sources import CostSource, cost_source
from .._checks import check_int
from .._progress import progress_iter
from ..machine.passes import (SavedBytes, WholePass, forward_backward, storage_key, time_accumulation, time_alone,
                              time_in_rounds)
from ..machine.speed import counting_flops
from ..machine.timing import CacheFlusher, Timer, per_run_s, resolve_device
from ..machine.working_set import backward_working_bytes, working_bytes
from .costgraph import SegmentCost, requires_grad_map, tensor_bytes
from .segment_graphs import copy_to_device, on_meta_device, segment_modules, stand_in
from .tracing import TracedModel


def check_flush_cache(flush_cache: Any) -> None:
    """Raise ``ValueError`` unless ``flush_cache`` is True or False (every entry point that profiles checks it first)."""
    if not isinstance(flush_cache, bool):
        raise ValueError(f"flush_cache={flush_cache!r} must be True or False")


def check_runs(warmup: Any, repeats: Any) -> None:
    """Raise ``ValueError`` unless ``warmup`` is an integer >= 0 and ``repeats`` one >= 1 (booleans refused)."""
    check_int("warmup", warmup, 0)
    check_int("repeats", repeats, 1)


def check_fit_to_whole(fit_to_whole: Any) -> None:
    """Raise ``ValueError`` unless ``fit_to_whole`` is True, False or None (every entry point that profiles checks it first)."""
    if not (fit_to_whole is None or isinstance(fit_to_whole, bool)):
        raise ValueError(f"fit_to_whole={fit_to_whole!r} must be True, False or None (None: on CUDA only)")


@contextmanager
def _model_state_preserved(module: torch.nn.Module) -> Iterator[None]:
    """Restore buffers (running statistics) and the RNG state after profiling."""
    buffers = {name: b.detach().clone() for name, b in module.named_buffers()}
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        yield
    finally:
        with torch.no_grad():
            for name, b in module.named_buffers():
                if name in buffers:
                    b.copy_(buffers[name])
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)


class SegmentCosts(list):
    """What :func:`profile_segments` returns: a list of :class:`SegmentCost`, plus ``whole`` and ``traced``.

    ``traced`` is the trace the costs were measured on: ``partition`` given these costs for the
    same model (unchanged, the same input shapes) plans from it without exporting again.
    """

    whole: WholePass | None = None
    traced: TracedModel | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in vars(self).items() if k != "traced"}  # a trace stays in its process


def coarsened(costs: Sequence[SegmentCost], fine: TracedModel, coarse: TracedModel) -> SegmentCosts:
    """A profile of ``fine``'s segments as costs of ``coarse``'s, each the sum of the fine segments it spans.

    ``coarse`` is ``fine`` cut at fewer split points (``tracing.with_candidates``, as a
    framework target cuts): times, FLOPs, parameter and saved bytes add up; the output is the
    last piece's; a backward's peak beyond the saved bytes is the largest piece's, since the
    pieces run their backwards one after another.

    Raises:
        ValueError: a coarse segment does not start where a fine one starts.

    Example:
        >>> merged = coarsened(profile, traced, with_candidates(traced, keep))  # doctest: +SKIP
    """
    index = {seg.start: k for k, seg in enumerate(fine.segments)}  # fine segment by its first node
    out = SegmentCosts()
    for seg, after in zip(coarse.segments, [*coarse.segments[1:], None]):
        if seg.start not in index or (after is not None and after.start not in index):
            bad = seg if seg.start not in index else after
            raise ValueError(f"segment {bad.name!r} starts inside a profiled segment: the profile is of another trace")
        pieces = costs[index[seg.start]: index[after.start] if after is not None else len(costs)]
        out.append(SegmentCost(
            **{k: sum(getattr(c, k) for c in pieces) for k in ("fwd_s", "bwd_s", "param_bytes", "act_bytes", "flops",
                                                              "trainable_param_bytes", "accum_s")},
            out_bytes=pieces[-1].out_bytes, bwd_peak_bytes=max(c.bwd_peak_bytes for c in pieces),
            bwd_input_peak_bytes=max(c.bwd_input_peak_bytes for c in pieces)))
    out.whole, out.traced = getattr(costs, "whole", None), coarse
    return out


class _WholeGraph(torch.nn.Module):
    """The traced model's whole graph, called with the flat inputs the segments are fed."""

    def __init__(self, graph_module: torch.nn.Module, spec: Any) -> None:
        super().__init__()
        self.graph_module = graph_module
        self.spec = spec

    def forward(self, *flat: Any) -> Any:
        args, kwargs = tree_unflatten(list(flat), self.spec)
        return self.graph_module(*args, **kwargs)


def fit_to_whole_default(device: torch.device) -> bool:
    """Whether :func:`profile_segments` scales segments to the whole graph by default on ``device``.

    Example:
        >>> fit_to_whole_default(torch.device("cpu"))
        False
    """
    return torch.device(device).type == "cuda"


def profile_segments(
    traced: TracedModel,
    *,
    cost: str | CostSource = "measured",
    device: str | torch.device | None = None,
    warmup: int = 2,
    repeats: int = 5,
    device_flops: float | None = None,
    progress: bool = True,
    flush_cache: bool = True,
    fit_to_whole: bool | None = None,
) -> SegmentCosts:
    """Measure (or estimate) every segment's cost per micro-batch.

    Args:
        traced: The result of :func:`autopipe.planning.tracing.trace`.

    Keyword Args:
        cost: ``"measured"`` (time it), ``"flops"`` or ``"params"`` (estimate it); see the
            module docstring.
        device: Where to run: ``"cpu"``, ``"cuda"``, ``"cuda:1"``; default CUDA if present.
            When the model lives elsewhere, a copy of it is profiled there (the model is
            left where it is); only when the copy does not fit, each segment is copied
            there in turn and timed on its own (with a warning on CUDA: such times add up to
            more than the model's, and nothing is fitted to the whole graph). A model on the
            meta device is timed that way too: each segment is copied to ``device`` with
            stand-in values (:func:`~autopipe.planning.segment_graphs.stand_in`) and freed
            before the next, so the process never holds more than one segment's weights.
        warmup: Untimed runs before timing (measured source only).
        repeats: Timed runs; their mean is kept (:func:`~autopipe.machine.timing.per_run_s`;
            measured source only). When the model (or its copy) is on ``device``, each run is a
            round over the whole model - every segment's forward in order, then every backward
            in reverse, as in training - rather than one segment run again and again: a
            segment repeated back to back
            finds its weights and inputs still in the cache, which in training it does not
            (docs/design.md, finding 5).
        device_flops: FLOP/s used to turn FLOPs into seconds; measured when omitted.
        progress: Show a progress bar.
        flush_cache: Empty the device's caches (:class:`~autopipe.machine.timing.CacheFlusher`)
            before each round's forwards and before its backwards (measured source, when timed
            in rounds). In a pipeline every action starts with its stage's weights out of the
            cache, as other micro-batches
            and stages ran since; timed with the caches still warm from the previous round,
            the stages run longer in the pipeline than profiled (docs/design.md, finding 6).
            ``False`` keeps them warm.
        fit_to_whole: When timed in rounds, the whole graph is timed in every round too
            (:class:`~autopipe.machine.passes.WholePass`, kept as the result's ``whole``); ``True`` scales the segments'
            times so that each pass adds up to it. ``None`` (default): on CUDA only
            (:func:`fit_to_whole_default`), where a segment timed on its own pays a start
            from an idle GPU that a stage does not.

    Timing in rounds also times each segment's gradient accumulation (``accum_s``) into
    buffers of its own: one gradient's worth of the trainable parameters is allocated on
    ``device`` for the profile's duration, as ``.grad`` would be in training.

    Returns:
        One :class:`~autopipe.planning.costgraph.SegmentCost` per segment, in graph order, as a
        :class:`SegmentCosts` list (its ``whole`` says what the whole graph took). Attach
        them with ``build_cost_graph(traced, costs)``.

    Raises:
        ValueError: unknown ``cost``, or ``warmup``/``repeats``/``flush_cache``/``fit_to_whole``
            out of range.

    Example:
        >>> from autopipe.models import seed_transformer
        >>> from autopipe.planning.tracing import trace
        >>> model, args = seed_transformer(vocab_size=100, num_layers=1, seq_len=8)
        >>> costs = profile_segments(trace(model, args), cost="flops", progress=False)
        >>> costs[-1].flops > 0
        True
    """
    source = cost_source(cost)
    check_runs(warmup, repeats)
    check_flush_cache(flush_cache)
    check_fit_to_whole(fit_to_whole)
    dev = resolve_device(device)
    fit = fit_to_whole_default(dev) if fit_to_whole is None else fit_to_whole
    gm = traced.graph_module
    if source.measured and not _lives_on(gm, dev):
        # Time a copy of the whole model on the device when it fits: then the segments are
        # timed in rounds beside the whole graph. Only when it does not, one segment at a time;
        # always so for a model on the meta device, which may be far bigger than the host.
        if room_for_whole(gm, dev) and not on_meta_device(gm):
            try:
                return _profile(traced, copy_to_device(gm, dev), dev, source=source, warmup=warmup, repeats=repeats,
                                progress=progress, flush_cache=flush_cache, fit=fit)
            except torch.cuda.OutOfMemoryError:
                pass  # the copy and what it held go with the exception
        if dev.type == "cuda" and not on_meta_device(gm):
            torch.cuda.empty_cache()
            warnings.warn(
                f"{traced.model_name} does not fit on {dev} whole for profiling: each segment is copied "
                "there and timed on its own, and on a GPU such times add up to well over the model's "
                "(docs/design.md, finding 4). Profile on a GPU with "
                "room for the model and one micro-batch's activations to have the segments fitted to the "
                "whole graph", stacklevel=2)
    return _profile(traced, gm, dev, source=source, warmup=warmup, repeats=repeats, progress=progress,
                    flush_cache=flush_cache, fit=fit, device_flops=device_flops)


def room_for_whole(module: torch.nn.Module, dev: torch.device) -> bool:
    """Whether a CUDA device has free memory for a copy of ``module`` to profile in rounds.

    Example:
        >>> room_for_whole(torch.nn.Linear(4, 4), torch.device("cpu"))
        True
    """
    if dev.type != "cuda":
        return True
    state_bytes = sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))
    free_bytes, _ = torch.cuda.mem_get_info(dev)
    return 3 * state_bytes < free_bytes


def _lives_on(module: torch.nn.Module, dev: torch.device) -> bool:
    """Whether every parameter and buffer of ``module`` is on ``dev``."""
    return all(t.device == dev for t in (*module.parameters(), *module.buffers()))


def _profile(
    traced: TracedModel, gm: fx.GraphModule, dev: torch.device, *, source: CostSource, warmup: int, repeats: int,
    progress: bool, flush_cache: bool, fit: bool, device_flops: float | None = None,
) -> SegmentCosts:
    """:func:`profile_segments` on the graph ``gm`` (the traced model's own, or a copy on ``dev``)."""
    timer = Timer(dev)
    seg_mods = segment_modules(traced, gm)
    rg_ep = requires_grad_map(traced)
    needs_grad = {n.name: v for n, v in rg_ep.items()}

    # Model inputs, by placeholder name (the exported graph's flat user inputs).
    user_names = list(traced.exported.graph_signature.user_inputs)
    flat_inputs, input_spec = tree_flatten((traced.example_args, traced.example_kwargs))
    env: dict[str, Any] = {}
    for name, val in zip(user_names, flat_inputs):
        env[name] = stand_in(val, dev) if isinstance(val, torch.Tensor) else val
    model_inputs = [(name, env[name]) for name in user_names]  # env drops them once read
    last_use: dict[str, int] = {}
    for k, sm in enumerate(seg_mods):
        for name in sm.inputs:
            last_use[name] = k

    def fresh_leaves(named: list[tuple[str, Any]]) -> list[Any]:
        # Fresh leaves each run: inputs that carry a gradient in training get one here.
        return [v.detach().requires_grad_(True) if isinstance(v, torch.Tensor) and needs_grad.get(name, False)
                else v for name, v in named]

    params_seen: set[int] = set()
    saved_values: set[str] = set()  # graph values (segment inputs and outputs) some segment saves
    costs = SegmentCosts()
    costs.traced = traced
    # Time whole rounds over the model when no segment has to be copied to the device.
    in_rounds = source.measured and _lives_on(gm, dev)
    rounds: list[tuple[fx.GraphModule, Callable[[], list[Any]], list[torch.Tensor]]] = []
    with _model_state_preserved(gm):
        for k, sm in enumerate(progress_iter(seg_mods, "profiling segments", enabled=progress)):
            module = sm.module
            if not _lives_on(module, dev):
                module = copy_to_device(module, dev)  # a copy: never move the user's tensors
            state = list(module.named_parameters()) + list(module.named_buffers())
            # Parameters are charged where first used, so the segments add up to the model.
            param_bytes = trainable_bytes = 0
            src_tensors = dict(sm.module.named_parameters())
            src_tensors.update(dict(sm.module.named_buffers()))
            for name, t in state:
                key = id(src_tensors.get(name, t))
                if key not in params_seen:
                    params_seen.add(key)
                    param_bytes += t.numel() * t.element_size()
                    if isinstance(t, torch.nn.Parameter) and t.requires_grad:
                        trainable_bytes += t.numel() * t.element_size()
            trainable = [p for _, p in module.named_parameters() if p.requires_grad]

            def make_inputs(named: list[tuple[str, Any]] = [(n, env[n]) for n in sm.inputs]) -> list[Any]:
                return fresh_leaves(named)

            counter = SavedBytes({storage_key(p) for _, p in state})
            inputs = make_inputs()
            # Counted costs charge attention as a GPU's fused kernel wherever they are counted.
            attention = source.attention()
            with attention, FlopCounterMode(display=False, custom_mapping=ATTENTION_FLOPS) as flop_counter:
                _, _, out = forward_backward(module, inputs, trainable, timer, counter)
            flops = float(flop_counter.get_total_flops())
            act_bytes = _first_saved_bytes(counter, zip(sm.inputs, inputs), zip(sm.outputs, out), saved_values)
            del inputs
            with source.attention():
                work = backward_working_bytes(module, make_inputs())
            fwd_s = bwd_s = accum_s = 0.0  # timed in rounds below, or estimated, unless timed here
            if in_rounds:
                rounds.append((module, make_inputs, trainable))
            elif source.measured:
                # No flush here: emptying the caches before every segment would charge each
                # one a cold start that a stage pays once per action (docs/design.md, finding 6).
                fwd_s, bwd_s = time_alone(module, make_inputs, trainable, timer, warmup, repeats)
                accum_s = time_accumulation(trainable, timer, warmup, repeats)
            out_vals = [o.detach() if isinstance(o, torch.Tensor) else o for o in out]
            costs.append(
                SegmentCost(
                    fwd_s=fwd_s,
                    bwd_s=bwd_s,
                    param_bytes=param_bytes,
                    act_bytes=act_bytes,
                    out_bytes=tensor_bytes(out_vals),
                    flops=flops,
                    trainable_param_bytes=trainable_bytes,
                    accum_s=accum_s,
                    bwd_peak_bytes=work.accumulating,
                    bwd_input_peak_bytes=work.first,
                )
            )
            # Hand this segment's outputs to later segments; drop values nobody needs any more.
            for name, val in zip(sm.outputs, out_vals):
                env[name] = val
            for name in [n for n, last in last_use.items() if last == k]:
                env.pop(name, None)
            del module
        if in_rounds:
            # The flush buffer (twice the last-level cache) is allocated only when rounds are timed.
            flush = CacheFlusher(dev) if flush_cache else None
            whole = (_WholeGraph(gm, input_spec), lambda: fresh_leaves(model_inputs),
                     [p for p in gm.parameters() if p.requires_grad])
            per_segment, costs.whole = time_in_rounds(rounds, timer, warmup, repeats, flush, whole, fit)
            for cost_k, timed in zip(costs, per_segment):
                cost_k.fwd_s, cost_k.bwd_s, cost_k.accum_s = timed

    source.estimate(costs, device_flops if device_flops else counting_flops(dev))
    return costs


def _first_saved_bytes(counter: SavedBytes, inputs: Iterable[tuple[str, Any]], outputs: Iterable[tuple[str, Any]],
                       saved_values: set[str]) -> int:
    """The bytes a segment saves for backward that no earlier segment saved already.

    Example:
        >>> c = SavedBytes(set())
        >>> x = torch.ones(4, requires_grad=True)
        >>> with torch.autograd.graph.saved_tensors_hooks(c.pack, lambda t: t):
        ...     y = x.relu()
        >>> seen = {"y"}  # an earlier segment saved y already
        >>> _first_saved_bytes(c, [("x", x)], [("y", y)], seen), _first_saved_bytes(c, [], [], set())
        (0, 16)
    """
    named = {storage_key(t): name for name, t in (*inputs, *outputs) if isinstance(t, torch.Tensor)}
    total = 0
    for key, nbytes in counter.saved.items():
        name = named.get(key)
        if name is None:
            total += nbytes
        elif name not in saved_values:
            saved_values.add(name)
            total += nbytes
    return total


@dataclass
class LossCost:
    """What the loss adds to the last stage, per micro-batch: its forward and backward, saved bytes."""

    fwd_s: float
    bwd_s: float
    # Bytes kept from the loss's forward to its backward: what the loss saves (e.g. the
    # log-softmax of the logits) and the model output itself, which torch's last stage keeps
    # for the backward whether the loss saves it or not; each storage once.
    act_bytes: int
    batch: int  # the micro-batch size it was measured at (its first input's first dimension)
    # Peak bytes its backward allocates beyond act_bytes (the output's gradient, temporaries):
    # the start of the last stage's backward working set.
    bwd_peak_bytes: int = 0


def profile_loss(
    model: torch.nn.Module,
    example_args: Sequence[Any],
    example_kwargs: Mapping[str, Any] | None,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    target: Any,
    *,
    device: str | torch.device | None = None,
    warmup: int = 2,
    repeats: int = 5,
    output: Any = None,
) -> LossCost:
    """Measure ``loss_fn(model output, target)``: forward, backward and saved bytes per micro-batch.

    Example:
        >>> import torch.nn.functional as F
        >>> model = torch.nn.Linear(4, 3)
        >>> cost = profile_loss(model, (torch.randn(2, 4),), None, F.cross_entropy, torch.tensor([0, 2]),
        ...                     device="cpu", warmup=0, repeats=1)
        >>> cost.batch, cost.act_bytes > 0
        (2, True)
    """
    dev = resolve_device(device)
    timer = Timer(dev)
    if output is None:
        output = model_output(model, example_args, example_kwargs)
    output = tree_map(lambda t: stand_in(t.detach(), dev) if isinstance(t, torch.Tensor) else t, output)
    target = tree_map(lambda t: stand_in(t, dev) if isinstance(t, torch.Tensor) else t, target)
    first = next((t for t in tree_leaves((tuple(example_args), dict(example_kwargs or {})))
                  if isinstance(t, torch.Tensor) and t.dim() > 0), None)
    batch = int(first.shape[0]) if first is not None else 1

    def leaves() -> tuple[Any, list[torch.Tensor]]:
        out = tree_map(lambda t: t.detach().requires_grad_(True)
                       if isinstance(t, torch.Tensor) and t.is_floating_point() else t, output)
        return out, [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]

    counter = SavedBytes(set())
    out, wrt = leaves()
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t):
        loss = loss_fn(out, target)
    if not isinstance(loss, torch.Tensor) or not loss.requires_grad or not wrt:
        raise ValueError(f"loss_fn(output, target) must return a tensor that depends on the model output; "
                         f"got {type(loss).__name__}")
    # torch's last stage keeps the output it hands the loss until that micro-batch's backward.
    for t in wrt:
        counter.pack(t)
    out, wrt = leaves()
    bwd_peak_bytes = working_bytes(lambda: loss_fn(out, target), wrt, [])
    fwd, bwd = [], []
    for i in range(warmup + repeats):
        out, wrt = leaves()
        f, loss = timer.time(lambda: loss_fn(out, target))
        b, _ = timer.time(lambda: torch.autograd.grad(loss, wrt, allow_unused=True))
        if i >= warmup:
            fwd.append(f)
            bwd.append(b)
    return LossCost(fwd_s=per_run_s(fwd), bwd_s=per_run_s(bwd), act_bytes=counter.total,
                    batch=batch, bwd_peak_bytes=bwd_peak_bytes)


def model_output(model: torch.nn.Module, example_args: Sequence[Any], example_kwargs: Mapping[str, Any] | None) -> Any:
    """The model's output on one micro-batch, as the last stage produces it for the loss.

    Example:
        >>> model_output(torch.nn.Linear(4, 3), (torch.randn(2, 4),), None).shape
        torch.Size([2, 3])
    """
    kwargs, _ = hf_compat.training_kwargs(model, example_kwargs)
    with torch.no_grad(), _model_state_preserved(model), hf_compat.training_config(model):
        return model(*example_args, **kwargs)
