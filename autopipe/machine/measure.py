"""Measure the devices and links a pipeline runs on, instead of guessing them.

The planner's cost model needs, per pipeline rank, a relative compute ``speed`` and the
``bandwidth`` / ``latency_s`` of the link to the next rank (:class:`autopipe.Device`).
This module measures them:

* :func:`measure_link` starts two processes on loopback (gloo on CPU, NCCL on two GPUs),
  ping-pongs messages of several sizes between them, and fits
  ``one-way time = latency + bytes / bandwidth``;
* :func:`measure_link_in_group` does the same between two ranks of a process group that
  already exists (under ``torchrun``, across nodes);
* :func:`measure_device_speed` compares a device's matmul throughput with the device the
  profile was measured on;
* :func:`measure_devices` builds the ``devices=[...]`` list for :func:`autopipe.partition`;
* :func:`measure_action_overhead` runs a pipeline of a small probe model under each schedule and
  finds the seconds every action costs beyond its compute (the runtime's bookkeeping,
  posting and waiting on sends and receives), and how much slower the ranks compute when
  all of them compute at once: ``partition(action_overhead_s=..., devices=[Device(speed=...)])``.

Example:
    >>> from autopipe.machine.measure import fit_link
    >>> bandwidth, latency_s, error = fit_link([1000, 2000], [1e-6 + 1000 / 1e9, 1e-6 + 2000 / 1e9])
    >>> round(bandwidth), round(latency_s * 1e6, 6), error
    (1000000000, 1.0, 0.0)
"""

from __future__ import annotations

import math
import numbers
import statistics
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from .._spawn import finish_rank, join_loopback_world, spawn_ranks
from .device import Device, default_link, parse_bytes, sends_are_lazy
from ..planning.profile import Timer, _time_alone, measure_device_flops, resolve_device

__all__ = [
    "LinkMeasurement",
    "fit_link",
    "measure_link",
    "measure_link_in_group",
    "measure_device_speed",
    "measure_devices",
    "measure_action_overhead",
    "OverheadMeasurement",
    "DEFAULT_SIZES_BYTES",
]

#: Message sizes of a link measurement: small ones pin down the latency, large ones the bandwidth.
DEFAULT_SIZES_BYTES = (1 << 10, 1 << 14, 1 << 18, 1 << 22, 1 << 25)  # 1 KiB ... 32 MiB


