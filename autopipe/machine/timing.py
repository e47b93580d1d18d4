"""Time work on a device: a clock right on CPU and CUDA, caches emptied between runs, steps compared by round.

Example:
    >>> timer = Timer(resolve_device("cpu"))
    >>> seconds, total = timer.time(lambda: sum(range(10)))
    >>> total, per_run_s([seconds]) >= 0
    (45, True)
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

from .device import parse_bytes

def resolve_device(device: str | torch.device | None) -> torch.device:
    """The device to profile on: the given one, else CUDA when present, else CPU.

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


def synchronize(device: torch.device) -> None:
    """Wait until ``device`` has done the work queued on it (CUDA); nothing to wait for elsewhere.

    Example:
        >>> synchronize(torch.device("cpu"))
    """
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def per_run_s(samples: Sequence[float]) -> float:
    """The seconds one run of a piece of work is charged, from its timed runs: their mean.

    Example:
        >>> round(per_run_s([0.010, 0.010, 0.013]), 6)
        0.011
    """
    values = [float(x) for x in samples]
    if not values:
        raise ValueError("samples=[] is empty; per_run_s needs at least one timed run")
    return statistics.fmean(values)


def paired_ratio(steps: Sequence[float], reference: Sequence[float]) -> float:
    """The median over rounds of ``steps[i] / reference[i]``: two variants' steps, paired as they were interleaved.

    Interleaved variants run their i-th steps within the same round, so each pair saw the
    same state of the host; the median of the paired ratios leaves out the drift between
    rounds that a ratio of two pooled medians keeps.

    Example:
        >>> paired_ratio([2.0, 4.0, 6.0], [1.0, 2.0, 2.0])
        2.0
    """
    ratios = [a / b for a, b in zip(steps, reference) if b > 0]
    if not ratios:
        raise ValueError("paired_ratio needs at least one round with a positive reference step")
    return float(statistics.median(ratios))


def paired_ratio_interval(steps: Sequence[float], reference: Sequence[float], *, level: float = 0.95,
                          resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """A bootstrap interval of :func:`paired_ratio`: the rounds' pairs drawn again with replacement.

    How far the ratio of a few paired steps can be trusted within the run they come from: where
    the interval holds 1, these steps do not say which variant is faster. Another run, on a
    host in another state, can move the ratio beyond it. Seeded, so every rank computes the
    same interval.

    Example:
        >>> paired_ratio_interval([1.0, 1.1, 1.2, 1.05], [1.0, 1.0, 1.0, 1.0])
        (1.0, 1.2)
    """
    pairs = torch.tensor([a / b for a, b in zip(steps, reference) if b > 0], dtype=torch.float64)
    if not len(pairs):
        raise ValueError("paired_ratio_interval needs at least one round with a positive reference step")
    draw = torch.randint(len(pairs), (resamples, len(pairs)), generator=torch.Generator().manual_seed(seed))
    ordered = pairs[draw].sort(dim=1).values
    n = len(pairs)
    medians = (ordered[:, (n - 1) // 2] + ordered[:, n // 2]) / 2  # statistics.median's, as paired_ratio takes it
    tail = (1.0 - level) / 2
    low, high = torch.quantile(medians, torch.tensor([tail, 1.0 - tail], dtype=torch.float64)).tolist()
    return float(low), float(high)


def fastest_paired(steps: dict[Any, Sequence[float]], start: Any = None) -> tuple[Any, dict[Any, float]]:
    """The variant no other beats by :func:`paired_ratio`, and every variant's ratio over it (itself 1.0).

    Variant ``a`` beats ``b`` when ``paired_ratio(steps[a], steps[b]) < 1``. Medians of ratios
    need not be transitive: three variants can beat each other in a circle, and then none is
    unbeaten. The choice is ``start`` (default: the variant with the lowest median step) when
    nothing beats it or nothing is unbeaten; otherwise the unbeaten variant (of several tied
    ones, the lowest median).

    Example:
        >>> fastest_paired({"a": [1.0, 2.0, 1.0], "b": [0.9, 1.8, 1.2]})
        ('b', {'a': 1.1111111111111112, 'b': 1.0})
    """
    by_median = sorted(steps, key=lambda k: statistics.median(steps[k]))
    start = by_median[0] if start is None else start
    over = {ref: {k: paired_ratio(v, steps[ref]) for k, v in steps.items()} for ref in steps}
    unbeaten = [ref for ref in by_median if min(over[ref].values()) >= 1.0]
    chosen = start if start in unbeaten or not unbeaten else unbeaten[0]
    return chosen, over[chosen]


class TimerLike(Protocol):
    """What the timing functions need of a timer: its device and ``time(fn) -> (seconds, result)``."""

    device: torch.device

    def time(self, fn: Callable[[], Any]) -> tuple[float, Any]:
        """Run ``fn`` once; return (seconds, its result)."""
        ...


class Timer:
    """Wall-clock timing that is correct on CPU and CUDA (events after a synchronisation).

    Example:
        >>> seconds, value = Timer(torch.device("cpu")).time(lambda: 6 * 7)
        >>> value, seconds >= 0
        (42, True)
    """

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
#: The environment variable that sets the cache size in place of what the device reports.
LLC_BYTES_ENV = "AUTOPIPE_LLC_BYTES"


def last_level_cache_bytes(device: torch.device) -> int:
    """The size of ``device``'s largest cache in bytes: the GPU's L2, the CPU's last level.

    ``AUTOPIPE_LLC_BYTES`` (a size such as ``"32MiB"``, read as
    :func:`~autopipe.machine.device.parse_bytes` reads it) is taken instead where set: a
    virtual machine's ``/sys`` can report the whole socket's L3, of which it holds a share.

    Raises:
        ValueError: ``AUTOPIPE_LLC_BYTES`` is set but is not a size (the message names it).

    Example:
        >>> last_level_cache_bytes(torch.device("cpu")) > 0
        True
    """
    given = os.environ.get(LLC_BYTES_ENV, "").strip()
    if given:
        return parse_bytes(given, name=LLC_BYTES_ENV)
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

    Example:
        >>> flush = CacheFlusher(torch.device("cpu"))
        >>> flush()
        >>> flush.nbytes >= 2 * (1 << 20)
        True
    """

    def __init__(self, device: torch.device, nbytes: int | None = None) -> None:
        self.nbytes = int(nbytes) if nbytes is not None else 2 * last_level_cache_bytes(device)
        self.buffer = torch.empty(self.nbytes, dtype=torch.uint8, device=device)
        self._value = 0

    def __call__(self) -> None:
        self._value ^= 1  # a different value each time: every line is written, none skipped
        self.buffer.fill_(self._value)
