"""Measure what every segment costs: forward and backward time, parameters, activations.

Third step of the data flow. :func:`profile_segments` runs each segment of a
:class:`~autopipe.planning.trace.TracedModel` on its own, on the target device, with the real
tensors the previous segments produce for the example micro-batch:

* forward seconds and backward seconds are *measured* (warm-up, then the mean of
  ``repeats`` runs, see :func:`per_run_s`; CUDA timings use events after a
  synchronisation), never guessed as 2x;
* gradient accumulation seconds (``accum_s``) are measured too: adding a backward's weight
  gradients into buffers of the segment's own, which a pipeline stage does into ``.grad``
  for every micro-batch after the first (the estimated sources below leave it at 0);
* activation bytes are the tensors autograd saves for backward (counted with
  ``torch.autograd.graph.saved_tensors_hooks``), parameters excluded;
* FLOPs come from ``torch.utils.flop_counter.FlopCounterMode`` on one run.

Other cost sources, for comparison or when measuring is not wanted:

* ``cost="flops"``: time = counted FLOPs / the device's measured matmul throughput;
* ``cost="params"``: the model's total FLOP time shared out in proportion to each segment's
  parameter bytes (what "balance by parameter count" assumes).

The model's parameters, buffers, gradients and RNG state are the same afterwards as before:
backward uses ``torch.autograd.grad`` (nothing accumulates into ``.grad``), buffers mutated by
the forward (BatchNorm statistics) are restored, and so is the RNG state.

Example:
    >>> from autopipe.models import seed_transformer
    >>> from autopipe.planning.trace import trace
    >>> from autopipe.planning.profile import profile_segments
    >>> model, args = seed_transformer(vocab_size=100, num_layers=1, seq_len=8)
    >>> costs = profile_segments(trace(model, args), repeats=1, warmup=0, progress=False)
    >>> all(c.fwd_s > 0 for c in costs)
    True
"""

from __future__ import annotations

import copy
import statistics
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten, tree_leaves, tree_map, tree_unflatten
from torch.utils.flop_counter import FlopCounterMode

from . import hf_compat
from .._progress import progress_iter
from .costgraph import SegmentCost, requires_grad_map, tensor_bytes
from .inplace import clone_inputs_written_in_place
from .trace import TracedModel

__all__ = ["COST_SOURCES", "profile_segments", "profile_loss", "LossCost", "measure_device_flops", "per_run_s",
           "resolve_device", "Timer", "CacheFlusher", "last_level_cache_bytes", "copy_to_device",
           "SegmentCosts", "WholePass"]

#: Accepted values of the ``cost`` argument.
COST_SOURCES = ("measured", "flops", "params")


def resolve_device(device: str | torch.device | None) -> torch.device:
    """The device to profile on: the given one, else CUDA when present, else CPU.

    A CUDA device without an index (``"cuda"``) gets the current one (``cuda:0``), as
    ``tensor.device`` always carries it: ``torch.device("cuda") != torch.device("cuda:0")``,
    and the profiler compares the two to decide whether the model already lives there.

    Raises:
        ValueError: the device string is not one torch understands, or CUDA is asked for
            but not available.

    Example:
        >>> resolve_device("cpu")
        device(type='cpu')
    """
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device={device!r} is not a torch device; use 'cpu', 'cuda' or 'cuda:N'") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} but CUDA is not available here; use device='cpu'")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def check_flush_cache(flush_cache: Any) -> None:
    """Raise ``ValueError`` unless ``flush_cache`` is True or False (every entry point that profiles checks it first)."""
    if not isinstance(flush_cache, bool):
        raise ValueError(f"flush_cache={flush_cache!r} must be True or False")