@dataclass
class LinkMeasurement:
    """What a link between two processes does: one-way time = latency_s + bytes / bandwidth.

    Use it as ``Device(bandwidth=m.bandwidth_bytes_per_s, latency_s=m.latency_s)``, or
    ``Device(**m.device_kwargs())``.
    """

    bandwidth_bytes_per_s: float  # fitted bytes per second
    latency_s: float  # fitted seconds per message (the time of an empty message)
    sizes_bytes: list[int]  # message sizes tried
    one_way_s: list[float]  # median one-way time per size (half a round trip)
    samples_s: list[list[float]]  # every one-way time measured, per size
    fit_error: float  # max |fit - median| / median over the sizes
    backend: str  # "gloo" or "nccl"
    devices: tuple[str, str]  # where the two ends' buffers lived

    def device_kwargs(self) -> dict[str, float]:
        """``{"bandwidth": ..., "latency_s": ...}`` for :class:`autopipe.Device`."""
        return {"bandwidth": self.bandwidth_bytes_per_s, "latency_s": self.latency_s}

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of every field."""
        out = asdict(self)
        out["devices"] = list(self.devices)
        return out

    def summary(self) -> str:
        """One line: bandwidth, latency and fit error."""
        return (
            f"{self.backend} {self.devices[0]} <-> {self.devices[1]}: "
            f"{self.bandwidth_bytes_per_s / 1e9:.3g} GB/s, latency {self.latency_s * 1e6:.3g} us "
            f"(fit error {100 * self.fit_error:.1f}% over {len(self.sizes_bytes)} sizes)"
        )


# --------------------------------------------------------------------------- the fit


def fit_link(sizes_bytes: Sequence[int], one_way_s: Sequence[float]) -> tuple[float, float, float]:
    """Fit ``one_way_s = latency_s + sizes_bytes / bandwidth`` to measured transfer times.

    The fit minimises *relative* residuals (least squares weighted by 1 / time), so the
    microsecond times of small messages count as much as the milliseconds of large ones:
    the small messages pin down the latency and the large ones the bandwidth. A negative
    latency (noise) is replaced by the best fit with zero latency.

    Args:
        sizes_bytes: Message sizes, at least two distinct, all > 0.
        one_way_s: The one-way time of each, all > 0.

    Returns:
        ``(bandwidth bytes/s, latency s, relative error)``; the error is
        ``max |fit - measured| / measured``.

    Raises:
        ValueError: lengths differ, fewer than two distinct sizes, a size or time <= 0, or
            the times do not grow with the size (no bandwidth can be read from them).

    Example:
        >>> bw, lat, err = fit_link([10, 20, 40], [2e-6 + n / 5e8 for n in (10, 20, 40)])
        >>> f"{bw:.3g} {lat:.3g} {err:.1g}"
        '5e+08 2e-06 0'
    """
    x = np.asarray(sizes_bytes, dtype=float)
    t = np.asarray(one_way_s, dtype=float)
    if x.shape != t.shape or x.ndim != 1:
        raise ValueError(f"sizes_bytes ({len(sizes_bytes)}) and one_way_s ({len(one_way_s)}) must have equal lengths")
    if len(set(x.tolist())) < 2:
        raise ValueError(f"sizes_bytes={list(sizes_bytes)!r} must hold at least two distinct message sizes")
    if np.any(x <= 0) or np.any(~np.isfinite(t)) or np.any(t <= 0):
        raise ValueError(f"sizes_bytes and one_way_s must be > 0, got {list(sizes_bytes)!r} and {list(one_way_s)!r}")
    w = 1.0 / t  # divide each equation by its own time: relative residuals
    (latency, per_byte), *_ = np.linalg.lstsq(np.stack([w, x * w], axis=1), np.ones_like(t), rcond=None)
    if latency < 0:
        latency = 0.0
        per_byte = float(np.dot(x * w, np.ones_like(t)) / np.dot(x * w, x * w))
    if not per_byte > 0:
        raise ValueError(
            f"one_way_s={list(one_way_s)!r} does not grow with sizes_bytes={list(sizes_bytes)!r}, so no "
            "bandwidth can be read from it; measure larger messages (several MiB) or more repeats"
        )
    predicted = latency + per_byte * x
    error = float(np.max(np.abs(predicted - t) / t))
    return float(1.0 / per_byte), float(latency), (0.0 if error < 1e-12 else error)


def _measurement(sizes: list[int], samples: list[list[float]], backend: str, devices: tuple[str, str]) -> LinkMeasurement:
    medians = [statistics.median(s) for s in samples]
    bandwidth, latency, error = fit_link(sizes, medians)
    return LinkMeasurement(
        bandwidth_bytes_per_s=bandwidth, latency_s=latency, sizes_bytes=list(sizes), one_way_s=medians,
        samples_s=[list(s) for s in samples], fit_error=error, backend=backend, devices=devices,
    )


# --------------------------------------------------------------------------- validation


def _check_sizes_bytes(sizes_bytes: Any) -> list[int]:
    if isinstance(sizes_bytes, (str, bytes)) or not isinstance(sizes_bytes, Sequence):
        raise ValueError(f"sizes_bytes={sizes_bytes!r} must be a list of message sizes in bytes (integers >= 1)")
    for n in sizes_bytes:
        if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1:
            raise ValueError(f"sizes_bytes={list(sizes_bytes)!r}: {n!r} is not a message size; use integers >= 1")
    distinct = sorted({int(n) for n in sizes_bytes})
    if len(distinct) < 2:
        raise ValueError(
            f"sizes_bytes={list(sizes_bytes)!r} must hold at least two distinct sizes to separate latency "
            "from bandwidth, e.g. (1024, 4 << 20)"
        )
    return distinct


def _check_count(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{name}={value!r} must be an integer >= {minimum}")
    return int(value)


def _check_timeout(timeout_s: Any) -> float:
    # The same bound as the process groups it is passed to (they cannot wait past a year).
    from ..runtime.distributed import check_timeout_s

    return check_timeout_s(timeout_s)


# --------------------------------------------------------------------------- in a process group


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _group_device(group: Any) -> torch.device:
    """The device a backend's tensors must live on: the current GPU for NCCL, else the CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def measure_link_in_group(
    src: int,
    dst: int,
    *,
    sizes_bytes: Sequence[int] = DEFAULT_SIZES_BYTES,
    repeats: int = 10,
    warmup: int = 3,
    group: Any = None,
    device: str | torch.device | None = None,
) -> LinkMeasurement | None:
    """Measure the link between ranks ``src`` and ``dst`` of an initialised process group.

    Call it on ``src`` and ``dst`` (other ranks may call it too and get ``None`` at once).
    ``src`` sends a message of each size and ``dst`` sends it back with ``isend``/``irecv``
    + ``wait`` (as ``torch.distributed.pipelining`` moves activations), for
    ``warmup + repeats`` rounds in which the sizes take turns; half of each round trip is
    one one-way sample. ``src`` then sends the
    samples to ``dst``, so both return the same :class:`LinkMeasurement`. Transfers time
    out after the group's own timeout (``init_process_group(timeout=...)``).

    Args:
        src: Global rank that starts every round trip.
        dst: Global rank that echoes.

    Keyword Args:
        sizes_bytes: Message sizes (at least two distinct, >= 1).
        repeats: Timed round trips per size (>= 1); the median is fitted.
        warmup: Untimed rounds first (connection set-up, allocator).
        group: The process group (default: the world).
        device: Where the buffers live; default the current GPU for NCCL, else the CPU.

    Returns:
        The measurement on ``src`` and ``dst``; ``None`` on every other rank.

    Raises:
        RuntimeError: no process group is initialised.
        ValueError: bad ranks or options (before any communication).

    Example (under ``torchrun --nproc-per-node 2``)::

        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
        link = measure_link_in_group(0, 1)
        if dist.get_rank() == 0:
            print(link.summary())
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("measure_link_in_group needs an initialised process group: call "
                           "torch.distributed.init_process_group first (or use measure_link)")
    world = dist.get_world_size()
    for name, r in (("src", src), ("dst", dst)):
        if isinstance(r, bool) or not isinstance(r, numbers.Integral) or not 0 <= r < world:
            raise ValueError(f"{name}={r!r} must be a rank in [0, {world - 1}]")
    if src == dst:
        raise ValueError(f"src={src} and dst={dst} must be different ranks")
    sizes = _check_sizes_bytes(sizes_bytes)
    repeats = _check_count("repeats", repeats, 1)
    warmup = _check_count("warmup", warmup, 0)
    dev = torch.device(device) if device is not None else _group_device(group)
    rank = dist.get_rank()
    if rank not in (src, dst):
        return None
    peer = dst if rank == src else src
    buffers = [torch.zeros(nbytes, dtype=torch.uint8, device=dev) for nbytes in sizes]
    samples: list[list[float]] = [[] for _ in sizes]
    # Sizes take turns within each round, so a burst of load from other processes slows
    # every size a little instead of one size a lot (it would bend the fitted line).
    for i in range(warmup + repeats):
        for k, buf in enumerate(buffers):
            if rank == src:
                _synchronize(dev)
                t0 = time.perf_counter()
                dist.isend(buf, peer, group=group).wait()
                dist.irecv(buf, peer, group=group).wait()
                _synchronize(dev)  # NCCL's wait only orders streams; the host must see the bytes
                if i >= warmup:
                    samples[k].append((time.perf_counter() - t0) / 2.0)
            else:
                dist.irecv(buf, peer, group=group).wait()
                dist.isend(buf, peer, group=group).wait()
    # Share src's samples so both ends return the same measurement.
    table = torch.zeros(len(sizes), repeats, dtype=torch.float64, device=dev)
    if rank == src:
        table.copy_(torch.tensor(samples, dtype=torch.float64))
        dist.isend(table, peer, group=group).wait()
    else:
        dist.irecv(table, peer, group=group).wait()
    _synchronize(dev)
    return _measurement(sizes, table.cpu().tolist(), dist.get_backend(group), (f"rank {src}", f"rank {dst}"))


# --------------------------------------------------------------------------- two spawned processes


def _link_worker(rank: int, port: int, backend: str, devices: tuple[str, str], sizes: list[int],
                 repeats: int, warmup: int, timeout_s: float, out_dir: str) -> None:
    """One end of :func:`measure_link`; writes ("ok", measurement) or ("error", text) to a file."""
    torch.set_num_threads(1)  # both ends share the host's cores; the transfer needs no threads
    dev = torch.device(devices[rank])
    try:
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        join_loopback_world(rank, 2, port, backend=backend, timeout_s=timeout_s)
        link = measure_link_in_group(0, 1, sizes_bytes=sizes, repeats=repeats, warmup=warmup, device=dev)
        result: tuple[str, Any] = ("ok", link)
    except BaseException as e:  # noqa: BLE001 - everything goes back to the parent
        result = ("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
    finish_rank(out_dir, rank, result)


def _link_devices(device: Any) -> tuple[torch.device, torch.device]:
    """The two ends' devices from ``device``: None, a type ("cpu", "cuda") or a pair."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() and torch.cuda.device_count() >= 2 else "cpu"
    if isinstance(device, (list, tuple)):
        if len(device) != 2:
            raise ValueError(f"device={device!r}: give one device, a device type, or a pair of devices")
        pair = (resolve_device(device[0]), resolve_device(device[1]))
    else:
        one = resolve_device(device)
        if one.type == "cuda" and one.index is None:
            pair = (torch.device("cuda", 0), torch.device("cuda", 1))
        else:
            pair = (one, one)
    if pair[0].type != pair[1].type:
        raise ValueError(f"device={device!r}: both ends must be the same kind of device")
    if pair[0].type == "cuda":
        pair = tuple(torch.device("cuda", d.index if d.index is not None else 0) for d in pair)  # type: ignore[assignment]
        if pair[0] == pair[1]:
            raise ValueError(f"device={device!r}: both ends on {pair[0]}; NCCL needs two different GPUs")
        if max(d.index for d in pair) >= torch.cuda.device_count():
            raise ValueError(f"device={device!r} but only {torch.cuda.device_count()} GPU(s) are visible")
    elif pair[0].type != "cpu":
        raise ValueError(f"device={device!r}: links can be measured between CPU processes or CUDA GPUs")
    return pair


