"""Time a module's forward and backward passes on a device: alone, or in rounds as a pipeline runs them.

Example:
    >>> from autopipe.machine.timing import Timer
    >>> layer = torch.nn.Linear(4, 4)
    >>> fwd_s, bwd_s = time_alone(layer, lambda: [torch.randn(2, 4)], list(layer.parameters()),
    ...                           Timer(torch.device("cpu")), warmup=0, repeats=1)
    >>> fwd_s >= 0 and bwd_s >= 0
    True
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from .timing import TimerLike, per_run_s

def storage_key(t: torch.Tensor) -> int:
    """What identifies the memory ``t`` lives in: its storage's data pointer, or on the meta device its storage.

    Example:
        >>> a = torch.empty(3, 4, device="meta")
        >>> storage_key(a) == storage_key(a.view(12)), storage_key(a) == storage_key(torch.empty(3, device="meta"))
        (True, False)
        >>> q, k = torch.empty(2, 8).split(4, dim=1)
        >>> storage_key(q) == storage_key(k)
        True
    """
    if t.layout != torch.strided:
        return id(t)
    if t.device.type == "meta":
        return t.untyped_storage()._cdata  # the StorageImpl's address: shared by views, unique per storage
    return t.untyped_storage().data_ptr()


class SavedBytes:
    """Counts the bytes autograd saves for backward: each storage once, parameters skipped.

    Example:
        >>> counter = SavedBytes(set())
        >>> x = torch.randn(4, 8, requires_grad=True)
        >>> with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t):
        ...     y = (x * x).sum()
        >>> counter.total  # x, saved once for the product's backward
        128
    """

    def __init__(self, param_ptrs: set[int]) -> None:
        self.param_ptrs = param_ptrs
        self.saved: dict[int, int] = {}

    @property
    def total(self) -> int:
        """Bytes of every storage saved, parameters excluded."""
        return sum(self.saved.values())

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        key = storage_key(t)
        if key not in self.param_ptrs:
            nbytes = (t.untyped_storage().nbytes() if t.layout == torch.strided
                      else t.numel() * t.element_size())
            self.saved[key] = max(self.saved.get(key, 0), nbytes)
        return t


def _as_tuple(out: Any) -> tuple[Any, ...]:
    """A module's output as a tuple (one output becomes a tuple of one)."""
    return out if isinstance(out, tuple) else (out,)


def forward_backward(
    module: torch.nn.Module, inputs: list[Any], trainable: list[torch.Tensor], timer: TimerLike,
    counter: SavedBytes | None = None,
) -> tuple[float, float, tuple[Any, ...]]:
    """One timed forward and one timed backward of a segment: (fwd_s, bwd_s, outputs).

    Example:
        >>> from autopipe.machine.timing import Timer
        >>> layer = torch.fx.symbolic_trace(torch.nn.Linear(4, 2))
        >>> fwd_s, bwd_s, out = forward_backward(layer, [torch.randn(3, 4)], list(layer.parameters()),
        ...                                      Timer(torch.device("cpu")))
        >>> out[0].shape
        torch.Size([3, 2])
    """
    hooks = (torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t)
             if counter is not None else nullcontext())
    with hooks:
        fwd_s, out = timer.time(lambda: _as_tuple(module.forward(*inputs)))
    bwd_s, _ = timed_backward(inputs, out, trainable, timer)
    return fwd_s, bwd_s, out


def timed_backward(
    inputs: list[Any], out: Any, trainable: list[torch.Tensor], timer: TimerLike,
) -> tuple[float, tuple[torch.Tensor | None, ...]]:
    """Time one backward of ``out`` (ones as output gradients) with respect to the inputs that
    carry a gradient and ``trainable``: (seconds, the weight gradients, last ``len(trainable)``).

    Example:
        >>> from autopipe.machine.timing import Timer
        >>> w = torch.ones(2, requires_grad=True)
        >>> seconds, (grad_w,) = timed_backward([], w * 3.0, [w], Timer(torch.device("cpu")))
        >>> grad_w.tolist()
        [3.0, 3.0]
    """
    outs = [o for o in tree_leaves(out) if isinstance(o, torch.Tensor) and o.requires_grad]
    wrt = [v for v in inputs if isinstance(v, torch.Tensor) and v.requires_grad] + trainable
    if not outs or not wrt:
        return 0.0, ()
    grads = [torch.ones_like(o) for o in outs]
    seconds, got = timer.time(lambda: torch.autograd.grad(outs, wrt, grads, allow_unused=True))
    return seconds, (got[len(got) - len(trainable):] if trainable else ())