def check_runs(warmup: Any, repeats: Any) -> None:
    """Raise ``ValueError`` unless ``warmup`` is an integer >= 0 and ``repeats`` one >= 1 (booleans refused)."""
    for name, value, least in (("warmup", warmup, 0), ("repeats", repeats, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"{name}={value!r} must be an integer >= {least}")


def check_fit_to_whole(fit_to_whole: Any) -> None:
    """Raise ``ValueError`` unless ``fit_to_whole`` is True, False or None (every entry point that profiles checks it first)."""
    if not (fit_to_whole is None or isinstance(fit_to_whole, bool)):
        raise ValueError(f"fit_to_whole={fit_to_whole!r} must be True, False or None (None: on CUDA only)")


def per_run_s(samples: Sequence[float]) -> float:
    """The seconds one run of a piece of work is charged, from its timed runs: their mean.

    Not the median, on purpose. A pipeline step runs each stage's forward and backward once
    per micro-batch, one after another, so its length is a *sum* of many such runs, and the
    expected sum is the sum of the means. On a quiet GPU the two are the same; on a shared CPU
    the times are skewed to the right (a run now and then is preempted or takes page faults),
    and the median left out what those runs add: on GPT-2's segments the sum of the means was
    1.08-1.10x the sum of the medians, and inside a running 2-rank pipeline the mean forward or
    backward was 1.06-1.14x the median (docs/costs-and-measurement.md section 1).

    Args:
        samples: seconds of each timed run, at least one.

    Raises:
        ValueError: ``samples`` is empty.

    Example:
        >>> round(per_run_s([0.010, 0.010, 0.013]), 6)
        0.011
    """
    values = [float(x) for x in samples]
    if not values:
        raise ValueError("samples=[] is empty; per_run_s needs at least one timed run")
    return statistics.fmean(values)


class Timer:
    """Wall-clock timing that is correct on CPU and CUDA (events after a synchronisation)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def time(self, fn: Callable[[], Any]) -> tuple[float, Any]:
        """Run ``fn`` once; return (seconds, its result)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            result = fn()
            end.record()
            torch.cuda.synchronize(self.device)
            return start.elapsed_time(end) / 1e3, result
        t0 = time.perf_counter()
        result = fn()
        return time.perf_counter() - t0, result


#: Last-level cache size assumed where the device does not say (bytes).
_DEFAULT_LLC_BYTES = 32 << 20


def last_level_cache_bytes(device: torch.device) -> int:
    """The size of ``device``'s largest cache in bytes: the GPU's L2, the CPU's last level.

    Read from ``torch.cuda.get_device_properties`` on CUDA and from
    ``/sys/devices/system/cpu/cpu0/cache`` on a Linux CPU; 32 MiB where neither says.

    Example:
        >>> last_level_cache_bytes(torch.device("cpu")) > 0
        True
    """
    if device.type == "cuda":
        size = int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 0)
        return size if size > 0 else _DEFAULT_LLC_BYTES
    if device.type == "cpu":
        sizes = []
        for entry in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
            try:
                text = (entry / "size").read_text().strip().upper()
            except OSError:
                continue
            scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
            digits = text.rstrip("KMG")
            if digits.isdigit():
                sizes.append(int(digits) * scale)
        if sizes:
            return max(sizes)
    return _DEFAULT_LLC_BYTES


class CacheFlusher:
    """Empties a device's caches between timed runs, by writing a buffer twice their size.

    A pipeline action does not find its stage's weights and inputs in the cache: since the
    stage last ran, other micro-batches and (on a shared host) other stages have been through
    it. Work timed again and again in a loop does find them there, and is measured too fast;
    benchmark tools flush for the same reason (Triton's ``do_bench`` clears the L2 before
    every timed run). The profiler calls this before each pass of a round (the forwards, then
    the backwards), as a stage's action starts cold and then runs its segments back to back.

    Example:
        >>> flush = CacheFlusher(torch.device("cpu"))
        >>> flush()
        >>> flush.nbytes >= 2 * (1 << 20)
        True
    """

    def __init__(self, device: torch.device, nbytes: int | None = None) -> None:
        self.nbytes = int(nbytes) if nbytes is not None else 2 * last_level_cache_bytes(device)
        self._buffer = torch.empty(self.nbytes, dtype=torch.uint8, device=device)
        self._value = 0

    def __call__(self) -> None:
        self._value ^= 1  # a different value each time: every line is written, none skipped
        self._buffer.fill_(self._value)


def measure_device_flops(device: str | torch.device | None = None, *, size: int = 1024, repeats: int = 5) -> float:
    """Measured float32 matmul throughput of ``device`` in FLOP/s (median of ``repeats``).

    Used to turn counted FLOPs into seconds (``cost="flops"``) and to compare devices.

    Example:
        >>> measure_device_flops("cpu", size=256, repeats=2) > 1e6
        True
    """
    dev = resolve_device(device)
    a = torch.randn(size, size, device=dev)
    b = torch.randn(size, size, device=dev)
    timer = Timer(dev)
    timer.time(lambda: a @ b)  # warm-up: kernel selection, thread pool start
    times = [timer.time(lambda: a @ b)[0] for _ in range(repeats)]
    return 2.0 * size**3 / max(statistics.median(times), 1e-12)


