"""Profile while other ranks compute: the contention of pipeline ranks sharing one host.

Part of the profiling step of the data flow. When the ranks of a pipeline are processes on
one machine (CPU ranks; the benchmarks and tests here), each rank's stage competes with the
others for the host's memory bandwidth and shared caches. A profile taken in one process
with the host otherwise idle does not see that. On this project's 2-core host, profiles
that both ranks took at the same time predicted 2-rank steps to 4.8% and 8.0% median
|error| in two runs of ``benchmarks/prediction_accuracy``, where profiles one rank took
alone predicted 11.4% and 11.3% (the ``paired_profile`` and ``same_time`` columns). The
difference was largest for the memory-bound models (U-Net, MLP: about 20 points).

:func:`ranks_alongside` starts helper processes that profile the same model over and over
on the same device, the way the other ranks' stages would load the host, until the block
ends. :func:`autopipe.profile.profile_segments` uses it for ``alongside=N``. GPUs do not
need it: each rank has a device of its own.

Example:
    >>> from autopipe.models import seed_transformer
    >>> from autopipe.trace import trace
    >>> from autopipe.profile import profile_segments
    >>> model, args = seed_transformer(vocab_size=100, num_layers=1, seq_len=8)
    >>> costs = profile_segments(trace(model, args), device="cpu", repeats=1, progress=False,
    ...                          alongside=1)  # doctest: +SKIP
"""

from __future__ import annotations

import os
import tempfile
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.multiprocessing as mp

from .trace import TracedModel

__all__ = ["ranks_alongside", "check_alongside"]

#: Seconds a helper may take to load the model and finish its first profile.
DEFAULT_READY_TIMEOUT_S = 300.0


def check_alongside(alongside: Any, device: torch.device) -> None:
    """Raise ``ValueError`` unless ``alongside`` is an integer >= 0, and 0 on a device other than the CPU."""
    if isinstance(alongside, bool) or not isinstance(alongside, int) or alongside < 0:
        raise ValueError(f"alongside={alongside!r} must be an integer >= 0 (the other ranks sharing this host)")
    if alongside and device.type != "cpu":
        raise ValueError(f"alongside={alongside} profiles with other processes on the same device, which is for "
                         f"CPU ranks sharing a host; on {device} each rank has a device of its own: use alongside=0")


def _helper(workdir: str, index: int, device: str, threads: int, flush_cache: bool, ready: Any, stop: Any) -> None:
    """In a spawned process: train the saved model's whole graph on one micro-batch, again and again, until ``stop``.

    Forward, then backward into ``.grad`` (accumulating, as a stage does), the caches emptied
    before each pass as the profile empties its own: a steady load with the model's working
    set, stoppable between passes.
    """
    try:
        torch.set_num_threads(threads)
        from torch.utils._pytree import tree_leaves

        from .profile import CacheFlusher

        dev = torch.device(device)
        module = torch.export.load(os.path.join(workdir, "model.pt2")).module().to(dev)
        args, kwargs = torch.load(os.path.join(workdir, "inputs.pt"), weights_only=True)
        args = [a.to(dev) if isinstance(a, torch.Tensor) else a for a in args]
        flush = CacheFlusher(dev) if flush_cache else (lambda: None)
        while not stop.is_set():
            flush()
            outs = [o for o in tree_leaves(module(*args, **kwargs)) if isinstance(o, torch.Tensor) and o.requires_grad]
            flush()
            if outs:
                torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
            ready.set()
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises it
        with open(os.path.join(workdir, f"helper{index}.err"), "w", encoding="utf-8") as f:
            f.write(traceback.format_exc())
        os._exit(1)
    os._exit(0)


def _helper_error(workdir: str, index: int, proc: Any) -> str:
    path = os.path.join(workdir, f"helper{index}.err")
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            lines = f.read().strip().splitlines()
        return lines[-1] if lines else "no message"
    return f"exit code {proc.exitcode}"


@contextmanager
def ranks_alongside(traced: TracedModel, n: int, *, device: str | torch.device = "cpu", flush_cache: bool = True,
                    ready_timeout_s: float = DEFAULT_READY_TIMEOUT_S) -> Iterator[None]:
    """Run ``n`` helper processes that profile ``traced`` over and over while the block runs.

    Each helper loads the model (saved with ``torch.export.save``) and runs its forward and
    backward on the example micro-batch again and again, with this process's number of torch
    threads, as a neighbouring rank runs its stage. The block starts once every helper has
    finished one pass; on leaving it the helpers are stopped (killed after 30 s). Nothing of
    the user's model is shared with them.

    Args:
        traced: The model, as :func:`autopipe.trace.trace` returns it.
        n: Helper processes: the other ranks that will share this host (``n_ranks - 1``).

    Keyword Args:
        device: Where the helpers profile (the CPU).
        flush_cache: As for :func:`autopipe.profile.profile_segments`.
        ready_timeout_s: Longest wait for the helpers' first profiles.

    Raises:
        ValueError: ``n`` is not an integer >= 0, or ``device`` is not the CPU with ``n > 0``.
        RuntimeError: a helper failed or was not ready in time (its last error line included).

    Example:
        >>> with ranks_alongside(traced, 1):  # doctest: +SKIP
        ...     costs = profile_segments(traced, device="cpu", progress=False)
    """
    dev = torch.device(device)
    check_alongside(n, dev)
    if n == 0:
        yield
        return
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="autopipe-alongside-") as workdir:
        torch.export.save(traced.exported, os.path.join(workdir, "model.pt2"))
        torch.save((traced.example_args, traced.example_kwargs), os.path.join(workdir, "inputs.pt"))
        stop = ctx.Event()
        ready = [ctx.Event() for _ in range(n)]
        procs = [ctx.Process(target=_helper, args=(workdir, i, str(dev), torch.get_num_threads(), flush_cache,
                                                   ready[i], stop), daemon=True) for i in range(n)]
        for p in procs:
            p.start()
        try:
            deadline = time.monotonic() + ready_timeout_s
            for i, (p, event) in enumerate(zip(procs, ready)):
                while not event.wait(0.2):
                    if not p.is_alive():
                        raise RuntimeError(f"a process profiling alongside (helper {i}) failed: "
                                           f"{_helper_error(workdir, i, p)}")
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"a process profiling alongside (helper {i}) was not ready after "
                                           f"ready_timeout_s={ready_timeout_s}")
            yield
        finally:
            stop.set()
            for p in procs:
                p.join(30)
                if p.is_alive():  # stopping may not hang the caller either
                    p.kill()
                    p.join(10)
