"""Published figures of common accelerators and links, to plan for a cluster one does not have.

Example:
    >>> ACCELERATORS["H100"].memory
    '80GB'
    >>> LINKS["ib-ndr"].bandwidth
    50000000000.0
"""

from __future__ import annotations

from dataclasses import dataclass

@dataclass(frozen=True)
class Link:
    """A link between two pipeline neighbours: bytes per second in one direction, seconds per message."""

    bandwidth: float
    latency_s: float
    source: str  # where the bandwidth is published


@dataclass(frozen=True)
class Accelerator:
    """One accelerator's data-sheet figures."""

    peak_flops: dict[str, float]  # dense FLOP/s per dtype ("bf16", "fp32": the TF32 tensor-core rate)
    memory: str
    link: str  # the usual link to a neighbour in the same node (a key of LINKS)
    source: str
    memory_bandwidth: float = 0.0  # bytes/s of the device memory (HBM)


# Message latencies are an order of magnitude for one NCCL point-to-point send, not a
# data-sheet figure: they matter only for small activations at a cut.
LINKS: dict[str, Link] = {
    "nvlink3": Link(300e9, 10e-6, "NVIDIA A100 data sheet: NVLink 600 GB/s, both directions together"),
    "nvlink4": Link(450e9, 10e-6, "NVIDIA H100 data sheet: NVLink 900 GB/s, both directions together"),
    "pcie4": Link(32e9, 20e-6, "PCI Express 4.0 x16: 16 GT/s per lane, 16 lanes, one direction"),
    "pcie5": Link(64e9, 20e-6, "PCI Express 5.0 x16: 32 GT/s per lane, 16 lanes, one direction"),
    "ib-hdr": Link(25e9, 20e-6, "InfiniBand HDR: 200 Gb/s per port"),
    "ib-ndr": Link(50e9, 20e-6, "InfiniBand NDR: 400 Gb/s per port"),
}

ACCELERATORS: dict[str, Accelerator] = {
    "A100": Accelerator({"bf16": 312e12, "fp16": 312e12, "fp32": 156e12}, "80GB", "nvlink3",
                        "NVIDIA A100 Tensor Core GPU data sheet (SXM4 80GB)", memory_bandwidth=2.039e12),
    "H100": Accelerator({"bf16": 989e12, "fp16": 989e12, "fp32": 494e12, "fp8": 1979e12}, "80GB", "nvlink4",
                        "NVIDIA H100 Tensor Core GPU data sheet (SXM5)", memory_bandwidth=3.35e12),
    # torchtitan's benchmark hosts (benchmarks/llama3_h100_202412_torchtitan.md): SXM H100s with
    # 96 GB of HBM2e at 2.4 TB/s and a 500 W limit, whose peak "lies between SXM and NVL"; the
    # SXM figure is kept and the planner's fitted GEMM share for this part absorbs the rest.
    "H100-HBM2e": Accelerator({"bf16": 989e12, "fp16": 989e12, "fp32": 494e12, "fp8": 1979e12}, "96GB", "nvlink4",
                              "pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md (Grand Teton, 500 W)",
                              memory_bandwidth=2.4e12),
    "H200": Accelerator({"bf16": 989e12, "fp16": 989e12, "fp32": 494e12, "fp8": 1979e12}, "141GB", "nvlink4",
                        "NVIDIA H200 Tensor Core GPU data sheet (SXM)", memory_bandwidth=4.8e12),
}

#: Share of the peak FLOP rate a large training run reaches (its model FLOPs utilization).
#: Published runs report about 0.4: 38-43% BF16 MFU for Llama 3 405B on H100s (Llama 3
#: paper, 2024, Table 4), 46% for PaLM 540B on TPU v4 (PaLM paper, 2022).
DEFAULT_EFFICIENCY = 0.4


def find_accelerator(name: object) -> str | None:
    """The key of :data:`ACCELERATORS` that ``name`` spells in any case, or None.

    Example:
        >>> find_accelerator("h100-hbm2e"), find_accelerator("V100")
        ('H100-HBM2e', None)
    """
    return next((k for k in ACCELERATORS if isinstance(name, str) and k.lower() == name.lower()), None)
