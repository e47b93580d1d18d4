"""Measuring real pipelines: the helpers shared by split_quality, split_quality_sim and prediction_accuracy.

Four things every "measured, not predicted" benchmark here needs:

* :data:`MODELS` - the zoo models with uneven layers at benchmark sizes, with a loss and a
  target for each, so a pipeline can train them;
* :class:`StageChain` - a model cut by ``torch.distributed.pipelining.pipeline()`` at given
  split points, every stage's forward and backward timed **in one process** (stage ``k``'s
  output feeds stage ``k + 1``; its input gradient flows back). That is what a stage costs
  with no communication and no schedule around it;
* :func:`run_world` + :func:`pipeline_worker` - a real multi-rank run of
  :class:`autopipe.Pipeline` (gloo on 127.0.0.1 on CPU, NCCL on GPUs), several splits or
  plans built side by side and stepped in interleaved rounds (A B C A B C ...), every
  process and collective under a timeout;
* :class:`LiveBytes` - the peak bytes of live tensor storage during a step, which is how
  per-rank peak memory is measured on a CPU (it has no ``max_memory_allocated``).

Nothing here asserts on a time: the scripts report medians and ratios.
"""

from __future__ import annotations

import copy
import os
import statistics
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.pipelining import SplitPoint, pipeline
from torch.utils._pytree import tree_leaves

from autopipe import PlannerOptions
from autopipe._spawn import finish_rank, join_loopback_world, spawn_ranks
import _common  # noqa: F401  (puts tests/ on the path, for the test models)
from zoo import build
from autopipe.machine.timing import (  # noqa: F401 - the scripts read the paired ones from here
    Timer, fastest_paired, paired_ratio, paired_ratio_interval, per_run_s)
from autopipe.machine.working_set import LiveStorage

__all__ = [
    "BenchModel", "MODELS", "host_info", "make_model", "ce_loss", "make_target", "stack_microbatches",
    "StageChain", "use_codegen", "interpreter_modules", "LiveBytes", "run_world", "run_variants",
    "pipeline_worker", "pooled_steps", "paired_ratio", "fastest_paired", "parallel_efficiency", "WorldFailed",
    "median", "world_of_one", "profile_in_world", "paired_ratio_interval", "segment_times", "busy_share_by_stage",
]


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


def segment_times(costs: Sequence[Any]) -> dict[str, list[float]]:
    """A profile's per-segment seconds as a rank returns them: forward, backward, accumulation."""
    return {k: [getattr(c, k) for c in costs] for k in ("fwd_s", "bwd_s", "accum_s")}


def host_info() -> dict[str, Any]:
    """What ``_common.machine()`` leaves out: the CPU model and how busy the machine was."""
    info: dict[str, Any] = {"cpu_model": None, "load_avg": None}
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu_model"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        info["load_avg"] = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        pass
    return info


def world_of_one(device: torch.device, timeout_s: float = 120.0) -> None:
    """A process group of this process alone on 127.0.0.1: NCCL for a GPU, gloo (one torch thread) for the CPU.

    For the one-rank benchmarks (``gpu_one_rank`` and its probe): torch's pipeline runtime
    needs a process group even when every stage is on one rank.
    """
    import datetime

    import torch.distributed as dist

    from autopipe._spawn import free_port

    if device.type == "cpu":
        torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=timeout_s))


# --------------------------------------------------------------------------- models


@dataclass(frozen=True)
class BenchModel:
    """A zoo model at three sizes: full runs, ``--quick`` runs and the test suite's ``--smoke``."""

    zoo: str  # name in zoo.ZOO
    why: str  # what makes its layers uneven
    full: dict[str, Any] = field(default_factory=dict)
    quick: dict[str, Any] = field(default_factory=dict)
    smoke: dict[str, Any] = field(default_factory=dict)


