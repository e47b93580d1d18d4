"""Profile the model in every rank at once: the costs as the ranks will see them.

Example:
    >>> costs = profile_in_ranks(model, (x_microbatch,), device="cpu")            # doctest: +SKIP
    >>> plan = autopipe.partition(model, dist.get_world_size(), (x_microbatch,),  # doctest: +SKIP
    ...     planner=autopipe.PlannerOptions(cost=costs, profiling=autopipe.ProfileOptions(device="cpu")))
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from ..machine.timing import per_run_s, resolve_device
from .profile import SegmentCosts, check_fit_to_whole, check_flush_cache, check_runs, profile_segments
from .tracing import trace

def profile_in_ranks(
    model: torch.nn.Module,
    example_args: Sequence[Any] | Any | None = None,
    example_kwargs: Mapping[str, Any] | None = None,
    *,
    device: str | torch.device | None = None,
    warmup: int = 1,
    repeats: int = 15,
    flush_cache: bool = True,
    fit_to_whole: bool | None = None,
) -> SegmentCosts:
    """Profile ``model`` in every rank at the same time; every rank gets the mean of their profiles.

    Collective: every rank of the default process group calls it, with the same model and
    one micro-batch of inputs. Each rank traces the model; then, after a barrier, all run
    :func:`autopipe.planning.profile.profile_segments` at once, each on its device (on CUDA the
    current one: set it per rank first, as for training); each segment's
    forward, backward and accumulation seconds are then the mean over the ranks (the sizes
    and bytes are the same everywhere). Pass the result to ``autopipe.partition(...,
    cost=)``: the same costs give the same plan on every rank.

    Args:
        model: The whole model (every rank has it before it is split); left unchanged.
        example_args, example_kwargs: One micro-batch of inputs, as for :func:`autopipe.partition`.

    Keyword Args:
        device: Where each rank profiles (default: CUDA when present, else the CPU).
        warmup, repeats, flush_cache, fit_to_whole: As for :func:`autopipe.planning.profile.profile_segments`.

    Returns:
        Per segment, the ranks' mean costs, as :func:`autopipe.planning.profile.profile_segments` returns them.

    Raises:
        RuntimeError: no process group has been started.
        ValueError: as :func:`autopipe.planning.profile.profile_segments`, on every rank, before any profiling.

    Example:
        >>> costs = profile_in_ranks(model, (x,), device="cpu")  # doctest: +SKIP
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("profile_in_ranks() is collective: start the process group first "
                           "(torch.distributed.init_process_group, or run under torchrun / autopipe run)")
    # Every rank checks what it was given before any rank waits on the others.
    dev = resolve_device(device)
    check_runs(warmup, repeats)
    check_flush_cache(flush_cache)
    check_fit_to_whole(fit_to_whole)
    traced = trace(model, example_args, example_kwargs)
    dist.barrier()  # every rank starts profiling at the same moment, as their stages will run
    mine = profile_segments(traced, device=dev, warmup=warmup, repeats=repeats, progress=False,
                            flush_cache=flush_cache, fit_to_whole=fit_to_whole)
    times = [(c.fwd_s, c.bwd_s, c.accum_s) for c in mine]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, times)
    merged = SegmentCosts(
        replace(c, fwd_s=per_run_s([g[k][0] for g in gathered]), bwd_s=per_run_s([g[k][1] for g in gathered]),
                accum_s=per_run_s([g[k][2] for g in gathered]))
        for k, c in enumerate(mine))
    merged.whole = mine.whole  # this rank's whole pass, for the report
    return merged
