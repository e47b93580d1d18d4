"""Measure how fast a device computes, and build the measured ``Device`` list for the planner.

Example:
    >>> measure_device_speed("cpu", reference="cpu")
    1.0
"""

from __future__ import annotations

import functools
import math
import statistics
from collections.abc import Sequence

import torch

from .._checks import check_int
from .._spawn import check_timeout_s
from .device import Device, parse_bytes
from .link import DEFAULT_SIZES_BYTES, LinkMeasurement, check_sizes_bytes, measure_link
from .timing import Timer, resolve_device

def measure_device_flops(device: str | torch.device | None = None, *, size: int = 1024, repeats: int = 5) -> float:
    """Measured float32 matmul throughput of ``device`` in FLOP/s (median of ``repeats``).

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


def counting_flops(device: str | torch.device) -> float:
    """The FLOP rate that turns counted FLOPs into seconds on ``device``: measured once per process.

    Example:
        >>> counting_flops("cpu") == counting_flops("cpu")
        True
    """
    return _counting_flops(str(resolve_device(device)))


@functools.lru_cache(maxsize=None)
def _counting_flops(device: str) -> float:
    return measure_device_flops(device)


def measure_device_speed(
    device: str | torch.device | None = None,
    *,
    reference: float | str | torch.device | None = None,
) -> float:
    """Compute speed of ``device`` relative to ``reference``, from matmul throughput.

    ``Device.speed`` is relative to the device the profile was measured on, so the
    reference should be that device. Both are measured with
    :func:`measure_device_flops` (float32 matmuls).

    Args:
        device: The device to rate; default CUDA when present, else the CPU.

    Keyword Args:
        reference: FLOP/s, or a device to measure; default the device autopipe profiles
            on by default (CUDA when present, else the CPU).

    Returns:
        ``device FLOP/s / reference FLOP/s`` (2.0 = twice as fast), for ``Device(speed=...)``.

    Raises:
        ValueError: an unknown device, or a reference that is not a positive FLOP/s.

    Example:
        >>> measure_device_speed("cpu", reference=1e9) > 0
        True
    """
    dev = resolve_device(device)
    if isinstance(reference, bool):
        raise ValueError(f"reference={reference!r} must be FLOP/s (a number > 0) or a device")
    if isinstance(reference, (int, float)):
        if not (0 < reference < math.inf):
            raise ValueError(f"reference={reference!r} must be a finite FLOP/s > 0, or a device")
        reference_flops = float(reference)
    else:
        ref_dev = resolve_device(reference)
        if ref_dev == dev:
            return 1.0  # the same device: exactly 1, not the ratio of two noisy runs
        reference_flops = measure_device_flops(ref_dev)
    return measure_device_flops(dev) / reference_flops


def measure_devices(
    devices: Sequence[str | torch.device] | None = None,
    *,
    memory: int | str | Sequence[int | str | None] | None = None,
    reference: float | str | torch.device | None = None,
    measure_links: bool = True,
    sizes_bytes: Sequence[int] = DEFAULT_SIZES_BYTES,
    repeats: int = 10,
    timeout_s: float = 60.0,
) -> list[Device]:
    """One measured :class:`autopipe.Device` per pipeline rank, for ``PlannerOptions(devices=...)``.

    Speed comes from :func:`measure_device_speed` (measured once per distinct device), the
    link from each rank to the next from :func:`measure_link` (once per distinct pair; the
    last rank has no next, so its link stays unset), memory from
    ``torch.cuda.get_device_properties`` on CUDA.

    Args:
        devices: One device per rank, e.g. ``["cuda:0", "cuda:1"]`` or ``["cpu"] * 4``;
            default every visible GPU, or two CPU ranks when there is none.

    Keyword Args:
        memory: Capacity per rank (bytes or "16GiB"), one value or one per rank; default
            the GPU's total memory, unlimited on CPU.
        reference: What speed 1.0 means (see :func:`measure_device_speed`).
        measure_links: False leaves bandwidth/latency to the planner's defaults.
        sizes_bytes, repeats, timeout_s: Passed to :func:`measure_link`.

    Returns:
        ``[Device(speed=..., memory=..., bandwidth=..., latency_s=..., name=...), ...]``.

    Raises:
        ValueError: an empty or unknown device list, or a ``memory`` list of the wrong length.

    Example:
        >>> ranks = measure_devices(["cpu", "cpu"], memory="4GiB", reference=1e9, measure_links=False)
        >>> [d.memory for d in ranks]
        [4294967296, 4294967296]
    """
    if devices is None:
        n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        devices = [f"cuda:{i}" for i in range(n_gpus)] if n_gpus else ["cpu", "cpu"]
    if isinstance(devices, (str, torch.device)) or not isinstance(devices, Sequence) or not devices:
        raise ValueError(f"devices={devices!r} must be a non-empty list, one device per rank, e.g. ['cuda:0', 'cuda:1']")
    resolved = [resolve_device(d) for d in devices]
    if isinstance(memory, (list, tuple)):
        if len(memory) != len(resolved):
            raise ValueError(f"memory has {len(memory)} entries but devices has {len(resolved)}; give one per rank or one value")
        memories = list(memory)
    else:
        memories = [memory] * len(resolved)
    memories = [None if m is None else parse_bytes(m, name="memory") for m in memories]
    if measure_links and len(resolved) > 1:
        check_sizes_bytes(sizes_bytes)  # fail before the slow speed measurements
        check_int("repeats", repeats, 1)
        check_timeout_s(timeout_s)
    if isinstance(reference, bool):
        raise ValueError(f"reference={reference!r} must be FLOP/s (a number > 0) or a device")
    ref_dev = None if isinstance(reference, (int, float)) else resolve_device(reference)
    ref_flops = float(reference) if ref_dev is None else None  # measured once, when first needed
    speeds: dict[str, float] = {}
    links: dict[tuple[str, str], LinkMeasurement] = {}
    out = []
    for i, dev in enumerate(resolved):
        key = str(dev)
        if key not in speeds:
            if dev == ref_dev:
                speeds[key] = 1.0  # the reference itself: exactly 1, not a ratio of two noisy runs
            else:
                if ref_flops is None:
                    ref_flops = measure_device_flops(ref_dev)
                speeds[key] = measure_device_speed(dev, reference=ref_flops)
        mem = memories[i]
        if mem is None and dev.type == "cuda":
            mem = torch.cuda.get_device_properties(dev).total_memory
        bandwidth = latency_s = None
        if measure_links and i + 1 < len(resolved):
            pair = (key, str(resolved[i + 1]))
            if pair not in links:
                links[pair] = measure_link(device=pair, sizes_bytes=sizes_bytes, repeats=repeats, timeout_s=timeout_s)
            bandwidth, latency_s = links[pair].bandwidth_bytes_per_s, links[pair].latency_s
        out.append(Device(speed=speeds[key], memory=mem, bandwidth=bandwidth, latency_s=latency_s, name=f"{i}:{key}"))
    return out