def measure_link(
    *,
    device: str | torch.device | Sequence[str | torch.device] | None = None,
    backend: str | None = None,
    sizes_bytes: Sequence[int] = DEFAULT_SIZES_BYTES,
    repeats: int = 10,
    warmup: int = 3,
    timeout_s: float = 60.0,
) -> LinkMeasurement:
    """Measure the link between two processes on this machine (loopback).

    Starts two processes, joins them in a process group on ``127.0.0.1``, and runs
    :func:`measure_link_in_group` between them. Never hangs: the group's transfers time out
    after ``timeout_s``, and both processes are killed if they are not done by then. The
    processes are started with the ``spawn`` method, so a script that calls this must do so
    under ``if __name__ == "__main__":``.

    Keyword Args:
        device: ``"cpu"`` (both processes on the CPU), ``"cuda"`` (GPUs 0 and 1), or a pair
            such as ``("cuda:0", "cuda:3")``; default two GPUs when there are, else the CPU.
        backend: ``"gloo"`` (CPU) or ``"nccl"`` (CUDA); default follows ``device``.
        sizes_bytes: Message sizes (at least two distinct, >= 1).
        repeats: Timed round trips per size (>= 1).
        warmup: Untimed rounds first (>= 0).
        timeout_s: Limit on the whole measurement, start-up included (> 0).

    Returns:
        A :class:`LinkMeasurement`; ``Device(**m.device_kwargs())`` uses it.

    Raises:
        ValueError: bad options (before any process starts).
        TimeoutError: the processes were not done within ``timeout_s`` (they are killed).
        RuntimeError: a process failed; the message holds its traceback.

    Example:
        >>> link = measure_link(device="cpu", sizes_bytes=(1024, 1 << 20), repeats=3)  # doctest: +SKIP
        >>> link.bandwidth_bytes_per_s > 0  # doctest: +SKIP
        True
    """
    pair = _link_devices(device)
    if backend is None:
        backend = "nccl" if pair[0].type == "cuda" else "gloo"
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend={backend!r} is not supported; use 'gloo' (CPU) or 'nccl' (CUDA)")
    if (backend == "nccl") != (pair[0].type == "cuda"):
        raise ValueError(f"backend={backend!r} does not move {pair[0].type} tensors; use "
                         f"{'nccl' if pair[0].type == 'cuda' else 'gloo'} for device={device!r}")
    sizes = _check_sizes_bytes(sizes_bytes)
    repeats = _check_count("repeats", repeats, 1)
    warmup = _check_count("warmup", warmup, 0)
    timeout_s = _check_timeout(timeout_s)
    if not dist.is_available():
        raise RuntimeError("torch.distributed is not available in this torch build")
    results = _spawn_pair(backend, (str(pair[0]), str(pair[1])), sizes, repeats, warmup, timeout_s)
    link = results[0]
    link.devices = (str(pair[0]), str(pair[1]))
    return link


