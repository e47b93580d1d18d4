"""A stage that fails in the middle of a step plays the step through, so no rank waits for it.

Example:
        >>> import torch, torch.nn as nn
        >>> failures = StepFailures()
        >>> loss = PlayThroughLoss(lambda out, y: (out - y).pow(2).mean(), failures)
        >>> out = torch.ones(2, 3, requires_grad=True)
        >>> failures.start(); failures.record(ValueError("bad row"), "stage 1's forward, micro-batch 0")
        >>> loss(out, torch.zeros(2, 3)).item()  # the rank failed: a zero loss, still in the graph
        0.0
        >>> failures.describe()
        "ValueError: bad row (in stage 1's forward, micro-batch 0)"
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..errors import PipelineStepError

# An error's text as the other ranks receive it: one line of at most this many characters.
_MAX_TEXT = 600


class StepFailures:
    """What went wrong on this rank during the running step, if anything.

    Example:
        >>> failures = StepFailures()
        >>> failures.start(); failures.failed
        False
        >>> failures.record(RuntimeError("out of memory"), "stage 0's forward, micro-batch 2")
        >>> failures.failed, failures.describe()
        (True, "RuntimeError: out of memory (in stage 0's forward, micro-batch 2)")
    """

    def __init__(self) -> None:
        self.active = False
        self.error: BaseException | None = None
        self.where = ""
        #: What is running, for messages ("step() call 3").
        self.call = ""
        #: True once every rank has learned the step's outcome (the closing collective
        #: returned): an error after that leaves no rank waiting.
        self.settled = False
        #: Why the pipeline cannot run again, once an error could not be played through.
        self.broken: str | None = None
        self._forwards: dict[int, int] = {}  # stage index -> forwards run this step
        self._calls: dict[str, int] = {}  # "step" / "evaluate" / "forward" -> calls so far
        self._opened = 0  # calls of any kind the ranks agreed to start

    @property
    def failed(self) -> bool:
        """True once an error was recorded in this step."""
        return self.error is not None

    def start(self, call: str = "") -> None:
        """A step begins (``call`` names it in messages): nothing failed yet."""
        self.active = True
        self.error = None
        self.where = ""
        self.call = call
        self.settled = False
        self._forwards.clear()

    def stop(self) -> None:
        """The step is over: wrapped forwards raise their errors again."""
        self.active = False

    def next_microbatch(self, stage_index: int) -> int:
        """The micro-batch a stage's forward is about to run (torch runs them in order)."""
        k = self._forwards.get(stage_index, 0)
        self._forwards[stage_index] = k + 1
        return k

    def record(self, error: BaseException, where: str) -> None:
        """Keep the step's first error and where it happened; later ones follow from it."""
        if self.error is None:
            self.error = error
            self.where = where

    def describe(self) -> str:
        """The recorded error in one line, as the other ranks are told it ("" when none)."""
        if self.error is None:
            return ""
        text = one_line(self.error)
        return f"{text} (in {self.where})" if self.where else text

    @contextmanager
    def guard(self, call: str, rank: int) -> Iterator[None]:
        """Run one step, evaluation or forward call so that a failure cannot strand the other ranks.

        Example:
            >>> failures = StepFailures()
            >>> with failures.guard("step", rank=0):
            ...     failures.active
            True
        """
        n = self._calls[call] = self._calls.get(call, 0) + 1
        self.start(f"{call}() call {n}")
        try:
            yield
        except BaseException as e:
            if not self.settled:
                self.broken = (
                    f"this pipeline cannot run again: {call}() call {n} raised {one_line(e)} on rank "
                    f"{rank} outside a stage's forward and the loss (in a backward, or in torch's schedule "
                    f"or communication), where it cannot be played through; this rank left the schedule while "
                    f"the other ranks may still wait for it (until it exits or timeout_s passes). Restart the "
                    f"job, or build a new Pipeline on every rank"
                )
            raise
        finally:
            self.stop()

    def agree_to_start(self, call: str, error: BaseException | None, *, rank: int, world_size: int,
                       device: torch.device, microbatches: int = 0, target_rows: int = 0,
                       dims: Sequence[int] = (), pipelines: Sequence[Sequence[int]] | None = None
                       ) -> tuple[int, tuple[int, ...]]:
        """The opening collective of a call: every rank starts the same call, and its inputs passed their checks.

        ``microbatches``: how many micro-batches this rank's inputs hold (0: it was given
        none); ``target_rows``: the rows of the target it was given (0: none); ``dims``: its
        inputs' dimensions after the rows (``TracedBatch.micro_dims``; zeros without inputs,
        as long on every rank); ``pipelines``: the ranks of each pipeline replica (default: one
        pipeline of every rank), whose ranks run one shape while other replicas may run
        another. Returns the micro-batch count and the dimensions this rank's pipeline then
        runs with, those of its ranks given inputs.
        """
        self._opened += 1
        rows = torch.zeros(world_size, 5 + len(dims), dtype=torch.float64, device=device)
        rows[rank] = torch.tensor([self._opened, _CALL_KINDS.index(call), float(error is not None), microbatches,
                                   target_rows, *dims], dtype=torch.float64)
        dist.all_reduce(rows)
        table = rows.tolist()
        calls = [(int(n), _CALL_KINDS[int(kind)]) for n, kind, *_ in table]
        if len(set(calls)) > 1:
            at = ", ".join(f"rank {r} at its call {n} ({kind}())" for r, (n, kind) in enumerate(calls))
            self.broken = (f"the ranks are out of step: {at}. Every rank must make the same calls of the pipeline "
                           f"in the same order (a loop that catches an error on one rank must skip the same call "
                           f"on every rank); this pipeline cannot run again: restart the job, or build a new "
                           f"Pipeline on every rank")
            raise RuntimeError(self.broken) from error
        failed = [r for r, row in enumerate(table) if row[2] > 0]
        counts = {int(row[3]) for row in table if row[3] > 0}
        pipelines = pipelines or [range(world_size)]
        shapes = [{tuple(int(d) for d in table[r][5:]) for r in ranks if table[r][3] > 0} for ranks in pipelines]
        mine = next(i for i, ranks in enumerate(pipelines) if rank in ranks)
        if not failed:  # every rank sees the same counts, so every rank raises the same error
            if len(counts) > 1:
                raise ValueError(f"the ranks' batches hold different numbers of micro-batches ({sorted(counts)}): "
                                 "every rank given inputs must be given the same number of rows")
            differ = next((sorted(found) for found in shapes if len(found) > 1), None)
            if differ:
                raise ValueError(f"the ranks' batches have different sizes after the rows ({differ}): every rank "
                                 "of a pipeline given inputs must be given the same sequence length")
            k = counts.pop() if counts else 0
            uneven = [(r, int(row[4])) for r, row in enumerate(table) if k and row[4] % k]
            if uneven:
                raise ValueError(f"the target given to rank {uneven[0][0]} has {uneven[0][1]} rows, which do not "
                                 f"split into the {k} micro-batches the inputs hold")
            return k, shapes[mine].pop() if shapes[mine] else tuple(dims)
        failures, listed = _gather_failures(one_line(error) if error is not None else "", failed, world_size)
        if error is not None:
            raise error
        raise PipelineStepError(
            f"{call}() call {self._calls.get(call, 0) + 1} was refused on rank {', '.join(map(str, failed))} before "
            f"it started: {listed}. No rank ran it; the pipeline is usable", failures=failures)

    def raise_if_a_rank_failed(self, flags: torch.Tensor, world_size: int) -> None:
        """Raise :class:`~autopipe.errors.PipelineStepError` on every rank if a rank's flag is set.

        Example:
            >>> StepFailures().raise_if_a_rank_failed(torch.zeros(2), world_size=2)  # no rank failed
        """
        self.settled = True
        failed = [r for r, flag in enumerate(flags.tolist()) if flag > 0]
        if not failed:
            return
        failures, listed = _gather_failures(self.describe(), failed, world_size)
        gradients = "; zero the gradients before it, as this step's are partial" if self.call.startswith(
            "step") else ""
        raise PipelineStepError(
            f"{self.call} failed on rank {', '.join(map(str, failed))}: {listed}. The failing stage "
            f"handed zeros on for the rest of the step, so every rank finished it and raises this error "
            f"(stages after a failing one computed on those zeros). The pipeline is usable: the next call runs "
            f"normally{gradients}",
            failures=failures,
        ) from self.error