def time_alone(
    module: torch.nn.Module, make_inputs: Callable[[], list[Any]], trainable: list[torch.Tensor], timer: TimerLike,
    warmup: int, repeats: int,
) -> tuple[float, float]:
    """Forward and backward seconds (:func:`~autopipe.machine.timing.per_run_s`) of one module run
    again and again on its own.

    Example:
        >>> from autopipe.machine.timing import Timer
        >>> layer = torch.nn.Linear(4, 4)
        >>> fwd_s, bwd_s = time_alone(layer, lambda: [torch.randn(2, 4)], list(layer.parameters()),
        ...                           Timer(torch.device("cpu")), warmup=0, repeats=2)
        >>> fwd_s >= 0 and bwd_s >= 0
        True
    """
    fwd_times: list[float] = []
    bwd_times: list[float] = []
    for i in range(warmup + repeats):
        f, b, _ = forward_backward(module, make_inputs(), trainable, timer)
        if i >= warmup:
            fwd_times.append(f)
            bwd_times.append(b)
    return per_run_s(fwd_times), per_run_s(bwd_times)


def accumulate(accumulated: list[torch.Tensor], grads: Sequence[torch.Tensor | None]) -> None:
    """Add ``grads`` into ``accumulated`` in place, as autograd's AccumulateGrad does into ``.grad``.

    Example:
        >>> acc = [torch.zeros(2), torch.ones(2)]
        >>> accumulate(acc, [torch.full((2,), 3.0), None])
        >>> [a.tolist() for a in acc]
        [[3.0, 3.0], [1.0, 1.0]]
    """
    for acc, g in zip(accumulated, grads):
        if g is not None:
            acc.add_(g)


#: One module's timed work in rounds: ``(module, make_inputs, trainable)``.
RoundEntry = tuple[torch.nn.Module, Callable[[], list[Any]], list[torch.Tensor]]


def _backward_and_accumulate(
    inputs: list[Any], out: Any, trainable: list[torch.Tensor], accumulated: list[torch.Tensor], timer: TimerLike,
) -> tuple[float, float]:
    """Time one backward (:func:`timed_backward`), then the add of its weight gradients."""
    b, weight_grads = timed_backward(inputs, out, trainable, timer)
    a = timer.time(lambda: accumulate(accumulated, weight_grads))[0] if weight_grads else 0.0
    return b, a