# Sizes are chosen so one forward+backward of one micro-batch takes roughly 20-60 ms on one
# CPU thread: long enough that Python overhead per action is small, short enough that every
# benchmark finishes within its 10-minute budget on a 2-core machine.
MODELS: dict[str, BenchModel] = {
    "seed_transformer": BenchModel(
        "seed_transformer", "tutorial Transformer, 8k-token vocabulary: the output layer costs as much as the blocks",
        full=dict(vocab_size=8000, d_model=128, num_heads=4, d_ff=512, num_layers=4, batch=2, seq_len=32),
        quick=dict(vocab_size=8000, d_model=128, num_heads=4, d_ff=512, num_layers=2, batch=2, seq_len=32),
        smoke=dict(vocab_size=500, d_model=32, num_heads=2, d_ff=64, num_layers=2, batch=2, seq_len=8),
    ),
    "gpt2_untied": BenchModel(
        "gpt2_untied", "GPT-2 (HF config), separate embedding and 8k-token head",
        full=dict(n_layer=4, n_embd=128, n_head=4, vocab_size=8000, batch=2, seq_len=32),
        quick=dict(n_layer=2, n_embd=128, n_head=4, vocab_size=8000, batch=2, seq_len=32),
        smoke=dict(n_layer=2, n_embd=32, n_head=2, vocab_size=300, batch=2, seq_len=8),
    ),
    "gpt2_tied": BenchModel(
        "gpt2_tied", "GPT-2 (HF config), head tied to the embedding: the shared weight is replicated",
        full=dict(n_layer=4, n_embd=128, n_head=4, vocab_size=8000, batch=2, seq_len=32),
        quick=dict(n_layer=2, n_embd=128, n_head=4, vocab_size=8000, batch=2, seq_len=32),
        smoke=dict(n_layer=2, n_embd=32, n_head=2, vocab_size=300, batch=2, seq_len=8),
    ),
    "llama": BenchModel(
        "llama", "Llama (HF config), RoPE, SwiGLU, untied 8k-token head",
        full=dict(num_hidden_layers=4, hidden_size=128, num_attention_heads=4, vocab_size=8000, batch=2, seq_len=32),
        quick=dict(num_hidden_layers=2, hidden_size=128, num_attention_heads=4, vocab_size=8000, batch=2, seq_len=32),
        smoke=dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=2, vocab_size=300, batch=2, seq_len=8),
    ),
    "cnn": BenchModel(
        "cnn", "CNN: early blocks compute-heavy on large maps, late blocks parameter-heavy",
        full=dict(image_size=64, widths=(16, 32, 64, 128, 256), batch=8),
        quick=dict(image_size=64, widths=(16, 32, 64, 128, 256), batch=4),
        smoke=dict(image_size=16, widths=(4, 8), hidden=16, batch=2),
    ),
    "unet": BenchModel(
        "unet", "U-Net: long skip connections cross every middle cut",
        full=dict(base_width=16, depth=3, image_size=64, batch=2),
        quick=dict(base_width=16, depth=3, image_size=64, batch=1),
        smoke=dict(base_width=4, depth=2, image_size=8, batch=1),
    ),
    "mlp": BenchModel(
        "mlp", "MLP whose widths swing tenfold (128 ... 2560)",
        full=dict(batch=32),
        quick=dict(batch=32),
        smoke=dict(widths=(16, 160, 16, 64, 16), batch=4),
    ),
}


def make_model(name: str, size: str = "full") -> tuple[nn.Module, tuple[Any, ...]]:
    """Build benchmark model ``name`` at ``size`` ("full", "quick" or "smoke"): (model, one micro-batch)."""
    spec = MODELS[name]
    return build(spec.zoo, **getattr(spec, size))