def _gather_failures(mine: str, failed: list[int], world_size: int) -> tuple[dict[int, str], str]:
    """Every failing rank's error text (collective: one all-gather), and them in one line."""
    texts: list[Any] = [None] * world_size
    dist.all_gather_object(texts, mine)
    failures = {r: texts[r] for r in failed}
    return failures, "; ".join(f"rank {r}: {text}" for r, text in failures.items())


#: The calls :meth:`StepFailures.agree_to_start` opens; the index is how a rank names its call.
_CALL_KINDS = ("step", "evaluate", "forward")

#: The dtypes a training loss may have; the index is how the last stage tells the others.
LOSS_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def share_loss(losses: list[torch.Tensor], failures: StepFailures, *, rank: int, world_size: int,
               has_last_stage: bool, device: torch.device) -> torch.Tensor:
    """The step's closing collective: the sum of the micro-batch losses, and whether any rank failed."""
    message = torch.zeros(2 + world_size, dtype=torch.float64, device=device)
    message[2 + rank] = float(failures.failed)
    if has_last_stage and losses:
        dtype = losses[0].dtype
        if dtype in LOSS_DTYPES:
            total = torch.stack([l.detach().to(torch.promote_types(dtype, torch.float32)) for l in losses]).sum()
            message[0] = total.to(device=device, dtype=torch.float64)
            message[1] = LOSS_DTYPES.index(dtype)
        else:  # every rank raises below, none waits for a loss that will not come
            message[1] = -1
    dist.all_reduce(message)
    failures.raise_if_a_rank_failed(message[2:], world_size)
    code = int(message[1].item())
    if code < 0:
        raise TypeError(f"loss_fn returned a loss that is not floating point; a training loss is one "
                        f"of {list(LOSS_DTYPES)}")
    return message[0].to(LOSS_DTYPES[code])


