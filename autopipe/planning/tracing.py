"""Trace a model with torch.export and find every legal split point.

Example:
    >>> import torch
    >>> from autopipe.models import seed_transformer
    >>> from autopipe.planning.tracing import trace
    >>> model, args = seed_transformer(vocab_size=100, num_layers=2, seq_len=8)
    >>> traced = trace(model, args)
    >>> traced.split_point_names[:3]
    ['pos_encoding', 'layers.0', 'layers.0.attention.k_linear']
"""

from __future__ import annotations

import contextlib
import contextvars
import io
import os
import re
import sysconfig
import traceback
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.fx as fx
from torch.export import ExportedProgram

from . import hf_compat
from .autograd_functions import functions_kept, kept_function_classes
from .data_dependent import excluded_note, unbacked_note, unbacked_sizes, unbacked_symbols, without_unbacked_cuts
from .export_check import (EagerComparison, compare_with_eager, gradient_mismatch_message, gradients_checked_here,
                           host_random_state)
from ..errors import ModelExportError, MissingExampleInputsError

@dataclass(frozen=True)
class SplitCandidate:
    """A place where the pipeline may be cut: before the first graph node of ``name``."""

    name: str  # outermost module starting at this position; used in split_spec
    position: int  # index into TracedModel.nodes of the first node after the cut
    aliases: tuple[str, ...] = ()


@dataclass
class Segment:
    """A run of graph nodes between two neighbouring cuts: the smallest unit of a stage."""

    index: int
    name: str  # the split point it starts at ("<input>" for the first segment)
    start: int  # first node index (into TracedModel.nodes)
    end: int  # one past the last node index
    modules: list[str] = field(default_factory=list)  # modules whose nodes all lie here, outermost
    param_names: list[str] = field(default_factory=list)  # parameters and buffers it reads


@dataclass
class TracedModel:
    """The exported graph of one micro-batch and its legal split points.

    Attributes:
        exported: the ``torch.export.ExportedProgram``.
        graph_module: ``exported.module()``; shares parameter tensors with the user's model.
        nodes: the graph's compute nodes (``call_function``) in execution order.
        candidates: the legal split points in graph order (no cut at position 0).
        segments: ``len(candidates) + 1`` runs of nodes between the cuts.
        example_args / example_kwargs: the micro-batch the model was traced with.
        notes: one line per setting autopipe changed to capture the model (a Hugging Face
            KV cache turned off, :mod:`autopipe.planning.hf_compat`), per custom autograd
            Function kept whole, per data-dependent size and how it was counted; the plan's
            report shows them.
        unbacked_sizes: the size each data-dependent symbol (``u0``: rows a ``nonzero`` or a
            boolean mask keeps) is counted at, by symbol name: what the example micro-batch
            gave when the model ran, else the largest the trace allows.
        excluded_cuts: split points a tensor of data-dependent size would cross, with why;
            they are not among ``candidates``.
    """

    exported: ExportedProgram
    graph_module: fx.GraphModule
    nodes: list[fx.Node]
    candidates: list[SplitCandidate]
    segments: list[Segment]
    example_args: tuple[Any, ...]
    example_kwargs: dict[str, Any]
    model_name: str = ""
    notes: list[str] = field(default_factory=list)  # what autopipe changed to capture it, for the plan
    unbacked_sizes: dict[str, int] = field(default_factory=dict)
    excluded_cuts: dict[str, str] = field(default_factory=dict)
    # What it was traced from (the model, weakly; the inputs' shapes; the module tree), for traced_from.
    source: tuple[Any, str, tuple] | None = field(default=None, repr=False, compare=False)

    @property
    def split_point_names(self) -> list[str]:
        """The candidate split point names in graph order (what ``split_spec`` may use)."""
        return [c.name for c in self.candidates]

    @property
    def num_segments(self) -> int:
        return len(self.segments)


# --------------------------------------------------------------------------- inputs