# --------------------------------------------------------------------------- segment graphs


@dataclass
class _SegmentModule:
    module: fx.GraphModule
    inputs: list[str]  # graph value names it reads from earlier segments / model inputs
    outputs: list[str]  # graph value names later segments (or the model output) read


def _segment_modules(traced: TracedModel, gm: fx.GraphModule | None = None) -> list[_SegmentModule]:
    """One small GraphModule per segment, over the shared root ``gm`` (default the traced model's
    graph, else a copy of it); parameters are not copied."""
    gm = traced.graph_module if gm is None else gm
    by_name = {n.name: n for n in gm.graph.nodes}
    # Unlifting may rename the model's input placeholders (input -> input_1); they keep their
    # order, so map them back to the exported program's names, which the profiler feeds.
    gm_inputs = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    ep_name = dict(zip(gm_inputs, traced.exported.graph_signature.user_inputs))
    seg_of = {}
    for seg in traced.segments:
        for node in traced.nodes[seg.start:seg.end]:
            seg_of[node.name] = seg.index
    last = len(traced.segments)
    result = []
    for seg in traced.segments:
        graph = fx.Graph()
        env: dict[str, fx.Node] = {}
        inputs: list[str] = []

        def value(n: fx.Node, graph=graph, env=env, inputs=inputs) -> fx.Node:
            if n.name in env:
                return env[n.name]
            if n.op == "get_attr":
                env[n.name] = graph.get_attr(n.target)
            else:  # produced by an earlier segment, or a model input
                env[n.name] = graph.placeholder(n.name)
                inputs.append(ep_name.get(n.name, n.name))
            return env[n.name]

        for ep_node in traced.nodes[seg.start:seg.end]:
            node = by_name[ep_node.name]
            env[node.name] = graph.node_copy(node, lambda a: value(a))
        outputs = []
        for ep_node in traced.nodes[seg.start:seg.end]:
            node = by_name[ep_node.name]
            if any(u.op == "output" or seg_of.get(u.name, last) > seg.index for u in node.users):
                outputs.append(node.name)
        graph.output(tuple(env[o] for o in outputs))
        # A segment is fed leaves that require grad, as a stage is, and autograd refuses an
        # in-place write into one (a cut before ReLU(inplace=True) or ``out += identity``).
        # The stage copies such an input (runtime.pipeline._split), so the segment does too,
        # and its profile includes the copy's time and buffer. The copy is charged even when
        # the segment ends up inside a stage, where none is made: an overestimate of one
        # elementwise copy, rather than cuts left out or a copy the plan does not see.
        clone_inputs_written_in_place(graph)
        result.append(_SegmentModule(fx.GraphModule(gm, graph), inputs, outputs))
    return result


def _retarget(value: Any, dev: torch.device) -> Any:
    """``dev`` in place of a device other than ``dev`` (a ``torch.device`` or its name), else ``value``."""
    if isinstance(value, (torch.device, str)):
        try:
            if torch.device(value) != dev:
                return dev
        except RuntimeError:  # a string that names no device
            pass
    return value


def copy_to_device(module: fx.GraphModule, device: str | torch.device) -> fx.GraphModule:
    """A copy of a traced (segment) module on ``device``, with the devices its graph names moved too.

    ``.to(device)`` moves parameters and buffers only. An exported graph also names devices
    itself: a tensor the model creates in ``forward`` (GPT-2's position ids,
    ``torch.arange(n, device=x.device)``) is traced as ``arange(..., device=cpu)``, and
    torch.export adds ``_assert_tensor_metadata(..., device=cpu)`` checks. Left alone they
    would build tensors on the CPU and fail against the weights on the GPU. Every device a
    node names is set to ``device`` (as torch's own ``move_to_device_pass`` does for a whole
    ``ExportedProgram``), and plain tensor constants the graph reads are moved with the weights.
    The given module is not changed.

    Example:
        >>> from autopipe.models import seed_transformer
        >>> from autopipe.planning.trace import trace
        >>> model, args = seed_transformer(vocab_size=100, num_layers=1, seq_len=8)
        >>> moved = copy_to_device(trace(model, args).graph_module, "meta")
        >>> {p.device.type for p in moved.parameters()}
        {'meta'}
    """
    dev = torch.device(device)
    moved = copy.deepcopy(module).to(dev)
    for gm in moved.modules():
        if not isinstance(gm, fx.GraphModule):
            continue
        for node in gm.graph.nodes:
            if "device" in node.kwargs:
                node.kwargs = {**node.kwargs, "device": _retarget(node.kwargs["device"], dev)}
            if node.op == "call_function" and node.target is torch.ops.aten.to.device:
                node.args = (node.args[0], _retarget(node.args[1], dev), *node.args[2:])
            elif node.op == "get_attr":
                owner, _, name = node.target.rpartition(".")
                holder = gm.get_submodule(owner) if owner else gm
                value = getattr(holder, name)
                if isinstance(value, torch.Tensor) and value.device != dev:  # .to() moved weights and buffers
                    setattr(holder, name, value.to(dev))
        gm.recompile()
    return moved