def agree_on_failures(failures: StepFailures, *, rank: int, world_size: int, device: torch.device) -> None:
    """Tell every rank whether any rank failed in the running call; raise on every rank if one did."""
    flags = torch.zeros(world_size, dtype=torch.float64, device=device)
    flags[rank] = float(failures.failed)
    dist.all_reduce(flags)
    failures.raise_if_a_rank_failed(flags, world_size)


def one_line(error: BaseException) -> str:
    """``"Type: message"`` on one line, shortened to a few hundred characters, with the root cause.

    torch wraps an error inside a stage in its own ("Failed to run stage backward: ...");
    the error that started it is named after it.

    Example:
        >>> one_line(ValueError("two\\nlines"))
        'ValueError: two lines'
        >>> try:
        ...     try:
        ...         raise KeyError("w")
        ...     except KeyError as e:
        ...         raise RuntimeError("stage failed") from e
        ... except RuntimeError as e:
        ...     one_line(e)
        "RuntimeError: stage failed (caused by KeyError: 'w')"
    """
    def text(e: BaseException) -> str:
        t = " ".join(f"{type(e).__name__}: {e}".split())
        return t if len(t) <= _MAX_TEXT else t[: _MAX_TEXT - 3] + "..."

    root, seen = error, {id(error)}
    while root.__cause__ is not None and id(root.__cause__) not in seen:  # a cycle ends the walk
        root = root.__cause__
        seen.add(id(root))
    return text(error) if root is error else f"{text(error)} (caused by {text(root)})"


class _ZerosInGraph(torch.autograd.Function):
    """Zeros of a given shape that depend on ``anchors`` in the autograd graph (zero gradient)."""

    @staticmethod
    def forward(ctx, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,  # noqa: D102
                *anchors: torch.Tensor) -> torch.Tensor:
        # A DTensor anchor (tensor-parallel logits) takes a DTensor gradient of its own placements.
        ctx.anchor_meta = [(a.to_local().shape, a.dtype, a.device, (a.device_mesh, a.placements))
                           if isinstance(a, DTensor) else (a.shape, a.dtype, a.device, None) for a in anchors]
        return torch.zeros(shape, dtype=dtype, device=device)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: D102
        zeros = []
        for shape, dtype, device, placed in ctx.anchor_meta:
            zero = torch.zeros(shape, dtype=dtype, device=device)
            zeros.append(DTensor.from_local(zero, *placed, run_check=False) if placed else zero)
        return (None, None, None, *zeros)


def _zeros_like_value(value: Any, anchors: list[torch.Tensor], device: torch.device) -> Any:
    """Zeros standing in for one traced output value (a fake tensor; other values as they are)."""
    if not isinstance(value, torch.Tensor):
        return value
    shape, dtype = tuple(value.shape), value.dtype
    if anchors and (dtype.is_floating_point or dtype.is_complex):
        return _ZerosInGraph.apply(shape, dtype, device, *anchors)
    return torch.zeros(shape, dtype=dtype, device=device)


def _graph_anchors(tensors: list[Any]) -> list[torch.Tensor]:
    """What zeros must hang off in the autograd graph; a fresh leaf when no input needs a gradient."""
    if not torch.is_grad_enabled():
        return []
    anchors = [t for t in tensors if isinstance(t, torch.Tensor) and t.requires_grad]
    return anchors or [torch.zeros((), requires_grad=True)]


