"""Measure the link between two pipeline ranks: latency and bandwidth, fitted to timed transfers.

Example:
    >>> bandwidth, latency_s, error = fit_link([1000, 2000], [1e-6 + 1000 / 1e9, 1e-6 + 2000 / 1e9])
    >>> round(bandwidth), round(latency_s * 1e6, 6), error
    (1000000000, 1.0, 0.0)
"""

from __future__ import annotations

import statistics
import time
import traceback
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from .._checks import check_distinct_sizes, check_int, is_int
from .._spawn import check_timeout_s, finish_rank, join_loopback_world, run_ranks
from .timing import resolve_device, synchronize

#: Message sizes of a link measurement: small ones pin down the latency, large ones the bandwidth.
DEFAULT_SIZES_BYTES = (1 << 10, 1 << 14, 1 << 18, 1 << 22, 1 << 25)  # 1 KiB ... 32 MiB


@dataclass
class LinkMeasurement:
    """What a link between two processes does: one-way time = latency_s + bytes / bandwidth.

    Use it as ``Device(bandwidth=m.bandwidth_bytes_per_s, latency_s=m.latency_s)``, or
    ``Device(**m.device_kwargs())``.

    Example:
        >>> m = LinkMeasurement(bandwidth_bytes_per_s=2e9, latency_s=1e-4, sizes_bytes=[1024, 1 << 20],
        ...                     one_way_s=[1.005e-4, 6.2e-4], samples_s=[[1.005e-4], [6.2e-4]], fit_error=0.01,
        ...                     backend="gloo", devices=("cpu", "cpu"))
        >>> m.device_kwargs()
        {'bandwidth': 2000000000.0, 'latency_s': 0.0001}
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

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> LinkMeasurement:
        """The measurement :meth:`to_dict` wrote.

        Raises:
            ValueError: ``raw`` lacks a field or holds a bandwidth that is not > 0 or a
                latency < 0 (the message names the field).

        Example:
            >>> m = LinkMeasurement(2e9, 1e-4, [1024, 2048], [1e-4, 1e-4], [[1e-4], [1e-4]], 0.0, "gloo", ("cpu", "cpu"))
            >>> LinkMeasurement.from_dict(m.to_dict()) == m
            True
        """
        names = [f.name for f in fields(cls)]
        if not isinstance(raw, dict) or any(n not in raw for n in names):
            missing = [n for n in names if not isinstance(raw, dict) or n not in raw]
            raise ValueError(f"a link measurement needs the fields {names}; missing {missing}")
        out = cls(**{n: raw[n] for n in names})
        out.devices = (str(out.devices[0]), str(out.devices[1]))
        bandwidth, latency = out.bandwidth_bytes_per_s, out.latency_s
        if not (isinstance(bandwidth, (int, float)) and 0 < bandwidth < float("inf")):
            raise ValueError(f"bandwidth_bytes_per_s={bandwidth!r} must be a finite number > 0")
        if not (isinstance(latency, (int, float)) and 0 <= latency < float("inf")):
            raise ValueError(f"latency_s={latency!r} must be a finite number >= 0")
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


def check_sizes_bytes(sizes_bytes: Any) -> list[int]:
    """The distinct message sizes of a link measurement, sorted; a clear error for anything else.

    Example:
        >>> check_sizes_bytes([4096, 1024, 4096])
        [1024, 4096]
    """
    return check_distinct_sizes("sizes_bytes", sizes_bytes, unit="message size",
                                why="to separate latency from bandwidth", example="(1024, 4 << 20)")


# --------------------------------------------------------------------------- in a process group


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
    """Measure the link between ranks ``src`` and ``dst`` of an initialised process group."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("measure_link_in_group needs an initialised process group: call "
                           "torch.distributed.init_process_group first (or use measure_link)")
    world = dist.get_world_size()
    for name, r in (("src", src), ("dst", dst)):
        if not is_int(r) or not 0 <= r < world:
            raise ValueError(f"{name}={r!r} must be a rank in [0, {world - 1}]")
    if src == dst:
        raise ValueError(f"src={src} and dst={dst} must be different ranks")
    sizes = check_sizes_bytes(sizes_bytes)
    repeats = check_int("repeats", repeats, 1)
    warmup = check_int("warmup", warmup, 0)
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
                synchronize(dev)
                t0 = time.perf_counter()
                dist.isend(buf, peer, group=group).wait()
                dist.irecv(buf, peer, group=group).wait()
                synchronize(dev)  # NCCL's wait only orders streams; the host must see the bytes
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
    synchronize(dev)
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
    processes start as fresh interpreters do (a fork server, or ``spawn``), so a script that
    calls this must do so under ``if __name__ == "__main__":``.

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
    sizes = check_sizes_bytes(sizes_bytes)
    repeats = check_int("repeats", repeats, 1)
    warmup = check_int("warmup", warmup, 0)
    timeout_s = check_timeout_s(timeout_s)
    if not dist.is_available():
        raise RuntimeError("torch.distributed is not available in this torch build")
    devices = (str(pair[0]), str(pair[1]))
    results = run_ranks(
        _link_worker, 2,
        lambda rank, port, out_dir: (rank, port, backend, devices, sizes, repeats, warmup, timeout_s, out_dir),
        timeout_s=timeout_s, what="link", advice="use fewer or smaller sizes_bytes",
    )
    link = results[0]
    link.devices = devices
    return link
