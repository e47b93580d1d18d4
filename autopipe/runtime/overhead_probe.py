"""Measure what running a pipeline costs beyond its compute: the runtime's seconds per action.

Example:
    >>> from autopipe.planning.simulator import simulate
    >>> step = simulate([0.0, 0.0], [0.0, 0.0], schedule="GPipe", n_microbatches=4, comm_s=0.0,
    ...                 action_overhead_s=1e-3).step_s
    >>> round(fit_action_overhead(step, "GPipe", 1, 2, 4, 0.0), 9)
    0.001
"""

from __future__ import annotations

import statistics
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from .._checks import check_int
from .._spawn import check_timeout_s, finish_rank, join_loopback_world, run_ranks
from ..machine.device import default_link, sends_are_lazy
from ..machine.passes import time_alone
from ..machine.timing import Timer, synchronize
from ..planning.costmodel import cut_time_s
from ..planning.schedules import canonical_schedule_name, validate_schedule
from ..planning.simulator import simulate, solve_increasing
from .pipeline import Pipeline
from ..planning.options import PlannerOptions

#: Schedules the overhead probe runs by default, with their stages per rank.
OVERHEAD_SCHEDULES = (("GPipe", 1), ("1F1B", 1), ("Interleaved1F1B", 2), ("ZBVZeroBubble", 2))
# The probe model: linear layers wide enough that every rank really computes while it waits
# on its peers (a rank's wake-up after a message is slower when the other core is busy).
_PROBE_WIDTH = 256
_PROBE_LAYERS = 8
_PROBE_ROWS = 64  # rows per micro-batch


@dataclass
class OverheadMeasurement:
    """What running a pipeline costs beyond the stages' compute and the link's transfers.

    Example:
        >>> m = OverheadMeasurement(action_overhead_s=5e-4, per_schedule_s={"1F1B-1": 5e-4}, step_s={"1F1B-1": 0.02},
        ...                         n_microbatches=4, concurrent_slowdown=1.1, n_ranks=2, backend="gloo", device="cpu")
        >>> m.summary()  # doctest: +ELLIPSIS
        '0.50 ms per action (median; 1F1B-1 0.50 ms); ranks computing at once take 1.10x as long ...'
    """

    action_overhead_s: float  # median over the schedules of the per-action overhead
    per_schedule_s: dict[str, float]  # "schedule-stages per rank" -> seconds per action
    step_s: dict[str, float]  # the probe's median measured step per schedule
    n_microbatches: int
    concurrent_slowdown: float  # a rank's compute time with every rank computing / alone
    n_ranks: int
    backend: str
    device: str

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of every field."""
        return asdict(self)

    def summary(self) -> str:
        """One line: the overhead per action and the slowdown of ranks computing together."""
        parts = ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in self.per_schedule_s.items())
        return (f"{self.action_overhead_s * 1e3:.2f} ms per action (median; {parts}); ranks computing at once "
                f"take {self.concurrent_slowdown:.2f}x as long as alone ({self.n_ranks} x {self.device}, {self.backend})")


def fit_action_overhead(step_s: float, schedule: str, stages_per_rank: int, n_ranks: int,
                        n_microbatches: int, comm_s: float, fwd_s: Sequence[float] | None = None,
                        bwd_s: Sequence[float] | None = None, lazy_sends: bool = False) -> float:
    """The per-action overhead o with which the simulated step is ``step_s``.

    Example:
        >>> from autopipe.planning.simulator import simulate
        >>> step = simulate([0.0, 0.0], [0.0, 0.0], schedule="1F1B", n_microbatches=4, comm_s=1e-4,
        ...                 action_overhead_s=2e-3).step_s
        >>> round(fit_action_overhead(step, "1F1B", 1, 2, 4, 1e-4), 9)
        0.002
    """
    n_stages = n_ranks * stages_per_rank
    fwd = list(fwd_s) if fwd_s is not None else [0.0] * n_stages
    bwd = list(bwd_s) if bwd_s is not None else [0.0] * n_stages

    def simulated(o: float) -> float:
        return simulate(fwd, bwd, schedule=schedule, n_microbatches=n_microbatches,
                        stages_per_rank=stages_per_rank, comm_s=comm_s, action_overhead_s=o,
                        lazy_sends=lazy_sends).step_s

    return solve_increasing(simulated, step_s, hi=step_s)  # the step grows with o; at o = step_s it is >= step_s


def _compute_probe_s(device: torch.device, repeats: int) -> list[float]:
    """Seconds of a fixed burst of matmuls and element-wise work, ``repeats`` times."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(512, 512, generator=g).to(device)
    b = torch.randn(512, 512, generator=g).to(device)
    out = []
    for _ in range(repeats):
        synchronize(device)
        t0 = time.perf_counter()
        x = a
        for _ in range(6):
            x = torch.tanh(x @ b) + a
        synchronize(device)
        out.append(time.perf_counter() - t0)
    return out