# --------------------------------------------------------------------------- state keeping


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


class _SavedBytes:
    """Counts the bytes autograd saves for backward, skipping parameters and duplicates."""

    def __init__(self, param_ptrs: set[int]) -> None:
        self.param_ptrs = param_ptrs
        self.seen: set[tuple[int, tuple[int, ...]]] = set()
        self.total = 0

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        ptr = t.data_ptr() if t.layout == torch.strided else id(t)
        key = (ptr, tuple(t.shape))
        if ptr not in self.param_ptrs and key not in self.seen:
            self.seen.add(key)
            self.total += t.numel() * t.element_size()
        return t


# --------------------------------------------------------------------------- profiling


def _as_tuple(out: Any) -> tuple[Any, ...]:
    return out if isinstance(out, tuple) else (out,)


def _forward_backward(
    module: fx.GraphModule, inputs: list[Any], trainable: list[torch.Tensor], timer: Timer,
    counter: _SavedBytes | None = None,
) -> tuple[float, float, tuple[Any, ...]]:
    """One timed forward and one timed backward of a segment: (fwd_s, bwd_s, outputs).

    ``module.forward`` is called directly, not ``module(...)``: the FLOP counter's module
    tracker hooks ``Module.__call__`` and does not support ``torch.autograd.grad``.
    Backward uses ``torch.autograd.grad`` so nothing accumulates into any ``.grad``.
    """
    hooks = (torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t)
             if counter is not None else nullcontext())
    with hooks:
        fwd_s, out = timer.time(lambda: _as_tuple(module.forward(*inputs)))
    bwd_s, _ = _timed_backward(inputs, out, trainable, timer)
    return fwd_s, bwd_s, out


def _timed_backward(
    inputs: list[Any], out: Any, trainable: list[torch.Tensor], timer: Timer,
) -> tuple[float, tuple[torch.Tensor | None, ...]]:
    """Time one backward of ``out`` (ones as output gradients) with respect to the inputs that
    carry a gradient and ``trainable``: (seconds, the weight gradients, last ``len(trainable)``).

    ``torch.autograd.grad``, so nothing accumulates into any ``.grad``; (0.0, ()) when there
    is nothing to differentiate.
    """
    outs = [o for o in tree_leaves(out) if isinstance(o, torch.Tensor) and o.requires_grad]
    wrt = [v for v in inputs if isinstance(v, torch.Tensor) and v.requires_grad] + trainable
    if not outs or not wrt:
        return 0.0, ()
    grads = [torch.ones_like(o) for o in outs]
    seconds, got = timer.time(lambda: torch.autograd.grad(outs, wrt, grads, allow_unused=True))
    return seconds, (got[len(got) - len(trainable):] if trainable else ())


def _time_alone(
    module: torch.nn.Module, make_inputs: Callable[[], list[Any]], trainable: list[torch.Tensor], timer: Timer,
    warmup: int, repeats: int,
) -> tuple[float, float]:
    """Forward and backward seconds (:func:`per_run_s`) of one module run again and again on its own.

    ``make_inputs`` gives fresh inputs for each run; ``warmup`` runs are not timed. The
    caches are not emptied between runs: its callers time a whole probe stage that stays
    cached in its own pipeline, or one segment, which a flush would charge a whole action's
    cold start (see :func:`profile_segments`).
    """
    fwd_times: list[float] = []
    bwd_times: list[float] = []
    for i in range(warmup + repeats):
        f, b, _ = _forward_backward(module, make_inputs(), trainable, timer)
        if i >= warmup:
            fwd_times.append(f)
            bwd_times.append(b)
    return per_run_s(fwd_times), per_run_s(bwd_times)


def _accumulate(accumulated: list[torch.Tensor], grads: Sequence[torch.Tensor | None]) -> None:
    """Add ``grads`` into ``accumulated`` in place, as autograd's AccumulateGrad does into ``.grad``."""
    for acc, g in zip(accumulated, grads):
        if g is not None:
            acc.add_(g)


