"""Devices, links and memory: what the stages run on.

Example:
    >>> from autopipe.machine.device import Device, parse_bytes
    >>> parse_bytes("16GiB")
    17179869184
    >>> Device(speed=2.0, memory="8GiB").memory_bytes
    8589934592
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}


def format_bytes(n: float, *, round_up: bool = False) -> str:
    """Bytes in powers of 1024 for people to read: the inverse of :func:`parse_bytes`.

    ``round_up`` rounds up to the digit shown instead of to the nearest, for memory a
    message says is needed: given back as a limit, the figure shown must be enough.

    Example::

        >>> format_bytes(3 * 2**20)
        '3.0 MiB'
        >>> format_bytes(9.32 * 2**30), format_bytes(9.32 * 2**30, round_up=True)
        ('9.3 GiB', '9.4 GiB')
    """
    if abs(n) < 1024:
        return f"{math.ceil(n) if round_up else int(n)} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if abs(n) < 1024 or unit == "TiB":
            break
    return f"{math.ceil(n * 10 - 1e-9) / 10 if round_up else n:.1f} {unit}"


def parse_bytes(value: int | float | str, *, name: str = "memory") -> int:
    """Bytes from an integer or a string such as ``"16GiB"``, ``"1.5 GB"``, ``"800MiB"``.

    Raises:
        ValueError: not a positive amount with a known unit (the message names ``name``).
    """
    if isinstance(value, bool):
        raise ValueError(f"{name}={value!r} is not a memory size; give bytes or a string like '16GiB'")
    if isinstance(value, (int, float)):
        if not math.isfinite(value) or value <= 0:
            raise ValueError(f"{name}={value!r} must be a positive number of bytes (or a string like '16GiB')")
        return int(value)
    if isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?\d+)?)\s*([A-Za-z]*)\s*", value)
        if m and m.group(2).lower() in _UNITS:
            amount = float(m.group(1)) * _UNITS[m.group(2).lower()]
            if amount > 0:
                return int(amount)
    raise ValueError(
        f"{name}={value!r} is not a memory size; use a positive number of bytes or a string such as "
        "'16GiB', '512MiB', '1.5GB' (units: B, KB/MB/GB/TB powers of 1000, KiB/MiB/GiB/TiB powers of 1024)"
    )


def parse_bandwidth(value: int | float | str, *, name: str = "bandwidth") -> float:
    """Bytes per second from a number or from a size as :func:`parse_bytes` reads it, per second.

    Example:
        >>> parse_bandwidth("10GB"), parse_bandwidth("1.5GB/s"), parse_bandwidth(2e9)
        (10000000000.0, 1500000000.0, 2000000000.0)
    """
    accepted = ("a finite number of bytes per second, or a string such as '10GB' or '1.5GB/s' (units as for "
                "memory: B, KB/MB/GB/TB powers of 1000, KiB/MiB/GiB/TiB powers of 1024; '/s' optional)")
    if isinstance(value, str):
        try:
            return float(parse_bytes(value.strip().removesuffix("/s"), name=name))
        except ValueError:
            raise ValueError(f"{name}={value!r} is not a rate; give {accepted}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name}={value!r} is not a rate; give {accepted}")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name}={value!r} must be > 0 and finite; give {accepted}")
    return float(value)


def _check_seconds(name: str, value: object) -> float:
    """A finite time >= 0 in seconds, or a ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
        raise ValueError(f"{name}={value!r} must be a finite time >= 0 seconds (a number, e.g. 1e-4)")
    return float(value)


#: Seconds one message costs inside a running training step between CPU ranks that share a
#: host's cores: each tensor a stage sends waits for a core that the ranks' compute holds, so it
#: costs several times what an idle ping-pong measures (about 0.1 ms over loopback gloo).
#: Fitted to real 2-rank steps of six decoder LMs on a 2-core host (benchmarks/real_steps,
#: docs/design.md, "what a message costs inside a step").
CPU_STEP_MESSAGE_S = 500e-6

#: Default link between neighbouring devices, per device type: (bytes/s, seconds per message).
#: CPU: gloo over loopback TCP, the bandwidth about what `autopipe measure` finds
#: on a quiet shared host (docs/costs-and-measurement.md section 5), a message as inside a step.
#: CUDA: a conservative PCIe-class peer link (NVLink is 10x faster: pass bandwidth= to say so).
_DEFAULT_LINKS = {"cpu": (2e9, CPU_STEP_MESSAGE_S), "cuda": (10e9, 20e-6)}


def default_link(device_type: str) -> tuple[float, float]:
    """(bandwidth bytes/s, latency s) assumed between stages when none is given."""
    return _DEFAULT_LINKS.get(device_type, _DEFAULT_LINKS["cuda"])