def _spawn_pair(backend: str, devices: tuple[str, str], sizes: list[int], repeats: int, warmup: int,
                timeout_s: float) -> list[LinkMeasurement]:
    """Run :func:`_link_worker` on two spawned processes; their results in rank order."""
    return _run_ranks(
        _link_worker, 2,
        lambda rank, port, out_dir: (rank, port, backend, devices, sizes, repeats, warmup, timeout_s, out_dir),
        timeout_s=timeout_s, what="link", advice="use fewer or smaller sizes_bytes",
    )


def _run_ranks(worker: Any, n_ranks: int, make_args: Any, *, timeout_s: float, what: str, advice: str) -> list[Any]:
    """Spawn ``n_ranks`` measuring processes; their results in rank order, or a clear error."""
    outcomes, late, _ = spawn_ranks(worker, n_ranks, make_args, timeout_s=timeout_s, prefix=f"autopipe-{what}-")
    if late:
        raise TimeoutError(f"the {what} measurement was not done after timeout_s={timeout_s}; ranks {late} "
                           f"were killed. Raise timeout_s, or {advice}.")
    errors = [f"--- rank {rank} ---\n{text}" for rank, (status, text) in enumerate(outcomes) if status != "ok"]
    if errors:
        raise RuntimeError(f"the {what} measurement failed:\n" + "\n".join(errors))
    return [value for _, value in outcomes]