def ce_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy for every zoo model: LM logits (B, S, V), classes (B, C), pixel classes (B, C, H, W)."""
    if output.dim() == 3:
        return F.cross_entropy(output.flatten(0, 1).float(), target.flatten())
    return F.cross_entropy(output.float(), target)


def make_target(output: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """A random class-index target that :func:`ce_loss` accepts for ``output``."""
    g = torch.Generator().manual_seed(seed)
    if output.dim() == 3:  # (B, S, V) -> (B, S)
        return torch.randint(0, output.shape[-1], tuple(output.shape[:2]), generator=g)
    shape = (output.shape[0], *output.shape[2:])  # class dimension is 1
    return torch.randint(0, output.shape[1], shape, generator=g)


def stack_microbatches(values: tuple[Any, ...], m: int) -> tuple[Any, ...]:
    """A batch of ``m`` micro-batches: every tensor repeated along dimension 0 (data does not change timing)."""
    return tuple(torch.cat([v] * m) if isinstance(v, torch.Tensor) and v.dim() > 0 else v for v in values)


# --------------------------------------------------------------------------- one process, every stage


def build_split(model: nn.Module, args: tuple[Any, ...], split_points: Sequence[str]) -> Any:
    """The ``torch.distributed.pipelining`` Pipe that :class:`autopipe.Pipeline` would build.

    Uses the runtime's own construction (``pipeline()`` on a copy, skip connections relayed
    through the stages in between, contiguous boundary tensors, outputs that are never
    views), so a stage timed here is the module a rank runs. Falls back to plain
    ``pipeline()`` if the runtime's stage builder moves.
    """
    spec = {name: SplitPoint.BEGINNING for name in split_points}
    expected = len(split_points) + 1
    try:
        from autopipe.runtime.compat import guard_stage_boundaries
        from autopipe.runtime.stages import split_model
    except ImportError:  # pragma: no cover - only if the runtime is reorganised
        pipe = pipeline(copy.deepcopy(model), args, split_spec=spec)
    else:
        pipe = split_model(copy.deepcopy(model), spec, (tuple(args), {}), training=True, expected=expected)
        for k in range(pipe.num_stages):
            guard_stage_boundaries(pipe.get_stage_module(k))
    if pipe.num_stages != expected:
        raise ValueError(f"split at {list(split_points)} gave {pipe.num_stages} stages, not {expected}")
    return pipe


class StageChain:
    """A model split by ``pipeline()`` at ``split_points``; each stage's forward and backward timed alone.

    The stages run one after another in this process, as the pipeline's graph wires them
    (``pipe.split_gm``): each stage's inputs are detached leaves, so its backward is timed
    on its own, with the gradient the next stage's backward produced - exactly the work a
    pipeline rank does for one micro-batch, minus the communication and the schedule. The
    last stage's forward includes the loss, as torch's schedules compute it there.

    Example:
        >>> chain = StageChain(model, args, ["layers.2"], device="cpu")      # doctest: +SKIP
        >>> fwd_s, bwd_s = chain.time(target, warmup=1, repeats=5)           # doctest: +SKIP
    """

    def __init__(self, model: nn.Module, args: tuple[Any, ...], split_points: Sequence[str],
                 *, device: str | torch.device = "cpu", loss_fn: Callable = ce_loss, codegen: bool = False) -> None:
        self.split_points = list(split_points)
        self.device = torch.device(device)
        pipe = build_split(model, args, self.split_points)
        self.num_stages = pipe.num_stages
        self.gm = pipe.split_gm.to(self.device)
        self.gm.train()
        if codegen:
            use_codegen(self.gm)
        self.args = tuple(a.to(self.device) if isinstance(a, torch.Tensor) else a for a in args)
        self.loss_fn = loss_fn
        self.timer = Timer(self.device)
        self._stage_of = {n.name: k for k, n in enumerate(n for n in self.gm.graph.nodes if n.op == "call_module")}

    def run_once(self, target: torch.Tensor) -> tuple[list[float], list[float]]:
        """One forward+backward of one micro-batch: per-stage (fwd_s, bwd_s)."""
        for p in self.gm.parameters():
            p.grad = None
        env: dict[str, Any] = {}
        placeholders = iter(self.args)
        fwd = [0.0] * self.num_stages
        bwd = [0.0] * self.num_stages
        stage_io: list[tuple[list[torch.Tensor], list[tuple[int, torch.Tensor]], Any]] = []
        producer: dict[int, int] = {}  # id(tensor) -> stage that produced it
        for node in self.gm.graph.nodes:
            if node.op == "placeholder":
                env[node.name] = next(placeholders)
            elif node.op == "call_module":
                k = self._stage_of[node.name]
                raw = [env[a.name] for a in node.args]  # pipe's stage calls take positional values only
                leaves, links = [], []
                for v in raw:
                    if isinstance(v, torch.Tensor) and v.is_floating_point() and id(v) in producer:
                        leaf = v.detach().requires_grad_(True)
                        links.append((id(v), leaf))
                        leaves.append(leaf)
                    else:
                        leaves.append(v)
                module = getattr(self.gm, node.target)
                last = k == self.num_stages - 1
                if last:
                    t, out = self.timer.time(lambda: self.loss_fn(module(*leaves), target))
                else:
                    t, out = self.timer.time(lambda: module(*leaves))
                fwd[k] = t
                for o in tree_leaves(out):
                    if isinstance(o, torch.Tensor):
                        producer[id(o)] = k
                stage_io.append((leaves, links, out))
                env[node.name] = out
            elif node.op == "call_function":
                fn_args = [env[a.name] if hasattr(a, "name") and a.name in env else a for a in node.args]
                env[node.name] = node.target(*fn_args)
            # output: nothing to do; the loss was taken in the last stage
        # Backward, last stage first: each stage's output gradients are its successors' input gradients.
        grads: dict[int, torch.Tensor] = {}
        for k in reversed(range(self.num_stages)):
            _, links, out = stage_io[k]
            if k == self.num_stages - 1:
                outs, gouts = [out], [None]
            else:
                pairs = [(o, grads[id(o)]) for o in tree_leaves(out)
                         if isinstance(o, torch.Tensor) and o.requires_grad and id(o) in grads]
                outs, gouts = [o for o, _ in pairs], [g for _, g in pairs]
            if outs:
                t, _ = self.timer.time(lambda: torch.autograd.backward(outs, gouts))
                bwd[k] = t
            for src, leaf in links:
                if leaf.grad is not None:
                    grads[src] = grads[src] + leaf.grad if src in grads else leaf.grad
        return fwd, bwd

    def time(self, target: torch.Tensor, *, warmup: int = 1, repeats: int = 5) -> tuple[list[float], list[float]]:
        """Per-stage (fwd_s, bwd_s): the mean of ``repeats`` runs (as the profile keeps) after ``warmup`` untimed runs."""
        target = target.to(self.device)
        for _ in range(warmup):
            self.run_once(target)
        runs = [self.run_once(target) for _ in range(repeats)]
        fwd = [per_run_s([r[0][k] for r in runs]) for k in range(self.num_stages)]
        bwd = [per_run_s([r[1][k] for r in runs]) for k in range(self.num_stages)]
        return fwd, bwd


def use_codegen(module: nn.Module) -> int:
    """Make torch's unflattened stage modules run generated code instead of the fx Interpreter.

    ``pipeline()`` rebuilds each stage's module hierarchy from the exported graph as
    ``torch.export.unflatten.InterpreterModule`` objects, which by default execute their
    graph node by node through ``torch.fx.Interpreter`` (for readable stack traces). That
    costs Python time per graph node that autopipe's profiler - which runs each segment as
    a compiled ``GraphModule`` - does not see. ``InterpreterModule`` can run its generated
    code instead (what it does under ``torch.compile``); this switches every one in
    ``module`` to it. Returns how many were switched. An experiment (``--codegen-stages``):
    :class:`autopipe.Pipeline` itself runs torch's default.
    """
    from torch.export.unflatten import InterpreterModule

    n = 0
    for m in module.modules():
        if isinstance(m, InterpreterModule):
            m._run_with_interpreter = False
            n += 1
    return n


def interpreter_modules(module: nn.Module) -> dict[str, int]:
    """How many of torch's InterpreterModules in ``module`` run the fx Interpreter, and how many generated code."""
    from torch.export.unflatten import InterpreterModule

    mods = [m for m in module.modules() if isinstance(m, InterpreterModule)]
    interp = sum(1 for m in mods if getattr(m, "_run_with_interpreter", True))
    return {"interpreter": interp, "codegen": len(mods) - interp}


