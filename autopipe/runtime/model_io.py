"""How the user's inputs reach the first stage and the last stage's outputs reach ``loss_fn``.

Example:
        >>> import torch
        >>> io = ModelIO.from_example((torch.ones(2, 3),), {"mask": torch.ones(2, 3)}, None)
        >>> [tuple(t.shape) for t in io.flatten_inputs((torch.zeros(4, 3),), {"mask": torch.zeros(4, 3)})]
        [(4, 3), (4, 3)]
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import TreeSpec, tree_flatten, tree_flatten_with_path, tree_unflatten

@dataclass(frozen=True)
class ModelIO:
    """The traced model's input and output structure."""

    in_spec: TreeSpec
    out_spec: TreeSpec | None
    kwarg_names: tuple[str, ...]

    @classmethod
    def from_example(cls, args: tuple, kwargs: dict, exported: Any | None) -> "ModelIO":
        """The structure of one traced call; ``exported`` (an ``ExportedProgram``) gives the output's.

        Example:
            >>> io = ModelIO.from_example((torch.ones(1),), {}, None)
            >>> io.kwarg_names, io.out_spec is None
            ((), True)
        """
        in_spec = None
        out_spec = None
        call_spec = getattr(exported, "call_spec", None)
        if call_spec is not None:
            in_spec, out_spec = call_spec.in_spec, call_spec.out_spec
        if in_spec is None:  # the same flattening torch.export applies to its inputs
            in_spec = tree_flatten((tuple(args), dict(kwargs)))[1]
        # The keyword order the graph's inputs follow is the spec's, whatever the call's.
        kwarg_spec = in_spec.child(1) if hasattr(in_spec, "child") else in_spec.children_specs[1]
        return cls(in_spec=in_spec, out_spec=out_spec, kwarg_names=tuple(kwarg_spec.context or ()))

    @property
    def num_inputs(self) -> int:
        """How many flat inputs the first stage takes."""
        return self.in_spec.num_leaves

    def flatten_inputs(self, args: tuple, kwargs: dict) -> list[Any]:
        """``(args, kwargs)`` as the first stage's flat inputs, keywords matched by name.

        Example:
            >>> io = ModelIO.from_example((torch.ones(1),), {"a": torch.ones(1), "b": torch.zeros(1)}, None)
            >>> io.flatten_inputs((torch.ones(1),), {"b": torch.zeros(1), "a": torch.ones(1)})[1]
            tensor([1.])
        """
        missing = [k for k in self.kwarg_names if k not in kwargs]
        unknown = sorted(k for k in kwargs if k not in self.kwarg_names)
        if missing or unknown:
            raise ValueError(
                f"the batch's keyword inputs {sorted(kwargs)} differ from the traced ones "
                f"{list(self.kwarg_names)} (missing {missing}, unknown {unknown}); pass the same "
                f"keywords as example_kwargs"
            )
        ordered = {k: kwargs[k] for k in self.kwarg_names}  # the traced order, by name
        flat, spec = tree_flatten((tuple(args), ordered))
        if spec != self.in_spec:
            raise ValueError(
                f"the batch's inputs are structured as {_describe(spec)}, but the model was traced with "
                f"{_describe(self.in_spec)}; pass the same positional and keyword inputs as the example"
            )
        return flat

    def stage_inputs(self, args: tuple, kwargs: dict) -> list[torch.Tensor]:
        """The tensors the first stage takes: :meth:`flatten_inputs` without the non-tensor
        inputs, which torch.export fixes at their traced values.

        Example:
            >>> io = ModelIO.from_example((torch.ones(1),), {"flag": True}, None)
            >>> len(io.stage_inputs((torch.ones(1),), {"flag": True}))
            1
        """
        return [x for x in self.flatten_inputs(args, kwargs) if isinstance(x, torch.Tensor)]

    def input_labels(self, args: tuple, kwargs: dict) -> list[str]:
        """A readable name for each flat input, for error messages: ``args[0]``, ``mask``, ``args[1][0]``.

        Example:
            >>> io = ModelIO.from_example((torch.ones(1),), {"mask": torch.ones(1)}, None)
            >>> io.input_labels((torch.ones(1),), {"mask": torch.ones(1)})
            ['args[0]', 'mask']
        """
        ordered = {k: kwargs[k] for k in self.kwarg_names if k in kwargs}
        labels = []
        for path, _ in tree_flatten_with_path((tuple(args), ordered))[0]:
            head, *rest = path
            first = rest[0] if rest else None
            text = (f"args[{first.idx}]" if head.idx == 0 else str(first.key)) if first is not None else "?"
            labels.append(text + "".join(str(k) for k in rest[1:]))
        return labels

    def unflatten_output(self, output: Any) -> Any:
        """What the last stage returns, as the unsplit model returns it.

        Example:
            >>> ModelIO.from_example((torch.ones(1),), {}, None).unflatten_output(torch.ones(1))
            tensor([1.])
        """
        if self.out_spec is None:
            return output
        leaves = list(output) if isinstance(output, (tuple, list)) else [output]
        if len(leaves) != self.out_spec.num_leaves:
            raise RuntimeError(
                f"the last stage returned {len(leaves)} values, but the model's output has "
                f"{self.out_spec.num_leaves}; this is a bug in autopipe's stage wiring"
            )
        return tree_unflatten(leaves, self.out_spec)