def step_message_s(device_type: str, measured_latency_s: float) -> float:
    """Seconds per message the planner charges for a link measured idle between ranks of ``device_type``.

    Example:
        >>> step_message_s("cpu", 1e-4), step_message_s("cuda", 1e-5)
        (0.0005, 1e-05)
    """
    return max(measured_latency_s, CPU_STEP_MESSAGE_S) if device_type == "cpu" else measured_latency_s


#: Default seconds each pipeline action (F, B, I, W) costs beyond its compute, per device type.
#: CPU: gloo processes on a shared 2-core host, measured with
#: `autopipe measure --overhead` (docs/costs-and-measurement.md).
#: CUDA: none is assumed: one-stage pipelines on one GPU imply about none once the profile is
#: fitted to the whole graph (benchmarks/gpu_one_rank, docs/benchmarks.md section 8), and what
#: a send between two GPUs costs in torch's runtime is not measured (docs/design.md).
#: Measure it on your GPUs with autopipe.runtime.overhead_probe.measure_action_overhead and pass action_overhead_s=.
_DEFAULT_ACTION_OVERHEAD_S = {"cpu": 0.7e-3, "cuda": 0.0}


def default_action_overhead_s(device_type: str) -> float:
    """Seconds per pipeline action assumed beyond compute when none is given."""
    return _DEFAULT_ACTION_OVERHEAD_S.get(device_type, _DEFAULT_ACTION_OVERHEAD_S["cuda"])


#: Bytes per second at which a device copies into freshly allocated memory (``torch.cat``),
#: per device type. CPU: about what copies of several MiB into fresh memory run at on a
#: shared host, page faults included (docs/design.md, finding 11). CUDA: assumed, not measured.
_DEFAULT_COPY_BANDWIDTH = {"cpu": 3e9, "cuda": 1e12}


def default_copy_bandwidth(device_type: str) -> float:
    """Bytes per second assumed for copying into fresh memory on this device type."""
    return _DEFAULT_COPY_BANDWIDTH.get(device_type, _DEFAULT_COPY_BANDWIDTH["cuda"])


def sends_are_lazy(device_type: str) -> bool:
    """Whether the backend used on this device type moves a send only when its sender calls in."""
    return device_type == "cpu"