def resolve_example_inputs(
    model: torch.nn.Module,
    example_args: Sequence[Any] | Any | None,
    example_kwargs: Mapping[str, Any] | None,
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Return ``(args, kwargs)`` for one micro-batch, taking them from the model if omitted."""
    if example_args is None and example_kwargs is None:
        carried = getattr(model, "example_input_array", None)
        if carried is not None:
            example_args = carried
        else:
            dummy = getattr(model, "dummy_inputs", None)
            if isinstance(dummy, Mapping) and dummy:
                example_kwargs = dict(dummy)
                example_args = ()
            elif dummy is not None and not isinstance(dummy, Mapping):
                example_args = dummy
    if example_args is None and not example_kwargs:
        raise MissingExampleInputsError(
            f"example_args=None and example_kwargs=None for {type(model).__name__}: autopipe needs one "
            "micro-batch of example inputs to trace the model. Pass example_args=(x_mb,) (as mb_args "
            "in torch's pipeline()), or give the model an `example_input_array` attribute (Lightning) "
            "or `dummy_inputs` (Hugging Face)."
        )
    if example_args is None:
        example_args = ()
    if not isinstance(example_args, tuple):
        example_args = tuple(example_args) if isinstance(example_args, list) else (example_args,)
    if example_kwargs is not None and not isinstance(example_kwargs, Mapping):
        raise TypeError(
            f"example_kwargs must be a dict of keyword arguments, got {type(example_kwargs).__name__}"
        )
    return example_args, dict(example_kwargs or {})


# --------------------------------------------------------------------------- export


def _export(model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> ExportedProgram:
    """``torch.export.export`` as ``pipeline()`` calls it, with a useful error when it fails."""
    try:
        # export prints long guard/warning logs for some models; keep the user's terminal clean.
        with contextlib.redirect_stdout(io.StringIO()), export_guards(model):
            return torch.export.export(model, args, kwargs)
    except Exception as e:  # noqa: BLE001 - re-raised with advice, cause kept
        own = _own_error(e)
        if own is not None:
            raise own from e
        raise export_error(model, e) from e
    finally:
        release_last_export()


def _own_error(error: BaseException) -> ModelExportError | None:
    """autopipe's own refusal raised inside the exporter (a custom Function it cannot keep), if that is the cause."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, ModelExportError):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


@contextlib.contextmanager
def export_guards(model: torch.nn.Module) -> Iterator[None]:
    """What every ``torch.export`` of a model for training runs under, autopipe's trace and ``pipeline()`` alike.

    A custom ``torch.autograd.Function`` stays one node with its own backward
    (:mod:`autopipe.planning.autograd_functions`), and randomness drawn outside torch warns
    (:func:`warn_if_host_randomness_is_frozen`). What export still changes is found after the
    capture, by :func:`autopipe.planning.export_check.compare_with_eager`.

    Example:
        >>> with export_guards(torch.nn.Identity()):
        ...     _ = torch.export.export(torch.nn.Identity(), (torch.ones(1),))
    """
    with warn_if_host_randomness_is_frozen(model), functions_kept():
        yield


class FrozenRandomnessWarning(UserWarning):
    """The model drew random numbers with NumPy or Python while it was traced: they are constants in the graph."""


@contextlib.contextmanager
def warn_if_host_randomness_is_frozen(model: torch.nn.Module) -> Iterator[None]:
    """Warn when the traced forward draws from NumPy's or Python's random generator.

    Example:
        >>> with warn_if_host_randomness_is_frozen(torch.nn.Identity()):
        ...     pass
    """
    before = host_random_state()
    yield
    if host_random_state() != before:
        warnings.warn(
            f"{type(model).__name__}'s forward drew random numbers with NumPy or Python's random module while it "
            f"was traced: they are now constants of the graph, the same at every step (a random mask drawn this "
            f"way, as Hugging Face's SpecAugment draws mask_time_indices, masks the same positions every step). "
            f"Draw them with torch (torch.rand, torch.bernoulli), or turn that feature off (Wav2Vec2, HuBERT: "
            f"config.apply_spec_augment=False)", FrozenRandomnessWarning, stacklevel=3)


def release_last_export() -> int:
    """Let go of the graph torch keeps from the last ``torch.export`` trace; the entries dropped.

    Example:
        >>> release_last_export() >= 0
        True
    """
    try:
        from torch.fx.experimental import proxy_tensor
    except ImportError:  # pragma: no cover - torch without fx
        return 0
    kept = getattr(proxy_tensor, "_FAKE_TENSOR_ID_TO_PROXY_MAP_FOR_EXPORT", None)
    if not isinstance(kept, dict):
        return 0
    dropped = len(kept)
    kept.clear()
    return dropped


#: What to try for each kind of export failure :func:`export_error` recognises.
_EXPORT_ADVICE = {
    "data-dependent": (
        "forward() makes a Python decision (if, int(), a shape) on a tensor's value, which the capture "
        "cannot know in advance. Write the branch as tensor code (torch.where(cond, a, b), or torch.cond "
        "for two sub-computations), or, when the decision is fixed for a whole run (a flag, a mode, a "
        "length), pass it as a plain Python bool/int keyword in example_kwargs so the graph is captured "
        "for that value."
    ),
    "cache-output": (
        "forward() returns a Hugging Face KV cache although autopipe turns use_cache off on every config "
        "of the model; this model builds it another way. Pass use_cache=False (or its equivalent) in "
        "example_kwargs, or wrap the model in a module whose forward returns only the tensors training "
        "needs (e.g. the logits)."
    ),
    "output-type": (
        "forward() returns an object torch.export does not know. Return tensors (or tuples, lists, dicts "
        "of tensors), wrap the model in a module whose forward returns those tensors, or register the "
        "type with torch.utils._pytree.register_pytree_node (torch.export.register_dataclass for a "
        "dataclass)."
    ),
    "input-type": (
        "an example input is an object torch.export does not know. Pass tensors and plain Python values "
        "(or tuples, lists, dicts of them), or register the type with "
        "torch.utils._pytree.register_pytree_node (torch.export.register_dataclass for a dataclass)."
    ),
    "parameter-change": (
        "forward() casts, moves or replaces the model's own parameters while it runs (a module.to(...) "
        "inside forward), which a capture cannot record. Do that once before autopipe sees the model "
        "(e.g. model.to(dtype)), or wrap the model so its forward leaves the parameters as they are."
    ),
    "other": (
        "remove data-dependent Python control flow from forward() (use torch.where / torch.cond), return "
        "tensors (or tuples/dicts of tensors) rather than custom objects, make sure the example inputs "
        "match a real micro-batch, and read the exporter's full message in the chained exception above."
    ),
}


def export_failure_kind(error: BaseException) -> str:
    """Which kind of torch.export failure ``error`` is: one of the keys of ``_EXPORT_ADVICE``.

    Example:
        >>> export_failure_kind(RuntimeError("Found <class 'Foo'> in output, which is not a known type."))
        'output-type'
    """
    text = str(error)
    names = {cls.__name__ for cls in type(error).__mro__}
    if names & {"GuardOnDataDependentSymNode", "DataDependentOutputException"} or "data-dependent" in text:
        return "data-dependent"
    if " in output" in text and "not a known type" in text:
        found = re.search(r"Found <class '([^']+)'>", text)
        return "cache-output" if found and found.group(1).rsplit(".", 1)[-1].endswith("Cache") else "output-type"
    if "Couldn't swap" in text:  # Module._apply inside forward: torch.export holds the parameters fixed
        return "parameter-change"
    if "Unsupported input type" in text or (" in input" in text and "not a known type" in text):
        return "input-type"
    return "other"


def _user_frame(error: BaseException) -> str | None:
    """``file:line in function`` of the deepest frame of the failure outside torch and Python itself."""
    paths = sysconfig.get_paths()
    torch_dir, stdlib = os.path.dirname(torch.__file__) + os.sep, paths["stdlib"] + os.sep
    installed = (paths["purelib"] + os.sep, paths["platlib"] + os.sep)  # inside stdlib's folder on some layouts
    found = None
    for frame in traceback.extract_tb(error.__traceback__):
        if frame.filename.startswith("<"):  # code torch generates (<string>, <eval_with_key>)
            continue
        path = os.path.abspath(frame.filename)
        if path == os.path.abspath(__file__) or path.startswith(torch_dir) or (
                path.startswith(stdlib) and not path.startswith(installed)):
            continue
        found = frame
    if found is None:
        return None
    code = f": {found.line.strip()}" if found.line else ""
    return f"{found.filename}:{found.lineno} in {found.name}{code}"


def export_error(model: torch.nn.Module, error: BaseException) -> ModelExportError:
    """The :class:`ModelExportError` for a failed ``torch.export.export(model, ...)``.

    Example:
        >>> err = export_error(torch.nn.Linear(2, 2), RuntimeError("Found <class 'Foo'> in output, which is "
        ...                                                        "not a known type."))
        >>> print(str(err).splitlines()[0])
        torch.export could not capture Linear as one graph: Found <class 'Foo'> in output, which is not a known type.
    """
    kind = export_failure_kind(error)
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    reason = lines[0] if lines else type(error).__name__
    if len(reason) > 160:  # the exporter's first sentence says what failed; the rest is general help
        reason = re.split(r"(?<=[.!?])\s", reason, maxsplit=1)[0]
    if len(reason) > 300:
        reason = reason[:297] + "..."
    where = _user_frame(error)
    advice = _EXPORT_ADVICE[kind]
    layerdrop = {k: v for k, v in getattr(getattr(model, "config", None), "__dict__", {}).items()
                 if "layerdrop" in k and isinstance(v, float) and v > 0}
    if kind == "data-dependent" and layerdrop and model.training:
        # Hugging Face's LayerDrop: `if torch.rand([]) < layerdrop: skip the layer`, decided in Python.
        fields = ", ".join(f"model.config.{k} = 0.0" for k in layerdrop)
        advice = (f"this model skips whole layers at random in training (LayerDrop: {layerdrop}), a decision "
                  f"a graph cannot hold; set {fields} before building the pipeline. Otherwise: {advice}")
    return ModelExportError(
        f"torch.export could not capture {type(model).__name__} as one graph: {reason}\n"
        + (f"Where: {where}\n" if where else "")
        + "torch.distributed.pipelining captures the model the same way (torch.export, non-strict), so "
        "autopipe cannot split this model as it is.\n"
        f"What to try: {advice} See https://pytorch.org/docs/stable/export.html",
        kind=kind,
    )


def module_spans(nodes: list[fx.Node]) -> tuple[dict[str, list[int]], set[str]]:
    """For every module FQN, the graph node indices it produced; and the FQNs called more than once.

    Example:
        >>> import torch
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
        >>> spans, called_twice = module_spans(trace(model, (torch.randn(2, 4),)).nodes)
        >>> sorted(spans), called_twice
        (['0', '1'], set())
    """
    spans: dict[str, list[int]] = {}
    called_twice: set[str] = set()
    for i, node in enumerate(nodes):
        stack = node.meta.get("nn_module_stack") or {}
        for key, (fqn, _type) in stack.items():
            if not fqn:
                continue  # the root module
            if "@" in key:  # export's marker for the second and later calls of a module
                called_twice.add(fqn)
            spans.setdefault(fqn, []).append(i)
    return spans, called_twice


def _find_candidates(nodes: list[fx.Node], user_fqns: set[str]) -> list[SplitCandidate]:
    spans, called_twice = module_spans(nodes)
    by_position: dict[int, list[str]] = {}
    for fqn, idx in spans.items():
        if fqn in called_twice or fqn not in user_fqns:
            continue
        first, last = idx[0], idx[-1]
        if last - first + 1 != len(idx):
            continue  # interleaved with other code: a BEGINNING cut would not isolate it
        if first == 0:
            continue  # a cut before everything creates an empty stage
        by_position.setdefault(first, []).append(fqn)
    candidates = []
    for pos in sorted(by_position):
        # Outermost first (fewest dots), then alphabetical, so the choice is deterministic.
        names = sorted(by_position[pos], key=lambda n: (n.count("."), n))
        candidates.append(SplitCandidate(name=names[0], position=pos, aliases=tuple(names[1:])))
    return candidates


def _build_segments(
    nodes: list[fx.Node], candidates: list[SplitCandidate], exported: ExportedProgram
) -> list[Segment]:
    bounds = [0] + [c.position for c in candidates] + [len(nodes)]
    names = ["<input>"] + [c.name for c in candidates]
    spans, _ = module_spans(nodes)
    # Map lifted placeholders (parameters, buffers, constants) back to their FQNs.
    sig = exported.graph_signature
    state_of: dict[str, str] = {}
    state_of.update(sig.inputs_to_parameters)
    state_of.update(sig.inputs_to_buffers)
    state_of.update(getattr(sig, "inputs_to_lifted_tensor_constants", {}) or {})

    segments = []
    for k in range(len(bounds) - 1):
        start, end = bounds[k], bounds[k + 1]
        inside = [f for f, idx in spans.items() if start <= idx[0] and idx[-1] < end]
        # Keep only outermost modules: drop any whose parent is also fully inside.
        inside_set = set(inside)
        outer = sorted(
            (f for f in inside if not any(f.startswith(p + ".") for p in inside_set if p != f)),
            key=lambda f: spans[f][0],
        )
        params: list[str] = []
        for node in nodes[start:end]:
            for arg in node.all_input_nodes:
                if arg.op == "placeholder" and arg.name in state_of:
                    fqn = state_of[arg.name]
                    if fqn not in params:
                        params.append(fqn)
        segments.append(Segment(index=k, name=names[k], start=start, end=end, modules=outer, param_names=params))
    return segments


def trace(
    model: torch.nn.Module,
    example_args: Sequence[Any] | Any | None = None,
    example_kwargs: Mapping[str, Any] | None = None,
) -> TracedModel:
    """Export ``model`` on one micro-batch and list the legal split points and segments.

    Args:
        model: Any ``nn.Module`` that ``torch.export`` can capture. It is not modified
            (a Hugging Face model's ``use_cache`` is off during the capture only).
        example_args: One micro-batch of positional inputs (as ``mb_args`` of
            ``torch.distributed.pipelining.pipeline``). May be omitted when the model carries
            ``example_input_array`` or ``dummy_inputs``.
        example_kwargs: One micro-batch of keyword inputs.

    Returns:
        A :class:`TracedModel`; pass it to :func:`autopipe.planning.profile.profile_segments`.

    Raises:
        MissingExampleInputsError: no inputs given and none carried by the model.
        ModelExportError: torch.export cannot capture the model (the exporter's reason included).

    Example:
        >>> from autopipe.models import seed_transformer
        >>> model, args = seed_transformer(vocab_size=100, num_layers=2, seq_len=8)
        >>> t = trace(model, args)
        >>> "layers.1" in t.split_point_names and "out_linear" in t.split_point_names
        True
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    reused = _REUSED.get()
    key = (id(model), inputs_signature(example_args, example_kwargs))
    if reused is not None and key in reused:
        return reused[key][1]
    traced = _trace(model, example_args, example_kwargs)
    traced.source = (weakref.ref(model), key[1], _structure_key(model))
    if reused is not None:
        reused[key] = (model, traced)  # the model is kept too, so that its id is not reused meanwhile
    return traced


# The traces of the innermost traces_reused() scope, by model and input shapes (None: no scope).
_REUSED: contextvars.ContextVar[dict[Any, tuple[torch.nn.Module, TracedModel]] | None] = contextvars.ContextVar(
    "autopipe_traces_reused", default=None)


@contextlib.contextmanager
def traces_reused() -> Iterator[None]:
    """Within it, tracing a model again on inputs of the same shapes returns its first trace.

    Example:
        >>> model = torch.nn.Linear(2, 2)
        >>> with traces_reused():
        ...     trace(model, (torch.ones(1, 2),)) is trace(model, (torch.zeros(1, 2),))
        True
    """
    token = _REUSED.set({})
    try:
        yield
    finally:
        _REUSED.reset(token)


def with_candidates(traced: TracedModel, keep: Callable[[SplitCandidate], bool]) -> TracedModel:
    """``traced`` cut only at the candidates ``keep`` accepts: the segments between them merged, nothing exported again."""
    candidates = [c for c in traced.candidates if keep(c)]
    segments = _build_segments(traced.nodes, candidates, traced.exported)
    return replace(traced, candidates=candidates, segments=segments)


def traced_from(traced: TracedModel, model: torch.nn.Module, example_args: Any,
                example_kwargs: Mapping[str, Any] | None) -> bool:
    """Whether ``traced`` is this model's trace on inputs of these shapes, its modules unchanged since."""
    if traced.source is None:
        return False
    ref, inputs, structure = traced.source
    return ref() is model and inputs == inputs_signature(example_args, example_kwargs) \
        and structure == _structure_key(model)


def _structure_key(model: torch.nn.Module) -> tuple:
    """What a trace depends on in the model besides values: its modules, their modes and forwards, tensor shapes."""
    modules = tuple((name, type(m), m.training, vars(m).get("forward")) for name, m in model.named_modules())
    tensors = tuple((name, tuple(t.shape), t.dtype, t.requires_grad)
                    for name, t in [*model.named_parameters(), *model.named_buffers()])
    return modules, tensors


def inputs_signature(example_args: Any, example_kwargs: Mapping[str, Any] | None) -> str:
    """What a trace depends on in its inputs: each tensor's shape, dtype and device; other values as written.

    Example:
        >>> inputs_signature((torch.ones(2, 3),), None) == inputs_signature((torch.zeros(2, 3),), None)
        True
        >>> inputs_signature((torch.ones(2, 3),), None) == inputs_signature((torch.ones(2, 4),), None)
        False
    """
    args = tuple(example_args) if isinstance(example_args, (tuple, list)) else \
        (() if example_args is None else (example_args,))
    leaves, spec = torch.utils._pytree.tree_flatten((args, dict(example_kwargs or {})))
    parts = [(tuple(x.shape), x.dtype, x.device.type) if isinstance(x, torch.Tensor) else repr(x) for x in leaves]
    return repr((spec, parts))


def _trace(model: torch.nn.Module, example_args: Any, example_kwargs: Mapping[str, Any] | None) -> TracedModel:
    """:func:`trace`, always exporting."""
    args, kwargs = resolve_example_inputs(model, example_args, example_kwargs)
    # A Hugging Face KV cache is no trainable output and cannot leave an exported graph: it
    # is off for the capture (the graph keeps that), and the model's settings come back after.
    kwargs, kwarg_changes = hf_compat.training_kwargs(model, kwargs)
    with hf_compat.training_config(model) as config_changes:
        exported = _export(model, args, kwargs)
    note = hf_compat.cache_note(kwarg_changes + config_changes)
    notes = [note] if note else []
    nodes = [n for n in exported.graph.nodes if n.op == "call_function"]
    user_fqns = {name for name, _ in model.named_modules() if name}
    candidates = _find_candidates(nodes, user_fqns)
    graph_module = exported.module()
    kept = kept_function_classes(exported.graph)
    if kept:
        notes.append(f"custom autograd Functions kept whole, each with its own backward: {', '.join(kept)}")
    unbacked = unbacked_symbols(nodes)
    checked = gradients_checked_here()
    # One run serves both: the gradients against eager autograd's, and the sizes data-dependent symbols take.
    comparison = compare_with_eager(model, graph_module, args, kwargs, gradients=checked) if checked or unbacked \
        else EagerComparison(skipped="compared when the pipeline builds its stages")
    if comparison.differing:
        raise ModelExportError(gradient_mismatch_message(type(model).__name__, comparison, kept),
                               kind="gradient-mismatch")
    sizes: dict[str, int] = {}
    if unbacked:
        sizes = unbacked_sizes(model, unbacked, comparison.unbacked_sizes, exported)
        notes.append(unbacked_note(unbacked, sizes, comparison.unbacked_sizes))
        candidates, excluded = without_unbacked_cuts(nodes, candidates)
        if excluded:
            notes.append(excluded_note(excluded))
    else:
        excluded = {}
    segments = _build_segments(nodes, candidates, exported)
    return TracedModel(
        exported=exported,
        graph_module=graph_module,
        nodes=nodes,
        candidates=candidates,
        segments=segments,
        example_args=args,
        example_kwargs=kwargs,
        model_name=type(model).__name__,
        notes=notes,
        unbacked_sizes=sizes,
        excluded_cuts=excluded,
    )