def play_through_forward(module: nn.Module, failures: StepFailures, stage_index: int,
                         device: torch.device) -> bool:
    """Make ``module``'s forward return zeros shaped as its traced outputs instead of raising, while a step runs.

    Example:
        >>> import torch
        >>> from torch.distributed.pipelining import pipeline
        >>> model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
        >>> stage = pipeline(model, (torch.zeros(2, 3),)).get_stage_module(0)
        >>> failures = StepFailures()
        >>> play_through_forward(stage, failures, 0, torch.device("cpu"))
        True
        >>> stage.get_submodule("0").register_forward_pre_hook(lambda m, a: 1 / 0)  # doctest: +ELLIPSIS
        <...RemovableHandle object at ...>
        >>> failures.start(); out = stage(torch.ones(2, 3)); failures.stop()
        >>> out.shape, out.abs().sum().item(), failures.describe()
        (torch.Size([2, 2]), 0.0, "ZeroDivisionError: division by zero (in stage 0's forward, micro-batch 0)")
    """
    if getattr(module, "_autopipe_plays_through", False):
        return True
    graph = getattr(module, "graph", None)
    if graph is None:
        return False
    output = next(n for n in graph.nodes if n.op == "output")
    values, spec = tree_flatten(output.args[0])
    # The traced value of each output (a fake tensor); a constant output stays as it is.
    template = [v.meta.get("val") if isinstance(v, torch.fx.Node) else v for v in values]
    if any(isinstance(v, torch.fx.Node) and not isinstance(v.meta.get("val"), torch.Tensor) for v in values):
        return False  # an output traced without a tensor value: no shape to make zeros of
    inner = module.forward

    def zeros_instead(args: tuple, kwargs: dict) -> Any:
        anchors = _graph_anchors(tree_flatten((args, kwargs))[0])
        return tree_unflatten([_zeros_like_value(v, anchors, device) for v in template], spec)

    def forward(*args: Any, **kwargs: Any) -> Any:
        if not failures.active:
            return inner(*args, **kwargs)
        microbatch = failures.next_microbatch(stage_index)
        if failures.failed:  # an earlier micro-batch (or the loss) failed: no use computing
            return zeros_instead(args, kwargs)
        try:
            return inner(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - recorded, raised on every rank at the step's end
            failures.record(e, f"stage {stage_index}'s forward, micro-batch {microbatch}")
            return zeros_instead(args, kwargs)

    module.forward = forward  # an instance attribute wins over the class's forward
    module._autopipe_plays_through = True
    return True


class PlayThroughLoss:
    """A loss function that, while a step runs, returns a zero loss instead of raising.

    Example:
        >>> failures = StepFailures()
        >>> loss = PlayThroughLoss(lambda out, y: out.sum() / y, failures)
        >>> out = torch.ones(2, requires_grad=True)
        >>> loss(out, 2.0).item()
        1.0
        >>> failures.start(); loss(out, "two").item(), failures.describe()
        (0.0, "TypeError: unsupported operand type(s) for /: 'Tensor' and 'str' (in loss_fn)")
    """

    def __init__(self, loss_fn: Callable[..., torch.Tensor], failures: StepFailures) -> None:
        self.loss_fn = loss_fn
        self.failures = failures

    def __call__(self, output: Any, target: Any, **kwargs: Any) -> torch.Tensor:
        if not self.failures.active:
            return _scalar_loss(self.loss_fn(output, target, **kwargs))
        if not self.failures.failed:
            try:
                return _scalar_loss(self.loss_fn(output, target, **kwargs))
            except Exception as e:  # noqa: BLE001 - recorded, raised on every rank at the step's end
                self.failures.record(e, "loss_fn")
        floats = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.is_floating_point()]
        device = floats[0].device if floats else torch.device("cpu")
        return _ZerosInGraph.apply((), torch.float32, device, *_graph_anchors(floats))


def _scalar_loss(loss: Any) -> torch.Tensor:
    """``loss`` if it is a tensor of one element; else a TypeError saying what a loss must be."""
    if isinstance(loss, torch.Tensor) and loss.numel() == 1:
        return loss
    what = (f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor)
            else f"a {type(loss).__name__}")
    raise TypeError(f"loss_fn returned {what}; it must return the micro-batch's loss as a tensor of one element "
                    f"(reduce it, e.g. with .mean(), and compute it from the output with torch operations)")