# --------------------------------------------------------------------------- devices


def measure_device_speed(
    device: str | torch.device | None = None,
    *,
    reference: float | str | torch.device | None = None,
) -> float:
    """Compute speed of ``device`` relative to ``reference``, from matmul throughput.

    ``Device.speed`` is relative to the device the profile was measured on, so the
    reference should be that device. Both are measured with
    :func:`autopipe.planning.profile.measure_device_flops` (float32 matmuls).

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
    """One measured :class:`autopipe.Device` per pipeline rank, for ``partition(devices=...)``.

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
        _check_sizes_bytes(sizes_bytes)  # fail before the slow speed measurements
        _check_count("repeats", repeats, 1)
        _check_timeout(timeout_s)
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


# --------------------------------------------------------------------------- runtime overhead

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

    Use ``partition(..., action_overhead_s=m.action_overhead_s)`` and, where the ranks share
    a machine, ``Device(speed=1 / m.concurrent_slowdown)`` for every rank.
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


def _fit_action_overhead(step_s: float, schedule: str, stages_per_rank: int, n_ranks: int,
                         n_microbatches: int, comm_s: float, fwd_s: Sequence[float] | None = None,
                         bwd_s: Sequence[float] | None = None, lazy_sends: bool = False) -> float:
    """The per-action overhead o with which the simulated step is ``step_s``.

    ``fwd_s`` / ``bwd_s`` are the stages' compute per micro-batch (default: none at all);
    ``lazy_sends`` as the planner will simulate this backend (so the overhead fitted here
    is not also charged for late deliveries the plans model on their own).
    """
    from ..planning.schedules import simulate, solve_increasing

    n_stages = n_ranks * stages_per_rank
    fwd = list(fwd_s) if fwd_s is not None else [0.0] * n_stages
    bwd = list(bwd_s) if bwd_s is not None else [0.0] * n_stages

    def simulated(o: float) -> float:
        return simulate(fwd, bwd, schedule=schedule, n_microbatches=n_microbatches,
                        stages_per_rank=stages_per_rank, comm_s=comm_s, action_overhead_s=o,
                        lazy_sends=lazy_sends).step_s

    return solve_increasing(simulated, step_s, hi=step_s)  # the step grows with o; at o = step_s it is >= step_s