class TracedBatch:
    """What every batch given to a pipeline is checked against: the traced micro-batch.

    Example:
        >>> io = ModelIO.from_example((torch.ones(2, 3),), {}, None)
        >>> batch = TracedBatch(io, ((torch.ones(2, 3),), {}), 4)
        >>> batch.check((torch.ones(8, 3),), {}, None, need_target=False)  # the micro-batches it holds
        4
        >>> batch.check((torch.ones(6, 3),), {}, None, need_target=False)  # a short last batch
        3
        >>> batch.check((torch.ones(5, 3),), {}, None, need_target=False)
        Traceback (most recent call last):
        ...
        ValueError: input args[0] of the batch has shape (5, 3), which does not split into n_microbatches=4 micro-batches shaped like the example (2, 3); pass a batch of shape (8, 3) (or, for a short last batch, fewer whole micro-batches of 2 rows)
        >>> batch.check((torch.ones(8, 5),), {}, None, need_target=False, any_length=True)  # another length
        4
        >>> batch.micro_dims((torch.ones(8, 5),), {}), batch.traced_dims
        ((5,), (3,))
    """

    def __init__(self, io: ModelIO, example: tuple[tuple, dict], n_microbatches: int) -> None:
        self.io = io
        self.example = example
        self.n_microbatches = n_microbatches
        # Flattened as the first stage takes them, and a name for each input.
        self.inputs: list[Any] = io.flatten_inputs(*example)
        self.labels: list[str] = io.input_labels(*example)
        #: The traced micro-batch's dimensions after the first, every tensor input's in turn.
        self.traced_dims: tuple[int, ...] = self.micro_dims(*example)

    def as_traced(self, kwargs: dict) -> dict:
        """``kwargs`` with ``use_cache=True`` read as False where the model was traced with a
        Hugging Face KV cache off (:mod:`autopipe.planning.hf_compat`): it trains without a cache."""
        if kwargs.get("use_cache") is True and self.example[1].get("use_cache") is False:
            return {**kwargs, "use_cache": False}
        return dict(kwargs)

    def stage_inputs(self, args: tuple, kwargs: dict) -> list[torch.Tensor]:
        """The first stage's tensors for a batch (:meth:`ModelIO.stage_inputs`), keywords as traced."""
        return self.io.stage_inputs(tuple(args), self.as_traced(kwargs))

    def micro_dims(self, args: tuple, kwargs: dict) -> tuple[int, ...]:
        """Every tensor input's dimensions after the first (the rows), in the first stage's order."""
        flat = self.io.flatten_inputs(tuple(args), self.as_traced(kwargs))
        return tuple(d for x in flat if isinstance(x, torch.Tensor) for d in x.shape[1:])

    def meta_example(self, dims: tuple[int, ...]) -> tuple[tuple, dict]:
        """One micro-batch on the meta device whose tensor inputs have the dimensions ``dims``
        after the rows (:meth:`micro_dims`), to trace the stages at that shape."""
        rest = iter(dims)
        flat = [torch.empty((x.shape[0], *(next(rest) for _ in x.shape[1:])), dtype=x.dtype, device="meta")
                if isinstance(x, torch.Tensor) and x.dim() else x for x in self.inputs]
        args, kwargs = tree_unflatten(flat, self.io.in_spec)
        return tuple(args), dict(kwargs)

    def check(self, args: tuple, kwargs: dict, target: Any, *, need_target: bool, replicas: int = 1,
              need_inputs: bool = True, any_length: bool = False) -> int:
        """The micro-batches per replica the batch holds (0 when its inputs are not checked).

        Raises ``ValueError`` unless they are shaped like the traced one; with ``any_length``
        the dimensions after the rows may differ (the stages are traced again at them).

        A batch of one replica (``replicas == 1``) may hold fewer than ``n_microbatches``
        whole micro-batches: a short last batch.
        """
        m = self.n_microbatches * replicas
        split = f"n_microbatches={self.n_microbatches} micro-batches" + (
            f" for each of dp={replicas} replicas (the global batch)" if replicas > 1 else "")
        held = self._check_inputs(args, kwargs, m, split, replicas, any_length) if need_inputs else 0
        if need_target:
            # Without the inputs a short last batch's count is not known here: the ranks settle
            # it as they agree to start (StepFailures.agree_to_start).
            self._check_target(target, held or (m if replicas > 1 else 1), split)
        return held // replicas

    def _check_inputs(self, args: tuple, kwargs: dict, m: int, split: str, replicas: int,
                      any_length: bool) -> int:
        if len(args) != len(self.example[0]):
            raise ValueError(f"the batch has {len(args)} positional inputs, but the pipeline was traced with "
                             f"{len(self.example[0])}")
        # Flattened the way the first stage takes them: keywords matched by name (a missing
        # or unknown keyword is named by flatten_inputs).
        given = self.io.flatten_inputs(tuple(args), self.as_traced(kwargs))
        held: set[int] = set()
        for label, x, ex in zip(self.labels, given, self.inputs):
            if not isinstance(ex, torch.Tensor):
                # torch.export bakes a non-tensor input into the graph as the traced value:
                # another value would be silently ignored.
                if x is not ex and x != ex:
                    raise ValueError(f"input {label}={x!r}, but the pipeline was traced with {ex!r}; a "
                                     f"non-tensor input is fixed at tracing, so build the pipeline with this value")
                continue
            if not isinstance(x, torch.Tensor):
                raise ValueError(f"input {label} is a {type(x).__name__}, but the pipeline was traced with a tensor")
            if x.dtype != ex.dtype:
                raise ValueError(f"input {label} has dtype {x.dtype}, but the pipeline was traced with {ex.dtype}; "
                                 f"convert the batch (e.g. x.to({ex.dtype})) or trace with that dtype")
            if ex.dim() == 0:
                continue
            if any_length and x.dim() != ex.dim():
                raise ValueError(f"input {label} of the batch has {x.dim()} dimensions {tuple(x.shape)}, but the "
                                 f"pipeline was traced with {ex.dim()} {tuple(ex.shape)}; the number of dimensions "
                                 "is fixed at tracing (their sizes after the rows may change)")
            # Another length: the sizes after the rows are the batch's own.
            rest = tuple(x.shape[1:]) if any_length else tuple(ex.shape[1:])
            expected = (ex.shape[0] * m, *rest)
            # A short last batch: fewer whole micro-batches (one replica's batch only).
            k = x.shape[0] // ex.shape[0] if x.dim() and ex.shape[0] and replicas == 1 else m
            short = 0 < k < m and tuple(x.shape) == (ex.shape[0] * k, *rest)
            if tuple(x.shape) != expected and not short:
                raise ValueError(
                    f"input {label} of the batch has shape {tuple(x.shape)}"
                    + (f" (a global batch of {x.shape[0] if x.dim() else 0} rows)" if replicas > 1 else "")
                    + f", which does not split into {split} shaped like the example {tuple(ex.shape)}; "
                    f"pass a batch of shape {expected}"
                    + (f" (or, for a short last batch, fewer whole micro-batches of {ex.shape[0]} rows)"
                       if replicas == 1 else "")
                )
            held.add(k if short else m)
        if len(held) > 1:
            raise ValueError(f"the batch's inputs hold different numbers of micro-batches ({sorted(held)}); every "
                             "input must have the same number of rows")
        return held.pop() if held else m

    @staticmethod
    def _check_target(target: Any, m: int, split: str) -> None:
        if target is None:
            raise ValueError("target=None: pass target=... for loss_fn(output, target)")
        for t in tree_flatten(target)[0]:
            if not isinstance(t, torch.Tensor):
                raise ValueError(
                    f"target holds a {type(t).__name__}, but it is split into micro-batches along its first "
                    f"dimension and must be a tensor (or tensors): pass torch.as_tensor(target)")
            if t.dim() == 0 or t.shape[0] % m:
                raise ValueError(
                    f"target has shape {tuple(t.shape)}, whose first dimension does not split "
                    f"into {split} of equal size"
                )


def _describe(spec: TreeSpec) -> str:
    text = str(spec).replace("\n", " ")
    return " ".join(text.split())


@contextlib.contextmanager
def capture_export(before_split: Callable[[Any], None] | None = None) -> Iterator[list]:
    """Keep the ``ExportedProgram`` that ``torch.distributed.pipelining.pipeline()`` traces.

    Example:
        >>> with capture_export() as captured:  # doctest: +SKIP
        ...     pipe = pipeline(model, (x,), split_spec=spec)
        >>> captured[0].call_spec.out_spec  # doctest: +SKIP
    """
    captured: list = []
    try:
        from torch.distributed.pipelining._IR import Pipe
    except ImportError:  # pragma: no cover - torch without pipelining
        yield captured
        return
    original = Pipe.__dict__.get("_trace_with_export")
    if not isinstance(original, staticmethod):
        yield captured
        return

    def traced(*args: Any, **kwargs: Any) -> Any:
        exported = original.__func__(*args, **kwargs)
        captured.append(exported)
        if before_split is not None:
            before_split(exported)
        return exported

    Pipe._trace_with_export = staticmethod(traced)
    try:
        yield captured
    finally:
        Pipe._trace_with_export = original