def busy_share_by_stage(timeline: Any, n_stages: int) -> tuple[list[float], list[float]]:
    """Per stage, forward and backward: the share of its actions' time during which another rank computes."""
    by_rank: dict[int, list[Any]] = {}
    for e in timeline.events:
        by_rank.setdefault(e.rank, []).append(e)
    covered = {"F": [0.0] * n_stages, "B": [0.0] * n_stages}
    total = {"F": [0.0] * n_stages, "B": [0.0] * n_stages}
    for e in timeline.events:
        busy = sum(max(0.0, min(e.end_s, o.end_s) - max(e.start_s, o.start_s))
                   for r, evs in by_rank.items() if r != e.rank for o in evs)
        kind = "F" if e.kind == "F" else "B"
        covered[kind][e.stage] += min(busy, e.duration_s)
        total[kind][e.stage] += e.duration_s
    return tuple([c / t if t > 0 else 0.0 for c, t in zip(covered[k], total[k])] for k in ("F", "B"))


# --------------------------------------------------------------------------- memory


class LiveBytes(LiveStorage):
    """Peak bytes of tensor storage allocated while the mode is active and still alive.

    autopipe's own :class:`~autopipe.machine.working_set.LiveStorage`, which the profiler
    measures the backward's working set with, under the name the benchmarks report: every
    operator's output storage is counted once when it first appears and uncounted when
    Python frees it, so ``peak`` is the high-water mark of memory *allocated inside the
    block* - activations, gradients, temporaries, received tensors. Storage that existed
    before the block (parameters, optimizer state) is not in it; add it yourself. This is
    exact for what torch allocates through its operators and independent of the host
    allocator, which makes it a fair CPU stand-in for ``torch.cuda.max_memory_allocated``
    (allocator caching and fragmentation excluded).
    """