#: One module's timed work in rounds: ``(module, make_inputs, trainable)``.
_RoundEntry = tuple[torch.nn.Module, Callable[[], list[Any]], list[torch.Tensor]]


def _backward_and_accumulate(
    inputs: list[Any], out: Any, trainable: list[torch.Tensor], accumulated: list[torch.Tensor], timer: Timer,
) -> tuple[float, float]:
    """Time one backward (:func:`_timed_backward`), then the add of its weight gradients."""
    b, weight_grads = _timed_backward(inputs, out, trainable, timer)
    a = timer.time(lambda: _accumulate(accumulated, weight_grads))[0] if weight_grads else 0.0
    return b, a


def _time_in_rounds(
    segments: list[_RoundEntry], timer: Timer, warmup: int, repeats: int, flush: Callable[[], None] | None = None,
    whole: _RoundEntry | None = None, fit: bool = False,
) -> tuple[list[tuple[float, float, float]], WholePass | None]:
    """Forward, backward and accumulation seconds of each segment (:func:`per_run_s`), timed in rounds.

    A round runs every segment's forward in graph order, then every segment's backward in
    reverse order, each timed on its own (each segment keeps its own autograd graph, so its
    backward is its own). ``segments`` holds ``(module, make_inputs, trainable)`` per segment.
    ``flush`` (a :class:`CacheFlusher`) runs, untimed, before each round's forwards and before
    its backwards: a pipeline action starts with the caches holding other work, then runs its
    segments one after another, each finding the previous one's output still there.

    After each backward, the weight gradients it produced are added into a gradient buffer
    of the segment's own, timed on their own (:attr:`SegmentCost.accum_s`): in a pipeline
    step every micro-batch after the first adds its gradients into ``.grad`` this way, the
    new gradients fresh from the backward, the accumulated ones last touched a micro-batch ago.

    ``whole`` (the model's whole graph, same form) is then timed in every round as well, as
    one forward, one backward and one accumulation, each pass after a flush: what the
    segments add up to when they run as one graph. Returns the segments' times and a
    :class:`WholePass` (``None`` when ``whole`` is not given). With ``fit``, each segment's
    times are its means multiplied by the pass's scale, else its means with the fixed cost
    of starting a backward taken off each backward.
    """
    entries = segments + ([whole] if whole is not None else [])
    fwd_times: list[list[float]] = [[] for _ in entries]
    bwd_times: list[list[float]] = [[] for _ in entries]  # as timed, each with its own start
    acc_times: list[list[float]] = [[] for _ in entries]
    accumulated = [[torch.zeros_like(p) for p in trainable] for _, _, trainable in entries]
    call_s = _backward_call_s(timer)
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

        whole_pass = WholePass(*means[n], *(sum(t[j] for t in means[:n]) for j in range(3)),
                               scales=(round_ratio(fwd_times), round_ratio(bwd_times), round_ratio(acc_times)),
                               fitted=fit)
    if fit and whole_pass is not None:
        # The whole graph pays every fixed cost once, as a stage does: no start to take off.
        sf, sb, sa = whole_pass.scales
        return [(f * sf, b * sb, a * sa) for f, b, a in means[:n]], whole_pass
    # Each segment here starts a backward of its own; a stage starts one for all its
    # segments, so the fixed cost of starting one is not the segment's.
    return [(f, per_run_s([max(0.0, x - call_s) if x else 0.0 for x in bwd_times[k]]), a)
            for k, (f, _, a) in enumerate(means[:n])], whole_pass


def _time_accumulation(trainable: list[torch.Tensor], timer: Timer, warmup: int, repeats: int) -> float:
    """Seconds (:func:`per_run_s`) to add one gradient into an accumulated one for each of ``trainable``.

    For a segment timed alone (copied to the device): like its forward and backward there,
    timed again and again without emptying the caches.
    """
    if not trainable:
        return 0.0
    accumulated = [torch.zeros_like(p) for p in trainable]
    grads = [torch.ones_like(p) for p in trainable]
    times = []
    for i in range(warmup + repeats):
        t, _ = timer.time(lambda: _accumulate(accumulated, grads))
        if i >= warmup:
            times.append(t)
    return per_run_s(times)