def time_in_rounds(
    segments: list[RoundEntry], timer: TimerLike, warmup: int, repeats: int, flush: Callable[[], None] | None = None,
    whole: RoundEntry | None = None, fit: bool = False, *, backward_start_s: float | None = None,
) -> tuple[list[tuple[float, float, float]], WholePass | None]:
    """Forward, backward and accumulation seconds of each segment, timed in rounds.

    Example:
        >>> from autopipe.machine.timing import Timer
        >>> layers = [torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)]
        >>> segments = [(m, lambda: [torch.randn(2, 4)], list(m.parameters())) for m in layers]
        >>> times, whole = time_in_rounds(segments, Timer(torch.device("cpu")), warmup=0, repeats=2)
        >>> len(times), whole is None
        (2, True)
    """
    if backward_start_s is not None and (isinstance(backward_start_s, bool)
                                         or not isinstance(backward_start_s, (int, float))
                                         or not 0 <= backward_start_s < math.inf):
        raise ValueError(f"backward_start_s={backward_start_s!r} must be a finite number of seconds >= 0, "
                         "or None to measure it")
    entries = segments + ([whole] if whole is not None else [])
    fwd_times: list[list[float]] = [[] for _ in entries]
    bwd_times: list[list[float]] = [[] for _ in entries]  # as timed, each with its own start
    acc_times: list[list[float]] = [[] for _ in entries]
    accumulated = [[torch.zeros_like(p) for p in trainable] for _, _, trainable in entries]
    call_s = measure_backward_start_s(timer) if backward_start_s is None else float(backward_start_s)
    n = len(segments)
    passes = [list(range(n))] + ([[n]] if whole is not None else [])
    for i in range(warmup + repeats):
        for group in passes:  # the segments one by one, then the whole graph as one
            runs: dict[int, tuple[list[Any], Any, float]] = {}
            if flush is not None:
                flush()
            for k in group:
                module, make_inputs, _ = entries[k]
                inputs = make_inputs()
                f, out = timer.time(lambda m=module, a=inputs: _as_tuple(m.forward(*a)))
                runs[k] = (inputs, out, f)
            if flush is not None:
                flush()
            for k in reversed(group):
                inputs, out, f = runs.pop(k)  # dropped after its backward, as training frees them
                b, a = _backward_and_accumulate(inputs, out, entries[k][2], accumulated[k], timer)
                del inputs, out
                if i >= warmup:
                    fwd_times[k].append(f)
                    bwd_times[k].append(b)
                    acc_times[k].append(a)
    means = [(per_run_s(f), per_run_s(b), per_run_s(a)) for f, b, a in zip(fwd_times, bwd_times, acc_times)]
    whole_pass = None
    if whole is not None:
        def round_ratio(samples: list[list[float]]) -> float:
            # whole / segments within each round, then the median over the rounds: a round
            # that a disturbance slowed down in one part only (seen on a GPU host) moves it little.
            ratios = [w / s for w, s in zip(samples[n], map(sum, zip(*samples[:n]))) if s > 0]
            return statistics.median(ratios) if ratios else 1.0

        totals = [sum(f[r] + b[r] for f, b in zip(fwd_times[:n], bwd_times[:n])) for r in range(repeats)]
        middle = statistics.median(totals) if totals else 0.0
        whole_pass = WholePass(*means[n], *(sum(t[j] for t in means[:n]) for j in range(3)),
                               scales=(round_ratio(fwd_times), round_ratio(bwd_times), round_ratio(acc_times)),
                               fitted=fit,
                               round_spread=(max(totals) - min(totals)) / middle if middle > 0 else 0.0)
    if fit and whole_pass is not None:
        # The whole graph pays every fixed cost once, as a stage does: no start to take off.
        sf, sb, sa = whole_pass.scales
        return [(f * sf, b * sb, a * sa) for f, b, a in means[:n]], whole_pass
    # Each segment here starts a backward of its own; a stage starts one for all its
    # segments, so the fixed cost of starting one is not the segment's.
    return [(f, per_run_s([max(0.0, x - call_s) if x else 0.0 for x in bwd_times[k]]), a)
            for k, (f, _, a) in enumerate(means[:n])], whole_pass


def time_accumulation(trainable: list[torch.Tensor], timer: TimerLike, warmup: int, repeats: int) -> float:
    """Seconds (:func:`~autopipe.machine.timing.per_run_s`) to add one gradient into an accumulated
    one for each of ``trainable``.

    Example:
        >>> from autopipe.machine.timing import Timer
        >>> time_accumulation([torch.zeros(8)], Timer(torch.device("cpu")), warmup=0, repeats=2) >= 0
        True
        >>> time_accumulation([], Timer(torch.device("cpu")), warmup=0, repeats=2)
        0.0
    """
    if not trainable:
        return 0.0
    accumulated = [torch.zeros_like(p) for p in trainable]
    grads = [torch.ones_like(p) for p in trainable]
    times = []
    for i in range(warmup + repeats):
        t, _ = timer.time(lambda: accumulate(accumulated, grads))
        if i >= warmup:
            times.append(t)
    return per_run_s(times)


def measure_backward_start_s(timer: TimerLike, repeats: int = 21) -> float:
    """Median seconds of ``torch.autograd.grad`` through one tiny operation: the cost of starting a backward.

    Example:
        >>> from autopipe.machine.timing import Timer
        >>> measure_backward_start_s(Timer(torch.device("cpu")), repeats=3) >= 0
        True
    """
    x = torch.ones(1, device=timer.device, requires_grad=True)
    times = []
    for _ in range(repeats):
        y = x * 2.0
        times.append(timer.time(lambda: torch.autograd.grad(y, x, torch.ones_like(y)))[0])
    return statistics.median(times)


@dataclass
class WholePass:
    """The model's whole graph timed as one, beside the segments timed one by one.

    Example:
        >>> w = WholePass(fwd_s=1.0, bwd_s=2.0, accum_s=0.5, segments_fwd_s=2.0, segments_bwd_s=2.0,
        ...               segments_accum_s=1.0, scales=(0.5, 1.0, 0.5), fitted=False)
        >>> w.fitted
        False
    """

    fwd_s: float
    bwd_s: float
    accum_s: float
    segments_fwd_s: float
    segments_bwd_s: float
    segments_accum_s: float
    scales: tuple[float, float, float]
    fitted: bool
    # How much the rounds disagreed: (slowest - fastest) / median of each round's summed segment
    # times (forward + backward). On a busy host it is large, and the split can change between runs.
    round_spread: float = 0.0