def _stage_compute_s(layers: list, device: torch.device, repeats: int = 7) -> tuple[float, float]:
    """Forward and backward seconds (:func:`~autopipe.machine.timing.per_run_s`) of one probe stage on
    one micro-batch, alone.
    """
    stage = nn.Sequential(*layers)
    return time_alone(stage, lambda: [torch.randn(_PROBE_ROWS, _PROBE_WIDTH, device=device, requires_grad=True)],
                       list(stage.parameters()), Timer(device), warmup=2, repeats=repeats)


def _overhead_worker(rank: int, port: int, n_ranks: int, backend: str, device_type: str,
                     schedules: list[tuple[str, int]], n_microbatches: int, steps: int, timeout_s: float,
                     out_dir: str) -> None:
    """One rank of :func:`measure_action_overhead`: step times per schedule, compute alone and together."""
    torch.set_num_threads(1)  # the ranks share the host's cores, as in a CPU pipeline
    try:
        dev = torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        join_loopback_world(rank, n_ranks, port, backend=backend, timeout_s=timeout_s)
        g = torch.Generator().manual_seed(0)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = nn.Sequential(*[nn.Linear(_PROBE_WIDTH, _PROBE_WIDTH) for _ in range(_PROBE_LAYERS)])
        x = torch.randn(_PROBE_ROWS * n_microbatches, _PROBE_WIDTH, generator=g)
        y = torch.randn(_PROBE_ROWS * n_microbatches, _PROBE_WIDTH, generator=g)
        # The same compute burst on each rank alone, then on every rank at once, in rounds
        # spread over the whole measurement (two before each schedule's probe, two at the
        # end): a round disturbed by another job on the host is outvoted by the others, and a
        # disturbance lasting a few seconds cannot fall on every round (docs/design.md, finding 9).
        alone: list[float] = []
        together: list[float] = []

        def in_turn(work: Callable[[], Any]) -> Any:
            """Run ``work`` on each rank in turn while the others wait; this rank's result."""
            result = None
            for turn in range(n_ranks):
                dist.barrier()
                if turn == rank:
                    result = work()
            dist.barrier()
            return result

        def compare_rounds(count: int = 2) -> None:
            for _ in range(count):
                alone.append(in_turn(lambda: statistics.median(_compute_probe_s(dev, 3))))
                together.append(statistics.median(_compute_probe_s(dev, 3)))

        steps_s: dict[str, list[float]] = {}
        compute_s: dict[str, tuple[list[float], list[float]]] = {}
        for schedule, v in schedules:
            compare_rounds()
            n_stages = n_ranks * v
            edges = [_PROBE_LAYERS * k // n_stages for k in range(n_stages + 1)]
            splits = [str(e) for e in edges[1:-1]]
            # Each stage's compute alone, what the simulation is given (times the slowdown):
            # the ranks take turns, so no rank's timing competes with another's (it would
            # then count the contention twice, once here and once in the slowdown).
            per_stage = in_turn(lambda: [_stage_compute_s(list(model)[a:b], dev) for a, b in zip(edges, edges[1:])])
            compute_s[f"{schedule}-{v}"] = ([f for f, _ in per_stage], [b for _, b in per_stage])
            pipe = Pipeline(model, example_args=(x[:_PROBE_ROWS],), loss_fn=nn.functional.mse_loss,
                            split_points=splits, schedule=schedule, n_microbatches=n_microbatches,
                            device=dev, planner=PlannerOptions(stages_per_rank=v))
            times = []
            for i in range(steps + 2):  # two warm-up steps
                dist.barrier()
                t0 = time.perf_counter()
                pipe.step(x, target=y)
                synchronize(dev)
                elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # a step ends when its last rank ends
                if i >= 2:
                    times.append(float(elapsed))
            steps_s[f"{schedule}-{v}"] = times
        compare_rounds()

        result: tuple[str, Any] = ("ok", {"steps_s": steps_s, "compute_s": compute_s, "alone_s": alone,
                                          "together_s": together})
    except BaseException as e:  # noqa: BLE001 - everything goes back to the parent
        result = ("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
    finish_rank(out_dir, rank, result)


def measure_action_overhead(
    *,
    device: str | None = None,
    n_ranks: int = 2,
    schedules: Sequence[tuple[str, int]] = OVERHEAD_SCHEDULES,
    n_microbatches: int = 4,
    steps: int = 10,
    timeout_s: float = 300.0,
) -> OverheadMeasurement:
    """Measure the runtime's cost per pipeline action and the slowdown of ranks computing together.

    Starts ``n_ranks`` processes on loopback (gloo on CPU, NCCL on GPUs). They time a fixed
    burst of matmuls on each rank alone and on all ranks at once, in rounds spread over the
    whole measurement (before each schedule's probe and at the end): the ratio is how much
    slower stages compute when their devices share a host (about 1.0 on separate GPUs, above
    1 for CPU processes sharing cores and memory bandwidth). Then they run
    :class:`autopipe.Pipeline` on a probe model (eight 256-wide linear layers, 64 rows per
    micro-batch) under each schedule, time each of its stages alone, and find for each
    schedule the seconds per action that make the simulated step (stage times x slowdown,
    the default link) equal the measured median step. The probe computes for real, so what
    is left is the runtime's cost as it is when the ranks are busy: waking a rank whose
    peer's message arrived while the other cores compute costs more than on an idle host.

    Keyword Args:
        device: "cpu" or "cuda" (one GPU per rank); default CUDA when ``n_ranks`` GPUs are
            visible, else the CPU.
        n_ranks: Processes, >= 2.
        schedules: (schedule, stages per rank) pairs to run.
        n_microbatches: Micro-batches per step; every schedule must accept it.
        steps: Timed steps per schedule (after two warm-up steps).
        timeout_s: The whole measurement is stopped after this many seconds.

    Returns:
        An :class:`OverheadMeasurement`.

    Raises:
        ValueError: bad counts, an unknown schedule or device, too few GPUs.
        TimeoutError: the measurement did not finish in ``timeout_s``.
        RuntimeError: a rank failed (the message holds its traceback).

    Example:
        >>> m = measure_action_overhead(schedules=[("1F1B", 1)], steps=3)  # doctest: +SKIP
        >>> plan = autopipe.partition(model, 2, example_args=(x,),  # doctest: +SKIP
        ...     planner=autopipe.PlannerOptions(devices=autopipe.Device(action_overhead_s=m.action_overhead_s)))
    """
    n_ranks = check_int("n_ranks", n_ranks, 2)
    n_microbatches = check_int("n_microbatches", n_microbatches, 1)
    steps = check_int("steps", steps, 1)
    timeout_s = check_timeout_s(timeout_s)
    if isinstance(schedules, (str, bytes)) or not schedules:
        raise ValueError(f"schedules={schedules!r} must be a non-empty list of (schedule, stages_per_rank) pairs")
    pairs = []
    for item in schedules:
        if not (isinstance(item, (tuple, list)) and len(item) == 2):
            raise ValueError(f"schedules entry {item!r} must be a (schedule, stages_per_rank) pair, e.g. ('1F1B', 1)")
        name, v = canonical_schedule_name(item[0]), check_int("stages_per_rank", item[1], 1)
        if n_ranks * v > _PROBE_LAYERS:
            raise ValueError(f"schedules entry {item!r}: {n_ranks * v} stages, but the probe model has {_PROBE_LAYERS} layers")
        validate_schedule(name, n_ranks, n_microbatches, v)
        pairs.append((name, v))
    if device is None:
        device = "cuda" if torch.cuda.is_available() and torch.cuda.device_count() >= n_ranks else "cpu"
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r} must be 'cpu' or 'cuda'")
    if device == "cuda" and torch.cuda.device_count() < n_ranks:
        raise ValueError(f"device='cuda' needs {n_ranks} GPUs (one per rank); {torch.cuda.device_count()} visible")
    backend = "nccl" if device == "cuda" else "gloo"
    results = run_ranks(
        _overhead_worker, n_ranks,
        lambda rank, port, out_dir: (rank, port, n_ranks, backend, device, pairs, n_microbatches, steps,
                                     timeout_s, out_dir),
        timeout_s=timeout_s, what="overhead", advice="run fewer schedules or steps",
    )
    bandwidth, latency = default_link(device)
    probe_bytes = _PROBE_ROWS * _PROBE_WIDTH * 4  # one micro-batch's activation, and its gradient back
    comm_s = cut_time_s(probe_bytes, probe_bytes, bandwidth, latency)
    # Per rank and round, together / alone; the median over all of them.
    slowdown = statistics.median(t / a for r in results for t, a in zip(r["together_s"], r["alone_s"]))
    step_s, per_schedule = {}, {}
    for name, v in pairs:
        key = f"{name}-{v}"
        step_s[key] = statistics.median(results[0]["steps_s"][key])
        # Stage compute: the median over ranks of each stage timed alone, slowed as when all compute.
        fwd = [statistics.median(r["compute_s"][key][0][s] for r in results) * slowdown for s in range(n_ranks * v)]
        bwd = [statistics.median(r["compute_s"][key][1][s] for r in results) * slowdown for s in range(n_ranks * v)]
        per_schedule[key] = fit_action_overhead(step_s[key], name, v, n_ranks, n_microbatches, comm_s, fwd, bwd,
                                                 lazy_sends=sends_are_lazy(device))
    return OverheadMeasurement(
        action_overhead_s=statistics.median(per_schedule.values()), per_schedule_s=per_schedule, step_s=step_s,
        n_microbatches=n_microbatches, concurrent_slowdown=slowdown, n_ranks=n_ranks, backend=backend,
        device=device,
    )