def _backward_call_s(timer: Timer, repeats: int = 21) -> float:
    """Median seconds of ``torch.autograd.grad`` through one tiny operation: the cost of starting a backward."""
    x = torch.ones(1, device=timer.device, requires_grad=True)
    times = []
    for _ in range(repeats):
        y = x * 2.0
        times.append(timer.time(lambda: torch.autograd.grad(y, x, torch.ones_like(y)))[0])
    return statistics.median(times)


@dataclass
class WholePass:
    """The model's whole graph timed as one, beside the segments timed one by one.

    A stage runs its segments as one graph, with no pause between them. The profile times
    each segment on its own, and on a GPU that costs every segment a start from an idle
    device: the host synchronises, then launches the segment's kernels while the GPU waits
    for the first of them, where inside one graph the host launches ahead of the GPU. On one
    H100 (torch 2.11) the seed Transformer's 67 segments summed to 13.8 ms forward and
    23.8 ms backward against 8.5 ms and 12.4 ms for the whole graph; the kernels' own time
    was the same both ways (docs/costs-and-measurement.md section 1). So the profile also
    times the whole graph in every round and, when ``fitted``, multiplies each segment's
    forward, backward and accumulation by the ``scales`` of its pass: the segments then add
    up to the whole model, and keep their measured shares of it.

    Times are per micro-batch, :func:`per_run_s` of the rounds. The ``segments_*`` fields are
    the segments' sums as timed, before any scaling and with each backward's own start
    included. ``scales`` are ``whole / segments`` per round, the median over the rounds (1.0
    for a pass the segments took no time in). Fitted, a segment's backward is its timed one
    times the scale; not fitted, its timed one less the cost of starting a backward, which
    a stage pays once (:func:`profile_segments`).

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


class SegmentCosts(list):
    """What :func:`profile_segments` returns: a list of :class:`SegmentCost`, plus ``whole``.

    ``whole`` is the :class:`WholePass` measured beside the segments when the profile was
    timed in rounds, else ``None``. Any list of ``SegmentCost`` works where this does.
    """

    whole: WholePass | None = None


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

    On CUDA: yes, the segments timed one by one added up to 1.2-1.5x the whole graph's forward and
    2.2-3x its backward on one H100.
    On the CPU: no; a segment's start costs little there and the sums were within
    0.89-1.19x of the whole, either way by model, and a fitted profile predicted the 2-rank
    steps no better (docs/costs-and-measurement.md section 1).

    Example:
        >>> fit_to_whole_default(torch.device("cpu"))
        False
    """
    return torch.device(device).type == "cuda"


