"""How long a GPU takes for a GEMM, an attention core, element-wise work and a collective.

Every time is the device's data-sheet rate times a stated efficiency
(:class:`Efficiency`), shaped by what limits each kernel:

- a GEMM of ``m x k`` by ``k x n`` runs at the slower of its FLOPs at ``gemm`` of the peak and
  its bytes at ``memory`` of the HBM bandwidth (a roofline), plus a fixed ``kernel_s``: the
  thin shards of a high tensor-parallel degree read as many bytes per FLOP as they must and
  fall below the FLOP rate;
- a fused attention kernel runs at ``attention`` times a large GEMM's rate, and a float8
  GEMM at ``fp8_gemm`` times the fp8 peak scaled the same way: the ratios between kernels
  are shared by every accelerator, the GEMM share is each accelerator's own; an unfused one (scores
  materialized, as Megatron-LM before flash attention) as batched GEMMs plus its softmax's
  bytes;
- element-wise work at ``memory`` of the HBM bandwidth;
- ring collectives move ``2 (n - 1) / n`` (all-reduce) or ``(n - 1) / n`` (all-gather,
  reduce-scatter) of the message over the slowest link the group crosses, at ``collective``
  of its bandwidth, plus one link latency per ring step.

Example:
    >>> from autopipe.machine.topology import Topology
    >>> gpu = GpuCosts("H100", Topology(gpus_per_node=8, intra="nvlink4", inter="ib-ndr"))
    >>> big = gpu.gemm_s(8192, 8192, 8192)
    >>> thin = gpu.gemm_s(8192, 8192, 64)        # a sliver of the same GEMM's FLOPs ...
    >>> thin > big * 64 / 8192                   # ... runs below the FLOP rate
    True
    >>> gpu.allreduce_s(1 << 30, 8, crosses_nodes=False) < gpu.allreduce_s(1 << 30, 16, crosses_nodes=True)
    True
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

from ..machine.device import parse_bytes
from ..machine.presets import ACCELERATORS, find_accelerator
from ..machine.topology import Topology


@dataclass(frozen=True)
class Efficiency:
    """Shares of the data-sheet rates that kernels reach (see the module docstring).

    The defaults are fitted by ``benchmarks/published_layouts`` on the published runs it
    names as fitting rows (its README holds the fit and the held-out errors); the other
    shares are stated, not fitted.

    Args:
        gemm: of the dense peak, for a large GEMM, per accelerator name (``"A100"``, ...);
            ``"*"`` for any other.
        attention: a fused (flash) attention kernel's FLOP rate over a large GEMM's.
        fp8_gemm: a float8 GEMM's share of the fp8 peak over a bf16 GEMM's share of the bf16 peak.
        memory: of the HBM bandwidth, for element-wise kernels.
        collective: of a link's bandwidth, for NCCL's ring collectives and sends.
        kernel_s: fixed seconds per GEMM (launch and tail).
        compiled_memory: share of the element-wise bytes left when the stages are compiled
            (torch.compile fuses element-wise chains, so intermediates are not written back).
    """

    gemm: dict[str, float] = field(default_factory=lambda: {"A100": 0.83, "H100": 0.73, "H100-HBM2e": 0.41,
                                                             "*": 0.6})
    attention: float = 0.51
    fp8_gemm: float = 1.27
    memory: float = 0.7
    collective: float = 0.75
    kernel_s: float = 5e-6
    compiled_memory: float = 0.81

    def gemm_share(self, accelerator: str) -> float:
        return self.gemm.get(accelerator, self.gemm.get("*", 0.6))


class GpuCosts:
    """Kernel and collective times on one accelerator of a :class:`Topology`.

    Args:
        accelerator: a name of :data:`autopipe.machine.presets.ACCELERATORS`.
        topology: the nodes: GPUs per node and the links inside and between nodes.
        dtype: the training dtype's peak (``"bf16"``, ``"fp16"``).
        efficiency: the shares of each rate reached.

        memory_bytes: device memory in place of the data sheet's (a part with more or less).
        memory_bandwidth: HBM bytes/s in place of the data sheet's.

    Raises:
        ValueError: an unknown accelerator or dtype, or one with no published memory bandwidth.
    """

    def __init__(self, accelerator: str, topology: Topology, *, dtype: str = "bf16",
                 efficiency: Efficiency | None = None, memory_bytes: float | None = None,
                 memory_bandwidth: float | None = None) -> None:
        key = find_accelerator(accelerator)
        if key is None:
            raise ValueError(f"GpuCosts accelerator={accelerator!r} is not known; use one of {sorted(ACCELERATORS)}")
        acc = ACCELERATORS[key]
        if dtype not in acc.peak_flops or not acc.memory_bandwidth:
            raise ValueError(f"GpuCosts dtype={dtype!r}: {key} has no published rate for it; use one of "
                             f"{sorted(acc.peak_flops)}")
        self.name = key
        self.topology = topology
        self.efficiency = efficiency or Efficiency()
        self.peak = acc.peak_flops[dtype]
        self.fp8_peak = acc.peak_flops.get("fp8", self.peak)
        self.hbm = memory_bandwidth or acc.memory_bandwidth
        self.memory_bytes = memory_bytes or parse_bytes(acc.memory, name="memory")
        self.dtype_bytes = 4 if dtype == "fp32" else 2

    def with_efficiency(self, efficiency: Efficiency) -> "GpuCosts":
        """The same GPU and cluster charged at other shares."""
        other = copy.copy(self)
        other.efficiency = efficiency
        return other

    # ------------------------------------------------------------------ compute

    def gemm_s(self, m: float, n: float, k: float, *, fp8: bool = False) -> float:
        """Seconds for one ``(m x k) @ (k x n)`` GEMM."""
        e = self.efficiency
        flops = 2.0 * m * n * k
        share = e.gemm_share(self.name)
        rate = self.fp8_peak * min(1.0, share * e.fp8_gemm) if fp8 else self.peak * share
        elem = 1 if fp8 else self.dtype_bytes
        moved = elem * (m * k + k * n) + self.dtype_bytes * m * n
        return max(flops / rate, moved / (self.hbm * e.memory)) + e.kernel_s

    def flash_attention_s(self, flops: float) -> float:
        """Seconds for a fused attention kernel doing ``flops``."""
        return flops / (self.gemm_rate() * self.efficiency.attention)

    def memory_s(self, moved_bytes: float) -> float:
        """Seconds for element-wise kernels reading and writing ``moved_bytes``."""
        return moved_bytes / (self.hbm * self.efficiency.memory)

    def gemm_rate(self) -> float:
        """FLOP/s of a large GEMM (for batched GEMMs counted by FLOPs alone)."""
        return self.peak * self.efficiency.gemm_share(self.name)

    # ------------------------------------------------------------------ communication

    def link(self, crosses_nodes: bool) -> tuple[float, float]:
        """``(bytes/s, latency s)`` of the slowest link a group crossing nodes or not uses."""
        bandwidth, latency = self.topology.inter_link if crosses_nodes else self.topology.intra_link
        return bandwidth * self.efficiency.collective, latency

    def allreduce_s(self, message_bytes: float, n: int, *, crosses_nodes: bool) -> float:
        """Seconds for a ring all-reduce of ``message_bytes`` over ``n`` ranks."""
        if n <= 1:
            return 0.0
        bandwidth, latency = self.link(crosses_nodes)
        return 2 * (n - 1) / n * message_bytes / bandwidth + 2 * (n - 1) * latency

    def allgather_s(self, message_bytes: float, n: int, *, crosses_nodes: bool) -> float:
        """Seconds for a ring all-gather (or reduce-scatter) whose full result is ``message_bytes``."""
        if n <= 1:
            return 0.0
        bandwidth, latency = self.link(crosses_nodes)
        return (n - 1) / n * message_bytes / bandwidth + (n - 1) * latency

    def send_s(self, message_bytes: float, *, crosses_nodes: bool) -> float:
        """Seconds for one point-to-point send between pipeline neighbours."""
        bandwidth, latency = self.link(crosses_nodes)
        return message_bytes / bandwidth + latency