def _tensor_bytes(tensors: Sequence[torch.Tensor]) -> int:
    seen, total = set(), 0
    for t in tensors:
        st = t.untyped_storage()
        if st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            total += st.nbytes()
    return total


# --------------------------------------------------------------------------- worlds


class WorldFailed(RuntimeError):
    """A rank raised, died or ran past the deadline; the message has each rank's traceback."""


def _world_entry(fn: Callable, rank: int, world: int, port: int, backend: str, threads: int,
                 pg_timeout_s: float, out_dir: str, job: Any) -> None:
    # Each rank gets its share of the cores, and the planner profiled with the same count.
    torch.set_num_threads(threads)
    try:
        join_loopback_world(rank, world, port, backend=backend, timeout_s=pg_timeout_s)
        result = ("ok", fn(rank, world, job))
    except BaseException as e:  # noqa: BLE001 - everything goes back to the parent
        result = ("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
    finish_rank(out_dir, rank, result)


def run_world(fn: Callable, world: int, job: Any, *, device: str = "cpu", threads: int = 1,
              timeout_s: float = 300.0, pg_timeout_s: float = 60.0, allow_errors: bool = False) -> list[Any]:
    """Run ``fn(rank, world, job)`` on ``world`` spawned processes; return each rank's result.

    gloo on 127.0.0.1 for CPU, NCCL for CUDA (one GPU per rank). Every collective times out
    after ``pg_timeout_s`` and the whole world is killed after ``timeout_s``: a benchmark
    can fail, never hang. With ``allow_errors`` a failed rank's entry is a
    :class:`WorldFailed` instead of raising.
    """
    backend = "nccl" if torch.device(device).type == "cuda" else "gloo"
    outcomes, _, _ = spawn_ranks(
        _world_entry, world,
        lambda rank, port, out_dir: (fn, rank, world, port, backend, threads, pg_timeout_s, out_dir, job),
        timeout_s=timeout_s, prefix="autopipe-bench-",
    )
    results, errors = [], {}
    for r, (status, value) in enumerate(outcomes):
        if status != "ok":
            errors[r] = value
            value = WorldFailed(value)
        results.append(value)
    if errors and not allow_errors:
        raise WorldFailed("\n".join(f"--- rank {r}:\n{msg}" for r, msg in sorted(errors.items())))
    return results


def parallel_probe_worker(rank: int, world: int, job: dict[str, Any]) -> dict[str, float]:
    """Time a fixed compute alone on each rank and on all ranks at once (see :func:`parallel_efficiency`)."""
    import torch.distributed as dist

    g = torch.Generator().manual_seed(rank)
    a, b = torch.randn(384, 384, generator=g), torch.randn(384, 384, generator=g)

    def work() -> float:
        t0 = time.perf_counter()
        for _ in range(job.get("matmuls", 60)):
            torch.mm(a, b)
        return time.perf_counter() - t0

    work()
    alone: list[float] = []
    together: list[float] = []
    for _ in range(job.get("rounds", 5)):
        for r in range(world):  # each rank alone while the others wait at the barrier
            dist.barrier()
            if rank == r:
                alone.append(work())
            dist.barrier()
        dist.barrier()
        together.append(work())
    return {"alone_s": median(alone), "together_s": median(together)}


def parallel_efficiency(*, threads: int = 1, timeout_s: float = 120.0) -> dict[str, Any]:
    """How much two ranks computing at once slow each other down on this machine.

    Each of 2 processes runs the same matmuls alone (the other idle) and then both at once,
    interleaved over several rounds. ``together_over_alone`` near 1.0 means the ranks run
    truly in parallel (what the planner's simulation assumes); 2.0 means they share one
    core's worth of compute (hyperthreads, a busy machine), so a pipeline cannot speed up.
    """
    results = run_world(parallel_probe_worker, 2, {}, threads=threads, timeout_s=timeout_s)
    ratios = [r["together_s"] / r["alone_s"] for r in results]
    return {"per_rank": results, "together_over_alone": median(ratios), "load_avg": host_info()["load_avg"]}


def run_variants(job: dict[str, Any], *, device: str = "cpu", threads: int = 1, timeout_s: float = 300.0,
                 log: Callable[[str], None] = print) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """Run :func:`pipeline_worker` on 2 ranks; a variant that fails is dropped and the rest re-run.

    Returns each rank's result (as :func:`pipeline_worker` returns it) and ``{label: error}``
    for the variants that could not run. A world that fails without naming a variant
    (a crash, a timeout) is reported as an error of every variant still pending.
    """
    pending = list(job["variants"])
    failed: dict[str, str] = {}
    while pending:
        results = run_world(pipeline_worker, 2, {**job, "variants": pending}, device=device, threads=threads,
                            timeout_s=timeout_s, allow_errors=True)
        named = [r for r in results if isinstance(r, dict) and "failed_variant" in r]
        if named:
            # A rank whose peer failed first sees only "connection closed" or a timeout: the
            # other rank's error is the cause, so it comes first.
            named.sort(key=lambda r: any(k in r["error"] for k in ("Connection closed", "Timed out", "timeout")))
            label = named[0]["failed_variant"]
            error = " | ".join(dict.fromkeys(r["error"] for r in named))
            failed[label] = error
            log(f"    {label}: not run ({error[:120]}); re-running the others in a fresh world")
            pending = [v for v in pending if v["label"] != label]
            continue
        broken = [r for r in results if not isinstance(r, dict)]
        if broken:
            msg = str(broken[0]).strip().splitlines()
            error = f"the 2-rank world failed: {msg[-1] if msg else broken[0]!r}"
            for v in pending:
                failed[v["label"]] = error
            return [], failed
        for r in results:
            r["errors"] = dict(failed)
        return results, failed
    return [], failed


def pooled_steps(job: dict[str, Any], worlds: int, *, device: str = "cpu", threads: int = 1,
                 timeout_s: float = 300.0, log: Callable[[str], None] = print
                 ) -> tuple[dict[str, list[float]], list[dict[str, list[float]]], dict[str, str]]:
    """:func:`run_variants` in ``worlds`` fresh worlds one after another: every variant's steps, pooled.

    Which of two variants within a few percent of each other wins moves with the host's state
    from one world to the next, so the steps of several worlds are pooled. A step ends when
    its slower rank ends: the ranks' times are paired step by step. Returns ``{label: every
    step over all worlds, in the order they ran}`` (the i-th steps of two variants ran in the
    same round: :func:`paired_ratio`), the same per world that ran, and ``{label: error}`` for
    the variants that could not run (left out of every later world, and of the pooled steps).
    """
    per_world: list[dict[str, list[float]]] = []
    failed: dict[str, str] = {}
    for _ in range(worlds):
        job = {**job, "variants": [v for v in job["variants"] if v["label"] not in failed]}
        results, failed_here = run_variants(job, device=device, threads=threads, timeout_s=timeout_s, log=log)
        failed.update(failed_here)
        if results:
            per_world.append({v["label"]: [max(ts) for ts in zip(*(r["times"][v["label"]] for r in results))]
                              for v in job["variants"] if v["label"] not in failed_here})
    labels = [v["label"] for v in job["variants"] if v["label"] not in failed]
    pooled = {k: [t for w in per_world for t in w.get(k, [])] for k in labels}
    return {k: v for k, v in pooled.items() if v}, per_world, failed


def _rank_device(device: str, rank: int) -> torch.device:
    """The device of ``rank`` in a benchmark world on ``device`` ("cpu" or "cuda"): one GPU per rank."""
    return torch.device("cuda", rank) if device.startswith("cuda") else torch.device("cpu")


def _profile_worker(rank: int, world: int, job: dict[str, Any]) -> list[dict[str, Any]] | None:
    """Every rank profiles the model at once (:func:`~autopipe.planning.rank_profile.profile_in_ranks`); rank 0
    returns the mean."""
    from dataclasses import asdict

    from autopipe.planning.rank_profile import profile_in_ranks

    device = _rank_device(job["device"], rank)
    model, args = make_model(job["model"], job["size"])
    costs = profile_in_ranks(model, args, device=device, warmup=1, repeats=job["repeats"])
    return [asdict(c) for c in costs] if rank == 0 else None


def profile_in_world(name: str, size: str, *, world: int = 2, device: str = "cpu", threads: int = 1,
                     repeats: int = 15, timeout_s: float = 300.0) -> list[Any]:
    """The profile ``world`` ranks take together before a job, as a Pipeline does (``ProfileOptions(in_ranks=True)``).

    Spawns the ranks (each with ``threads`` torch threads, as they will train), has every one
    profile model ``name`` at once and returns the mean over the ranks as a list of
    :class:`autopipe.planning.costgraph.SegmentCost`: what ``partition(..., costs=)`` takes.
    """
    from autopipe.planning.costgraph import SegmentCost

    results = run_world(_profile_worker, world, {"model": name, "size": size, "device": device, "repeats": repeats},
                        device=device, threads=threads, timeout_s=timeout_s)
    return [SegmentCost(**d) for d in results[0]]


def pipeline_worker(rank: int, world: int, job: dict[str, Any]) -> dict[str, Any]:
    """Build every variant of ``job`` as an :class:`autopipe.Pipeline` and time them interleaved.

    ``job`` holds: ``model`` and ``size`` (see :data:`MODELS`), ``device`` ("cpu" or "cuda"),
    ``variants`` (each ``{"label", "schedule", "n_microbatches", "stages_per_rank"}`` plus
    ``"split_points"`` or ``"plan"`` (a ``Plan.to_dict()``)), ``rounds`` and ``steps`` (each
    round steps every variant ``steps`` times, in the same order), ``memory`` (measure peak
    bytes per rank) and ``link_bytes`` (sizes for a send/recv probe between ranks 0 and 1).

    Returns, per variant label: the step times this rank saw (seconds, between a barrier
    and the end of ``step``, which ends with the loss broadcast, so every rank has
    finished), and optionally memory figures; plus the link probe. If a variant cannot be
    built or stepped, returns ``{"failed_variant": label, "error": ...}`` at once
    (:func:`run_variants` runs the others again without it).
    """
    import torch.distributed as dist

    from autopipe.runtime import Pipeline
    from autopipe.planning.plan import Plan

    device = _rank_device(job["device"], rank)
    model, args = make_model(job["model"], job["size"])
    with torch.no_grad():
        target_mb = make_target(model(*args))
    def one_step(pipe, batch, target) -> float:
        pipe.zero_grad()
        dist.barrier()
        t0 = time.perf_counter()
        pipe.step(*batch, target=target)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - t0

    pipes = []
    for v in job["variants"]:
        m = v["n_microbatches"]
        kw = dict(example_args=args, loss_fn=ce_loss, schedule=v["schedule"], n_microbatches=m,
                  planner=PlannerOptions(stages_per_rank=v["stages_per_rank"]), device=device)
        if "plan" in v:
            kw["plan"] = Plan.from_dict(v["plan"])
        else:
            kw["split_points"] = v["split_points"]
        batch, target = stack_microbatches(args, m), torch.cat([target_mb] * m)
        try:
            pipe = Pipeline(model, **kw)
            if job.get("codegen"):
                for module in pipe.stage_modules.values():
                    use_codegen(module)
            for _ in range(job.get("warmup_steps", 1)):  # first steps set up buffers and communication
                one_step(pipe, batch, target)
        except Exception as e:  # noqa: BLE001 - reported to the parent, which runs the rest without it
            # After a failed step, sends and receives may be left unmatched between the ranks,
            # so nothing more is run in this world: the parent starts a fresh one without it.
            return {"failed_variant": v["label"], "error": f"{type(e).__name__}: {str(e).strip().splitlines()[0]}"}
        pipes.append((v["label"], pipe, batch, target))

    times: dict[str, list[float]] = {label: [] for label, *_ in pipes}
    profiles: list[dict[str, list[float]]] = []
    in_ranks_profiles: list[dict[str, list[float]]] = []
    traced = None
    if job.get("profile_between_rounds") and rank == 0:  # profile_in_ranks traces for itself
        from autopipe.planning.tracing import trace

        traced = trace(model, args)
    for r in range(job["rounds"]):
        for label, pipe, batch, target in pipes:
            for _ in range(job["steps"]):
                times[label].append(one_step(pipe, batch, target))
        if job.get("profile_between_rounds"):
            from autopipe.planning.profile import profile_segments

            # The model profiled between two rounds of steps: a profile taken while the host
            # runs as fast, or as slow, as during the steps. Alternately in one process (rank 0;
            # the others wait) and in every rank at once with profile_in_ranks, each
            # rank's profile competing with the others for the host as their stages do.
            in_ranks = r % 2 == 1
            costs = None
            if in_ranks:
                from autopipe.planning.rank_profile import profile_in_ranks

                costs = profile_in_ranks(model, args, device=device, warmup=1,
                                         repeats=job.get("profile_repeats", 5))
            elif rank == 0:
                costs = profile_segments(traced, device=device, warmup=1,
                                         repeats=job.get("profile_repeats", 5), progress=False)
            if rank == 0:
                (in_ranks_profiles if in_ranks else profiles).append(segment_times(costs))
            dist.barrier()
    out: dict[str, Any] = {"times": times, "errors": {}, "profiles": profiles, "in_ranks_profiles": in_ranks_profiles,
                           "interpreter_modules": {label: [interpreter_modules(m) for m in pipe.stage_modules.values()]
                                                   for label, pipe, *_ in pipes}}

    if job.get("instrument"):
        # Stage compute timed inside running steps, by the library (what Plan.calibrate takes).
        out["in_run"] = {label: pipe.measure_stage_times(*batch, target=target, steps=job["instrument"])
                         for label, pipe, batch, target in pipes}
    if job.get("memory"):
        out["memory"] = {label: _measure_step_memory(pipe, batch, target, device)
                         for label, pipe, batch, target in pipes}
    if job.get("link_bytes") and world >= 2:
        out["link"] = link_probe(rank, job["link_bytes"], device, repeats=job.get("link_repeats", 10))
    dist.barrier()
    return out


def _measure_step_memory(pipe: Any, batch: tuple, target: torch.Tensor, device: torch.device) -> dict[str, int]:
    """Peak bytes on this rank during a training step with Adam, in the steady state.

    One untracked step + ``opt.step()`` first, so Adam's state exists; then gradients are
    dropped and one step runs under :class:`LiveBytes`. Static bytes = parameters, buffers
    and optimizer state alive before the step; dynamic = the high-water mark of what the
    step allocated (activations of the micro-batches in flight, gradients, temporaries,
    received tensors).
    """
    import torch.distributed as dist

    params = pipe.parameters()
    opt = torch.optim.Adam(params, lr=1e-6)
    pipe.zero_grad()
    pipe.step(*batch, target=target)
    opt.step()
    pipe.zero_grad()  # set_to_none: the step re-allocates gradients, and the tracker sees them
    state = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    buffers = [b for m in pipe.stage_modules.values() for b in m.buffers()]
    static_params = _tensor_bytes(list(params) + buffers)
    static_opt = _tensor_bytes(state)
    dist.barrier()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    tracker = LiveBytes()
    with tracker:
        pipe.step(*batch, target=target)
    result = {"param_buffer_bytes": static_params, "optimizer_bytes": static_opt, "step_peak_bytes": tracker.peak,
              "peak_bytes": static_params + static_opt + tracker.peak}
    if device.type == "cuda":
        result["cuda_peak_bytes"] = int(torch.cuda.max_memory_allocated(device) - base + static_params + static_opt)
    del opt
    pipe.zero_grad()
    return result


def link_probe(rank: int, sizes_bytes: Sequence[int], device: torch.device, *, repeats: int = 10,
               warmup: int = 3) -> dict[str, Any] | None:
    """One-way time of each message size between ranks 0 and 1, in the conditions of the run.

    Round trips with ``isend``/``irecv`` + ``wait`` as torch's pipeline stages move
    activations, the sizes taking turns within each round (as ``autopipe.machine.link`` does);
    half a round trip is one sample. The cut sizes themselves are measured, so a cut's time
    is read off directly (``one_way_s[size]``); ``autopipe.machine.link.fit_link`` adds a
    latency + bandwidth fit when the times allow one. Returns None on ranks other than 0 and 1.
    """
    import torch.distributed as dist

    from autopipe.machine.link import fit_link

    if rank > 1:
        return None
    sizes = sorted({max(1, int(b)) for b in sizes_bytes} | {1 << 10, 1 << 20, 1 << 23})
    peer = 1 - rank
    buffers = [torch.zeros(n, dtype=torch.uint8, device=device) for n in sizes]
    samples: list[list[float]] = [[] for _ in sizes]
    for i in range(warmup + repeats):
        for k, buf in enumerate(buffers):
            t0 = time.perf_counter()
            if rank == 0:
                dist.isend(buf, peer).wait()
                dist.irecv(buf, peer).wait()
            else:
                dist.irecv(buf, peer).wait()
                dist.isend(buf, peer).wait()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if i >= warmup:
                samples[k].append((time.perf_counter() - t0) / 2.0)
    one_way = [median(x) for x in samples]
    result: dict[str, Any] = {"sizes_bytes": sizes, "one_way_s": one_way, "samples_s": samples,
                              "by_size": {str(n): t for n, t in zip(sizes, one_way)},
                              "latency_s": None, "bandwidth_bytes_per_s": None}
    try:
        bw, lat, err = fit_link(sizes, one_way)
        result.update(latency_s=lat, bandwidth_bytes_per_s=bw, fit_error=err)
    except ValueError as e:  # times that do not grow with size (a busy machine): keep the raw medians
        result["fit_note"] = str(e).split(";")[0]
    return result