def profile_segments(
    traced: TracedModel,
    *,
    cost: str = "measured",
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
        traced: The result of :func:`autopipe.planning.trace.trace`.

    Keyword Args:
        cost: ``"measured"`` (time it), ``"flops"`` or ``"params"`` (estimate it); see the
            module docstring.
        device: Where to run: ``"cpu"``, ``"cuda"``, ``"cuda:1"``; default CUDA if present.
            When the model lives elsewhere, a copy of it is profiled there (the model is
            left where it is); only when the copy does not fit, each segment is copied
            there in turn and timed on its own (with a warning on CUDA: such times add up to
            more than the model's, and nothing is fitted to the whole graph).
        warmup: Untimed runs before timing (measured source only).
        repeats: Timed runs; their mean is kept (:func:`per_run_s`; measured source only). When the model
            (or its copy) is on ``device``, each run is a round over the whole model - every
            segment's forward in order, then every backward in reverse, as in training -
            rather than one segment run again and again: a segment repeated back to back
            finds its weights and inputs still in the cache, which in training it does not,
            and was measured up to 1.5x too fast that way on a CPU.
        device_flops: FLOP/s used to turn FLOPs into seconds; measured when omitted.
        progress: Show a progress bar.
        flush_cache: Empty the device's caches (:class:`CacheFlusher`) before each round's
            forwards and before its backwards (measured source, when timed in rounds). In a
            pipeline every
            action starts with its stage's weights out of the cache, as other micro-batches
            and stages ran since; timed with the caches still warm from the previous round,
            the model's stages took 1.03-1.08x longer on this project's CPU host than profiled
            (docs/costs-and-measurement.md section 1). ``False`` keeps them warm.
        fit_to_whole: When timed in rounds, the whole graph is timed in every round too
            (:class:`WholePass`, kept as the result's ``whole``); ``True`` scales the segments'
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
        >>> from autopipe.planning.trace import trace
        >>> model, args = seed_transformer(vocab_size=100, num_layers=1, seq_len=8)
        >>> costs = profile_segments(trace(model, args), cost="flops", progress=False)
        >>> costs[-1].flops > 0
        True
    """
    if cost not in COST_SOURCES:
        raise ValueError(f"cost={cost!r} is not a cost source; use one of {list(COST_SOURCES)}")
    if not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup={warmup!r} must be an integer >= 0")
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats={repeats!r} must be an integer >= 1")
    check_flush_cache(flush_cache)
    check_fit_to_whole(fit_to_whole)
    dev = resolve_device(device)
    fit = fit_to_whole_default(dev) if fit_to_whole is None else fit_to_whole
    gm = traced.graph_module
    if cost == "measured" and not _lives_on(gm, dev):
        # Time a copy of the whole model on the device when it fits: then the segments are
        # timed in rounds beside the whole graph. Only when it does not, one segment at a time.
        if _room_for_whole(gm, dev):
            try:
                return _profile(traced, copy_to_device(gm, dev), dev, cost=cost, warmup=warmup, repeats=repeats,
                                progress=progress, flush_cache=flush_cache, fit=fit)
            except torch.cuda.OutOfMemoryError:
                pass  # the copy and what it held go with the exception
        if dev.type == "cuda":
            torch.cuda.empty_cache()
            warnings.warn(
                f"{traced.model_name} does not fit on {dev} whole for profiling: each segment is copied "
                "there and timed on its own, and on a GPU such times add up to well over the model's "
                "(1.4-2.4x on one H100, docs/costs-and-measurement.md section 1). Profile on a GPU with "
                "room for the model and one micro-batch's activations to have the segments fitted to the "
                "whole graph", stacklevel=2)
    return _profile(traced, gm, dev, cost=cost, warmup=warmup, repeats=repeats, progress=progress,
                    flush_cache=flush_cache, fit=fit, device_flops=device_flops)


def _room_for_whole(module: torch.nn.Module, dev: torch.device) -> bool:
    """Whether a CUDA device has free memory for a copy of ``module`` to profile in rounds.

    Three times its parameters and buffers: the weights, their gradients and the profile's
    accumulation buffers; the activations are not known before profiling, so a copy that
    passes this can still run out of memory (the caller then falls back). Checked first so
    that a model far too big is not copied on the host only to fail on the device. Other
    devices: True.
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
    traced: TracedModel, gm: fx.GraphModule, dev: torch.device, *, cost: str, warmup: int, repeats: int,
    progress: bool, flush_cache: bool, fit: bool, device_flops: float | None = None,
) -> SegmentCosts:
    """:func:`profile_segments` on the graph ``gm`` (the traced model's own, or a copy on ``dev``)."""
    timer = Timer(dev)
    seg_mods = _segment_modules(traced, gm)
    rg_ep = requires_grad_map(traced)
    needs_grad = {n.name: v for n, v in rg_ep.items()}

    # Model inputs, by placeholder name (the exported graph's flat user inputs).
    user_names = list(traced.exported.graph_signature.user_inputs)
    flat_inputs, input_spec = tree_flatten((traced.example_args, traced.example_kwargs))
    env: dict[str, Any] = {}
    for name, val in zip(user_names, flat_inputs):
        env[name] = val.to(dev) if isinstance(val, torch.Tensor) else val
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
    costs = SegmentCosts()
    # Time whole rounds over the model when no segment has to be copied to the device.
    in_rounds = cost == "measured" and _lives_on(gm, dev)
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

            counter = _SavedBytes({p.data_ptr() for _, p in state})
            with FlopCounterMode(display=False) as flop_counter:
                _, _, out = _forward_backward(module, make_inputs(), trainable, timer, counter)
            flops = float(flop_counter.get_total_flops())
            fwd_s = bwd_s = accum_s = 0.0  # timed in rounds below, or estimated, unless timed here
            if in_rounds:
                rounds.append((module, make_inputs, trainable))
            elif cost == "measured":
                # No flush here: emptying the caches before every segment would charge each
                # one a cold start that a stage pays once per action (measured 1.24-1.49x).
                fwd_s, bwd_s = _time_alone(module, make_inputs, trainable, timer, warmup, repeats)
                accum_s = _time_accumulation(trainable, timer, warmup, repeats)
            out_vals = [o.detach() if isinstance(o, torch.Tensor) else o for o in out]
            costs.append(
                SegmentCost(
                    fwd_s=fwd_s,
                    bwd_s=bwd_s,
                    param_bytes=param_bytes,
                    act_bytes=counter.total,
                    out_bytes=tensor_bytes(out_vals),
                    flops=flops,
                    trainable_param_bytes=trainable_bytes,
                    accum_s=accum_s,
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
            per_segment, costs.whole = _time_in_rounds(rounds, timer, warmup, repeats, flush, whole, fit)
            for cost_k, timed in zip(costs, per_segment):
                cost_k.fwd_s, cost_k.bwd_s, cost_k.accum_s = timed

    if cost != "measured":
        _estimate_times(costs, cost, device_flops if device_flops else measure_device_flops(dev))
    return costs


@dataclass
class LossCost:
    """What the loss adds to the last stage, per micro-batch: its forward and backward, saved bytes."""

    fwd_s: float
    bwd_s: float
    act_bytes: int  # bytes the loss saves for its backward (e.g. the log-softmax of the logits)
    batch: int  # the micro-batch size it was measured at (its first input's first dimension)


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
) -> LossCost:
    """Measure ``loss_fn(model output, target)``: forward, backward and saved bytes per micro-batch.

    The last pipeline stage computes the loss of every micro-batch and keeps what it saves
    for backward until that micro-batch's backward; for a language model (log-softmax over
    the vocabulary) that is as much as the stage's own activations. The model runs once
    (no grad) where it lives to get the output; the loss is timed on ``device`` on that
    output as a fresh leaf.

    Args:
        model: The model; left unchanged.
        example_args, example_kwargs: One micro-batch of inputs.
        loss_fn: ``loss_fn(output, target) -> scalar tensor``.
        target: The micro-batch's target.

    Keyword Args:
        device, warmup, repeats: As for :func:`profile_segments`.

    Returns:
        A :class:`LossCost`.

    Raises:
        ValueError: the loss is not a tensor that can be differentiated.

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
    # As traced: a Hugging Face model's KV cache off (it is no part of what the loss sees).
    kwargs, _ = hf_compat.training_kwargs(model, example_kwargs)
    with torch.no_grad(), _model_state_preserved(model), hf_compat.training_config(model):
        output = model(*example_args, **kwargs)
    output = tree_map(lambda t: t.detach().to(dev) if isinstance(t, torch.Tensor) else t, output)
    target = tree_map(lambda t: t.to(dev) if isinstance(t, torch.Tensor) else t, target)
    first = next((t for t in tree_leaves((tuple(example_args), dict(example_kwargs or {})))
                  if isinstance(t, torch.Tensor) and t.dim() > 0), None)
    batch = int(first.shape[0]) if first is not None else 1

    def leaves() -> tuple[Any, list[torch.Tensor]]:
        out = tree_map(lambda t: t.detach().requires_grad_(True)
                       if isinstance(t, torch.Tensor) and t.is_floating_point() else t, output)
        return out, [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]

    counter = _SavedBytes(set())
    out, wrt = leaves()
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t):
        loss = loss_fn(out, target)
    if not isinstance(loss, torch.Tensor) or not loss.requires_grad or not wrt:
        raise ValueError(f"loss_fn(output, target) must return a tensor that depends on the model output; "
                         f"got {type(loss).__name__}")
    fwd, bwd = [], []
    for i in range(warmup + repeats):
        out, wrt = leaves()
        f, loss = timer.time(lambda: loss_fn(out, target))
        b, _ = timer.time(lambda: torch.autograd.grad(loss, wrt, allow_unused=True))
        if i >= warmup:
            fwd.append(f)
            bwd.append(b)
    return LossCost(fwd_s=per_run_s(fwd), bwd_s=per_run_s(bwd), act_bytes=counter.total,
                    batch=batch)


def _estimate_times(costs: list[SegmentCost], cost: str, device_flops: float) -> None:
    """Fill fwd_s / bwd_s from FLOPs (cost="flops") or from parameter shares (cost="params")."""
    if device_flops <= 0:
        raise ValueError(f"device_flops={device_flops!r} must be > 0 FLOP/s")
    # Backward of a matmul costs two matmuls (input and weight gradients): 1/3 fwd, 2/3 bwd.
    if cost == "flops":
        for c in costs:
            c.fwd_s = c.flops / 3.0 / device_flops
            c.bwd_s = 2.0 * c.flops / 3.0 / device_flops
    else:  # "params"
        total_s = sum(c.flops for c in costs) / device_flops
        total_bytes = sum(c.param_bytes for c in costs) or 1
        for c in costs:
            share = total_s * c.param_bytes / total_bytes
            c.fwd_s, c.bwd_s = share / 3.0, 2.0 * share / 3.0