@dataclass
class Device:
    """One pipeline device: relative speed, memory, and its link to the next device.

    Args:
        speed: Compute speed relative to the profiled device (2.0 = twice as fast). > 0.
        memory: Capacity in bytes or as a string ("16GiB"); None = unlimited.
        bandwidth: Bytes/s of the link to the next device: a number, or a string as for
            memory, per second (``"10GB"`` or ``"10GB/s"`` = 10**10 bytes/s; see
            :func:`parse_bandwidth`); stored as a float. None = the default for the type.
        latency_s: Seconds per message on that link; None = the default.
        action_overhead_s: Seconds each pipeline action on this device costs beyond its
            compute (the runtime's own work); None = the default for the type.
        name: Shown in reports.
        flops: FLOP/s at which counted costs (``cost="flops"`` or ``"params"``) are charged on
            this device; None = measured on the profiling device. With every device's rate
            given, a device's relative speed follows from it. Ignored by measured costs (the
            profile timed the device itself). :meth:`preset` sets it from a data sheet.

    Example:
        >>> Device.preset("A100", efficiency=0.5).flops == 0.5 * 312e12
        True
    """

    speed: float = 1.0
    memory: int | float | str | None = None
    bandwidth: float | str | None = None
    latency_s: float | None = None
    name: str = ""
    action_overhead_s: float | None = None
    flops: float | None = None

    def __post_init__(self) -> None:
        if isinstance(self.speed, bool) or not isinstance(self.speed, (int, float)) or not self.speed > 0 or not math.isfinite(self.speed):
            raise ValueError(f"Device speed={self.speed!r} must be a finite number > 0 (1.0 = the profiled device)")
        if self.memory is not None:
            parse_bytes(self.memory, name="Device memory")
        if self.bandwidth is not None:
            # Strings become bytes/s here, so everything downstream sees a float.
            self.bandwidth = parse_bandwidth(self.bandwidth, name="Device bandwidth")
        if self.latency_s is not None:
            _check_seconds("Device latency_s", self.latency_s)
        if self.action_overhead_s is not None:
            _check_seconds("Device action_overhead_s", self.action_overhead_s)
        if self.flops is not None and (isinstance(self.flops, bool) or not isinstance(self.flops, (int, float))
                                       or not self.flops > 0 or not math.isfinite(self.flops)):
            raise ValueError(f"Device flops={self.flops!r} must be a finite number of FLOP/s > 0 (or None: "
                             "measured on the profiling device)")

    @classmethod
    def preset(cls, name: str, *, dtype: str = "bf16", efficiency: float | None = None,
               link: str | None = None, memory: int | str | None = None) -> "Device":
        """A device from published figures: an accelerator by name, its memory, link and FLOP rate.

        For planning a cluster one does not have, with counted costs
        (``PlannerOptions(cost="flops", devices=Device.preset("H100"))``).

        Args:
            name: an accelerator of :data:`autopipe.machine.presets.ACCELERATORS`
                (``"A100"``, ``"H100"``, ``"H200"``; any case).
            dtype: the dtype the model trains in, for the peak rate (``"bf16"``, ``"fp16"``,
                ``"fp32"``: the TF32 tensor-core rate).
            efficiency: share of the peak charged (default
                :data:`~autopipe.machine.presets.DEFAULT_EFFICIENCY`, what large runs reach).
            link: the link to the next device, a key of
                :data:`~autopipe.machine.presets.LINKS` (``"nvlink4"``, ``"ib-ndr"``, ...);
                default the accelerator's in-node link. Give the inter-node one to the last
                device of a node.
            memory: capacity in place of the data sheet's (a smaller part, or memory held back).

        Raises:
            ValueError: an unknown name, dtype or link (the message lists the known ones), or
                an efficiency outside (0, 1].

        Example:
            >>> d = Device.preset("h100", link="ib-ndr")
            >>> d.memory, d.bandwidth, d.name
            ('80GB', 50000000000.0, 'H100')
        """
        from .presets import ACCELERATORS, DEFAULT_EFFICIENCY, LINKS, find_accelerator  # import nothing of ours

        key = find_accelerator(name)
        if key is None:
            raise ValueError(f"Device.preset name={name!r} is not a known accelerator; use one of {sorted(ACCELERATORS)}")
        acc = ACCELERATORS[key]
        if dtype not in acc.peak_flops:
            raise ValueError(f"Device.preset dtype={dtype!r} has no published rate for {key}; use one of "
                             f"{sorted(acc.peak_flops)}")
        eff = DEFAULT_EFFICIENCY if efficiency is None else efficiency
        if isinstance(eff, bool) or not isinstance(eff, (int, float)) or not 0 < eff <= 1:
            raise ValueError(f"Device.preset efficiency={efficiency!r} must be a share of the peak in (0, 1]")
        link_name = acc.link if link is None else link
        if link_name not in LINKS:
            raise ValueError(f"Device.preset link={link!r} is not a known link; use one of {sorted(LINKS)}")
        return cls(memory=acc.memory if memory is None else memory, bandwidth=LINKS[link_name].bandwidth,
                   latency_s=LINKS[link_name].latency_s, name=key, flops=eff * acc.peak_flops[dtype])

    @property
    def memory_bytes(self) -> float:
        """Capacity in bytes (inf when unlimited)."""
        return float("inf") if self.memory is None else parse_bytes(self.memory, name="Device memory")


#: Optimizer state kept per trainable parameter byte (Adam: exp_avg and exp_avg_sq).
OPTIMIZER_STATE_FACTORS = {
    "none": 0.0,  # inference, or state kept elsewhere
    "sgd": 0.0,
    "sgd_momentum": 1.0,
    "adagrad": 1.0,
    "rmsprop": 1.0,
    "lion": 1.0,
    "adam": 2.0,
    "adamw": 2.0,
    "adamax": 2.0,
    "nadam": 2.0,
    "radam": 2.0,
}


def optimizer_state_factor(optimizer: str | type | float) -> tuple[str, float]:
    """(canonical name, state bytes per parameter byte) for an optimizer name or class, or that factor itself.

    Example:
            >>> optimizer_state_factor("AdamW"), optimizer_state_factor(0.5)
            (('adamw', 2.0), ('0.5 bytes per parameter byte', 0.5))
    """
    if isinstance(optimizer, (int, float)) and not isinstance(optimizer, bool) and 0 <= optimizer < math.inf:
        return f"{optimizer:g} bytes per parameter byte", float(optimizer)
    key = optimizer.__name__ if isinstance(optimizer, type) else optimizer
    if isinstance(key, str):
        k = key.lower().replace("-", "_")
        if k in OPTIMIZER_STATE_FACTORS:
            return k, OPTIMIZER_STATE_FACTORS[k]
    raise ValueError(
        f"optimizer={optimizer!r} is not known; use one of {sorted(OPTIMIZER_STATE_FACTORS)}, "
        "a torch.optim class such as torch.optim.AdamW, or a number >= 0 (state bytes per parameter byte)"
    )