def _compute_probe_s(device: torch.device, repeats: int) -> list[float]:
    """Seconds of a fixed burst of matmuls and element-wise work, ``repeats`` times.

    The matrices (1 MiB each) outgrow a core's private cache, as a real layer's weights and
    activations do, so ranks sharing a host compete for the shared cache and memory
    bandwidth here as they do in a pipeline (small cache-resident matmuls hardly slow down).
    """
    g = torch.Generator().manual_seed(0)
    a = torch.randn(512, 512, generator=g).to(device)
    b = torch.randn(512, 512, generator=g).to(device)
    out = []
    for _ in range(repeats):
        _synchronize(device)
        t0 = time.perf_counter()
        x = a
        for _ in range(6):
            x = torch.tanh(x @ b) + a
        _synchronize(device)
        out.append(time.perf_counter() - t0)
    return out


def _stage_compute_s(layers: list, device: torch.device, repeats: int = 7) -> tuple[float, float]:
    """Forward and backward seconds (:func:`autopipe.planning.profile.per_run_s`) of one probe stage on one micro-batch, alone.

    Two warm-up runs first. The caches are not emptied between runs (as the profiler does
    before each pass of a round, :class:`autopipe.planning.profile.CacheFlusher`): a probe stage's
    weights (1 MiB) stay in the cache between its actions inside the running pipeline, so
    timed cold it would look slower than it runs there, and the overhead fitted on top of it
    would come out too small (0.36 ms instead of 0.56 ms in one run).
    """
    import torch.nn as nn

    stage = nn.Sequential(*layers)
    return _time_alone(stage, lambda: [torch.randn(_PROBE_ROWS, _PROBE_WIDTH, device=device, requires_grad=True)],
                       list(stage.parameters()), Timer(device), warmup=2, repeats=repeats)


