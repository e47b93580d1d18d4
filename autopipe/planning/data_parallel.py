"""Pipeline x data parallel, planned together: which (pp, dp) factorization of the GPUs is fastest."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from ..errors import InfeasibleMemoryError
from ..machine.device import Device, default_link, optimizer_state_factor
from ..machine.topology import Topology
from . import costmodel
from .plan_records import DataParallelRecord, Factorization
from .plan import Plan
from .tracing import traces_reused

#: Accepted values of ``DataParallelOptions.mode`` when planning: one of the runtime's modes, or both compared.
DP_MODE_CHOICES = (*costmodel.DP_MODES, "auto")


def example_batch_size(example_args: Any, example_kwargs: Mapping[str, Any] | None) -> int | None:
    """The first dimension of the first tensor among the example inputs (None without one).

    Example:
            >>> example_batch_size((torch.zeros(4, 16),), None)
            4
    """
    for t in tree_flatten((example_args, dict(example_kwargs or {})))[0]:
        if isinstance(t, torch.Tensor) and t.dim() > 0:
            return int(t.shape[0])
    return None


def check_data_parallel(n_gpus: int, data_parallel: Any, dp_mode: Any, global_batch: Any, n_microbatches: Any,
                        devices: Any, batch_size: int | None) -> tuple[list[int], list[str]]:
    """The replica counts and modes to compare, or a ValueError naming the argument at fault.

    Example:
            >>> check_data_parallel(8, "auto", "fsdp", 64, None, None, batch_size=8)
            ([1, 2, 4, 8], ['fsdp'])
    """
    divisors = [d for d in range(1, n_gpus + 1) if n_gpus % d == 0]
    auto = isinstance(data_parallel, str) and data_parallel == "auto"
    if not auto and (isinstance(data_parallel, bool) or not isinstance(data_parallel, int)
                     or data_parallel not in divisors):
        raise ValueError(f"data_parallel={data_parallel!r} is not accepted; use 'auto' (compare every factorization "
                         f"pp x dp of n_gpus={n_gpus}) or a replica count dividing n_gpus: {divisors}")
    if dp_mode not in DP_MODE_CHOICES:
        raise ValueError(f"DataParallelOptions mode={dp_mode!r} is not accepted; use one of "
                         f"{list(DP_MODE_CHOICES)} ('fsdp': FSDP2 shards each stage over its replicas, "
                         "'replicate': whole copies and an all-reduce)")
    modes = list(costmodel.DP_MODES) if dp_mode == "auto" else [dp_mode]
    wanted = divisors if auto else [data_parallel]
    if wanted == [1]:
        return wanted, modes
    if global_batch is None:
        raise ValueError(f"data_parallel={data_parallel!r} needs global_batch= (samples per optimizer step over all "
                         "replicas): each replica trains on global_batch / dp of them")
    if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1:
        raise ValueError(f"global_batch={global_batch!r} must be an integer >= 1")
    auto_m = isinstance(n_microbatches, str) and n_microbatches.strip().lower() == "auto"
    if n_microbatches is not None and not auto_m:
        raise ValueError(f"n_microbatches={n_microbatches!r} cannot be fixed with data_parallel={data_parallel!r}: "
                         "each replica runs global_batch / (dp x example batch size) micro-batches; leave it None, "
                         "or 'auto' to choose the micro-batch size too")
    if devices is not None and not isinstance(devices, (Device, Topology)):
        raise ValueError("with data_parallel, devices= must be one Device (every rank alike) or a "
                         f"autopipe.machine.topology.Topology, not {type(devices).__name__}")
    if not auto_m and batch_size is None:
        raise ValueError("data_parallel needs example inputs with a batch dimension (their first dimension is the "
                         "micro-batch size); give example_args, or n_microbatches='auto'")
    unit = 1 if auto_m else batch_size
    fitting = [d for d in wanted if global_batch % (d * unit) == 0]
    if not fitting:
        raise ValueError(f"global_batch={global_batch} does not split into dp x micro-batches of {unit} sample(s) for "
                         f"any dp in {wanted}; use a multiple of {min(wanted) * unit}"
                         + ("" if auto_m else " (the example inputs' batch size is the micro-batch size)"))
    return wanted, modes


def reduction_s(plan: Plan, dp: int, mode: str, link: tuple[float, float]) -> float:
    """The slowest rank's data-parallel collectives per step: its stages' gradients over ``dp`` replicas."""
    per_rank: dict[int, float] = {}
    for stage, rank in zip(plan.stages, plan.stage_ranks):
        if plan.segments:
            grad = sum(s.trainable_param_bytes for s in plan.segments[stage.first_segment: stage.last_segment + 1])
        else:
            grad = stage.param_bytes
        per_rank[rank] = per_rank.get(rank, 0.0) + costmodel.dp_reduction_s(mode, grad, dp, *link)
    return max(per_rank.values(), default=0.0)


def _dp_link(devices: Device | Topology | None, pp: int, dp: int, device_type: str) -> tuple[float, float]:
    """The link a dp ring is charged at: the Topology's, else the Device's own link, else the default."""
    if isinstance(devices, Topology):
        return devices.dp_link(pp, dp)
    bandwidth, latency = default_link(device_type)
    if isinstance(devices, Device):
        bandwidth = devices.bandwidth if devices.bandwidth is not None else bandwidth
        latency = devices.latency_s if devices.latency_s is not None else latency
    return float(bandwidth), float(latency)


def plan_data_parallel(
    partition: Callable[..., Plan], model: torch.nn.Module, n_gpus: int, example_args: Any,
    example_kwargs: Mapping[str, Any] | None, *, data_parallel: int | str, dp_mode: str, global_batch: int | None,
    n_microbatches: int | str | None, devices: Device | Topology | None, optimizer: Any, **rest: Any,
) -> Plan:
    """Plan every (pp, dp, mode) with ``partition`` and keep the fastest that fits."""
    b = example_batch_size(example_args, example_kwargs)
    dps, modes = check_data_parallel(n_gpus, data_parallel, dp_mode, global_batch, n_microbatches, devices, b)
    opt_name, opt_factor = optimizer_state_factor(optimizer)
    auto_m = isinstance(n_microbatches, str)
    rows: list[Factorization] = []
    plans: dict[int, Plan] = {}  # id(row) -> its pipeline plan
    errors: list[Exception] = []
    with traces_reused():  # every layout's pipeline is planned from the model's one trace
        for dp in dps:
            pp = n_gpus // dp
            topo = isinstance(devices, Topology)
            crossing = devices.crossing(pp, dp) if topo else ""
            for mode in (modes if dp > 1 else [""]):
                row = Factorization(pp=pp, dp=dp, mode=mode, crossing=crossing)
                rows.append(row)
                if global_batch is not None and global_batch % (dp * (1 if auto_m else b)):
                    row.reason = (f"skipped: global_batch={global_batch} is not a multiple of dp x micro-batch size "
                                  f"= {dp} x {b}")
                    continue
                kwargs = dict(rest, devices=devices.pipeline_devices(pp, dp) if topo else devices,
                              optimizer=costmodel.dp_optimizer_factor(opt_factor, dp, mode or "replicate"))
                if global_batch is not None:
                    kwargs["global_batch"] = global_batch // dp
                    kwargs["n_microbatches"] = "auto" if auto_m else global_batch // (dp * b)
                elif n_microbatches is not None:
                    kwargs["n_microbatches"] = n_microbatches
                try:
                    sub = partition(model, pp, example_args, example_kwargs, **kwargs)
                except (InfeasibleMemoryError, ValueError) as e:
                    errors.append(e)
                    row.reason = ("does not fit: " if isinstance(e, InfeasibleMemoryError) else "skipped: ") + str(e)
                    row.min_memory_bytes = getattr(e, "min_memory_bytes", None)
                    continue
                link = _dp_link(devices, pp, dp, "cuda" if sub.device.startswith("cuda") else "cpu")
                row.n_microbatches, row.schedule = sub.n_microbatches, sub.schedule
                row.pipeline_step_s = sub.predicted_step_s
                row.reduction_s = reduction_s(sub, dp, mode or "replicate", link)
                row.peak_bytes = int(max(sub.rank_peak_bytes or [s.peak_bytes for s in sub.stages]))
                row.fits = True
                sub.optimizer = opt_name
                plans[id(row)] = sub
                sub.dp_degree, sub.dp_mode = dp, mode
                sub.global_batch = global_batch
                sub.data_parallel = DataParallelRecord(mode=mode, reduction_s=row.reduction_s, dp_bandwidth=link[0],
                                                       dp_latency_s=link[1], crossing=crossing)
    usable = sorted((r for r in rows if r.fits), key=lambda r: (r.step_s, r.peak_bytes, r.pp))
    if not usable:
        detail = "; ".join(f"pp={r.pp} x dp={r.dp}{' ' + r.mode if r.mode else ''}: {r.reason}" for r in rows)
        if any(isinstance(e, InfeasibleMemoryError) for e in errors):
            needs = [r.min_memory_bytes for r in rows if r.min_memory_bytes is not None]
            raise InfeasibleMemoryError(f"no pp x dp factorization of n_gpus={n_gpus} fits: {detail}",
                                        min_memory_bytes=min(needs, default=None), factorizations=rows)
        if len({str(e) for e in errors}) == 1:
            raise errors[0]  # the same reason everywhere: a bad argument, unchanged
        raise ValueError(f"no pp x dp factorization of n_gpus={n_gpus} can be planned: {detail}")
    best = usable[0]
    for r in usable[1:]:
        r.reason = f"slower: {r.step_s / best.step_s - 1:.1%} over pp={best.pp} x dp={best.dp}"
    plan = plans[id(best)]
    record = plan.data_parallel
    assert record is not None
    record.factorizations = usable + [r for r in rows if not r.fits]
    plan.notes = [*plan.notes, _note(plan, best)]
    return plan


def _note(plan: Plan, best: Factorization) -> str:
    """One sentence for ``plan.notes``: the factorization chosen, its reduction and the links."""
    record = plan.data_parallel
    assert record is not None
    where = {"": "", "none": "; every rank in one node", "dp": "; the dp groups cross nodes, the pipelines do not",
             "pp": "; the pipelines cross nodes, the dp groups do not",
             "both": "; both the pipelines and the dp groups cross nodes"}[best.crossing]
    if best.dp == 1:
        return f"pipeline x data parallel: pp={best.pp} x dp=1 chosen (no replicas, no gradient reduction){where}"
    return (f"pipeline x data parallel: pp={best.pp} x dp={best.dp} ({best.mode}) chosen; its gradient reduction, "
            f"{best.reduction_s * 1e3:.3g} ms at {record.dp_bandwidth / 1e9:.3g} GB/s, is charged after the step, "
            f"not overlapped{where}")