def _overhead_worker(rank: int, port: int, n_ranks: int, backend: str, device_type: str,
                     schedules: list[tuple[str, int]], n_microbatches: int, steps: int, timeout_s: float,
                     out_dir: str) -> None:
    """One rank of :func:`measure_action_overhead`: step times per schedule, compute alone and together."""
    import torch.nn as nn

    torch.set_num_threads(1)  # the ranks share the host's cores, as in a CPU pipeline
    try:
        dev = torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        join_loopback_world(rank, n_ranks, port, backend=backend, timeout_s=timeout_s)
        from ..runtime import Pipeline

        g = torch.Generator().manual_seed(0)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = nn.Sequential(*[nn.Linear(_PROBE_WIDTH, _PROBE_WIDTH) for _ in range(_PROBE_LAYERS)])
        x = torch.randn(_PROBE_ROWS * n_microbatches, _PROBE_WIDTH, generator=g)
        y = torch.randn(_PROBE_ROWS * n_microbatches, _PROBE_WIDTH, generator=g)
        # The same compute burst on each rank alone, then on every rank at once, in rounds
        # spread over the whole measurement (two before each schedule's probe, two at the
        # end): a round disturbed by another job on the host is outvoted by the others, and a
        # disturbance lasting a few seconds no longer falls on every round (one did, once:
        # 1.65x on a host where ranks computing together are 1.0-1.03x as slow).
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
                            stages_per_rank=v, device=dev)
            times = []
            for i in range(steps + 2):  # two warm-up steps
                dist.barrier()
                t0 = time.perf_counter()
                pipe.step(x, target=y)
                _synchronize(dev)
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
        ...                           action_overhead_s=m.action_overhead_s)
    """
    from ..planning.schedules import canonical_schedule_name, validate_schedule

    n_ranks = _check_count("n_ranks", n_ranks, 2)
    n_microbatches = _check_count("n_microbatches", n_microbatches, 1)
    steps = _check_count("steps", steps, 1)
    timeout_s = _check_timeout(timeout_s)
    if isinstance(schedules, (str, bytes)) or not schedules:
        raise ValueError(f"schedules={schedules!r} must be a non-empty list of (schedule, stages_per_rank) pairs")
    pairs = []
    for item in schedules:
        if not (isinstance(item, (tuple, list)) and len(item) == 2):
            raise ValueError(f"schedules entry {item!r} must be a (schedule, stages_per_rank) pair, e.g. ('1F1B', 1)")
        name, v = canonical_schedule_name(item[0]), _check_count("stages_per_rank", item[1], 1)
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
    results = _run_ranks(
        _overhead_worker, n_ranks,
        lambda rank, port, out_dir: (rank, port, n_ranks, backend, device, pairs, n_microbatches, steps,
                                     timeout_s, out_dir),
        timeout_s=timeout_s, what="overhead", advice="run fewer schedules or steps",
    )
    bandwidth, latency = default_link(device)
    comm_s = latency + _PROBE_ROWS * _PROBE_WIDTH * 4 / bandwidth  # one micro-batch's activation
    # Per rank and round, together / alone; the median over all of them.
    slowdown = statistics.median(t / a for r in results for t, a in zip(r["together_s"], r["alone_s"]))
    step_s, per_schedule = {}, {}
    for name, v in pairs:
        key = f"{name}-{v}"
        step_s[key] = statistics.median(results[0]["steps_s"][key])
        # Stage compute: the median over ranks of each stage timed alone, slowed as when all compute.
        fwd = [statistics.median(r["compute_s"][key][0][s] for r in results) * slowdown for s in range(n_ranks * v)]
        bwd = [statistics.median(r["compute_s"][key][1][s] for r in results) * slowdown for s in range(n_ranks * v)]
        per_schedule[key] = _fit_action_overhead(step_s[key], name, v, n_ranks, n_microbatches, comm_s, fwd, bwd,
                                                 lazy_sends=sends_are_lazy(device))
    return OverheadMeasurement(
        action_overhead_s=statistics.median(per_schedule.values()), per_schedule_s=per_schedule, step_s=step_s,
        n_microbatches=n_microbatches, concurrent_slowdown=slowdown, n_ranks=n_ranks, backend=backend,
        device=device,
    )


# --------------------------------------------------------------------------- command line


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m autopipe.machine.measure``: measure the loopback link a few times, print the medians.

    With ``--overhead``, also the runtime's cost per pipeline action (see
    :func:`measure_action_overhead`).
    """
    import argparse
    import json

    parser = argparse.ArgumentParser(prog="python -m autopipe.machine.measure", description=main.__doc__)
    parser.add_argument("--device", default=None, help="'cpu' (gloo) or 'cuda' (NCCL, two GPUs); default: auto")
    parser.add_argument("--runs", type=int, default=5, help="independent measurements (fresh processes each)")
    parser.add_argument("--repeats", type=int, default=10, help="timed round trips per size and run")
    parser.add_argument("--json", action="store_true", help="print every run as JSON as well")
    parser.add_argument("--overhead", action="store_true",
                        help="also measure the runtime's cost per pipeline action and the slowdown of ranks "
                             "computing at once (partition(action_overhead_s=...), Device(speed=...))")
    args = parser.parse_args(argv)
    runs = []
    for i in range(_check_count("runs", args.runs, 1)):
        link = measure_link(device=args.device, repeats=args.repeats)
        runs.append(link)
        print(f"run {i + 1}: {link.summary()}", flush=True)
    bandwidth = statistics.median(r.bandwidth_bytes_per_s for r in runs)
    latency_s = statistics.median(r.latency_s for r in runs)
    print(f"median of {len(runs)} runs: {bandwidth / 1e9:.3g} GB/s, latency {latency_s * 1e6:.3g} us")
    if args.json:
        print(json.dumps([r.to_dict() for r in runs]))
    if args.overhead:
        overhead = measure_action_overhead(device=args.device)
        print(f"runtime overhead: {overhead.summary()}")
        if args.json:
            print(json.dumps(overhead.to_dict()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
