"""A cluster of nodes: how many GPUs share a node, the link inside a node and the one between nodes.

Example:
    >>> from autopipe.machine.device import Device
    >>> topo = Topology(Device.preset("H100"), gpus_per_node=8, intra="nvlink4", inter="ib-ndr")
    >>> [d.bandwidth for d in topo.pipeline_devices(2)] == [450e9, 450e9]
    True
    >>> topo.dp_link(pp=2, dp=8)[0], topo.crossing(pp=2, dp=8)
    (50000000000.0, 'dp')
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from .device import Device

def _link(arg: str, value: str | tuple[float, float]) -> tuple[float, float]:
    """``(bandwidth bytes/s, latency s)`` of a link preset name or a pair."""
    from .presets import LINKS  # the tables import nothing of ours

    if isinstance(value, str) and value in LINKS:
        return LINKS[value].bandwidth, LINKS[value].latency_s
    if (isinstance(value, tuple) and len(value) == 2 and all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                                             for x in value) and value[0] > 0 and value[1] >= 0):
        return float(value[0]), float(value[1])
    raise ValueError(f"Topology {arg}={value!r} is not a link; use one of {sorted(LINKS)} or a pair "
                     "(bandwidth bytes/s > 0, latency seconds >= 0)")


@dataclass(frozen=True)
class Topology:
    """Nodes of ``gpus_per_node`` identical devices: ``intra`` links inside a node, ``inter`` between.

    Args:
        device: what every rank is (speed, memory, FLOP rate); its own link is replaced by
            ``intra`` / ``inter``. Default: ``Device()``.
        gpus_per_node: devices per node, >= 1.
        intra: the link between two devices of a node: a key of
            :data:`autopipe.machine.presets.LINKS` (``"nvlink4"``) or ``(bytes/s, seconds)``.
        inter: the link between nodes, per device (``"ib-ndr"``: one 400 Gb/s port per GPU).

    Raises:
        ValueError: an unknown link, ``gpus_per_node`` < 1, or ``device`` not a Device.

    Example:
        >>> Topology(gpus_per_node=4, intra="pcie4", inter="ib-hdr").intra_link
        (32000000000.0, 2e-05)
    """

    device: Device = field(default_factory=Device)
    gpus_per_node: int = 8
    intra: str | tuple[float, float] = "nvlink4"
    inter: str | tuple[float, float] = "ib-ndr"

    def __post_init__(self) -> None:
        if not isinstance(self.device, Device):
            raise ValueError(f"Topology device={self.device!r} must be an autopipe.Device (e.g. Device.preset('H100'))")
        g = self.gpus_per_node
        if isinstance(g, bool) or not isinstance(g, int) or g < 1:
            raise ValueError(f"Topology gpus_per_node={g!r} must be an integer >= 1")
        _link("intra", self.intra), _link("inter", self.inter)

    @property
    def intra_link(self) -> tuple[float, float]:
        """``(bytes/s, seconds)`` between two devices of one node."""
        return _link("intra", self.intra)

    @property
    def inter_link(self) -> tuple[float, float]:
        """``(bytes/s, seconds)`` between nodes, per device."""
        return _link("inter", self.inter)

    def _node(self, rank: int) -> int:
        return rank // self.gpus_per_node

    def pipeline_devices(self, pp: int, dp: int = 1) -> list[Device]:
        """One Device per pp rank, its link to the next pp rank ``inter`` where that send leaves a node.

        A send from pp rank ``p`` crosses nodes if it does in any replica (row-major layout).

        Example:
            >>> [d.bandwidth for d in Topology(gpus_per_node=2, intra=(4.0, 0.0), inter=(1.0, 0.0)).pipeline_devices(4)]
            [4.0, 1.0, 4.0, 4.0]
        """
        out = []
        for p in range(pp):
            crosses = p + 1 < pp and any(self._node(d * pp + p) != self._node(d * pp + p + 1) for d in range(dp))
            bandwidth, latency = self.inter_link if crosses else self.intra_link
            out.append(replace(self.device, bandwidth=bandwidth, latency_s=latency))
        return out

    def dp_crosses_nodes(self, pp: int, dp: int) -> bool:
        """Whether some data-parallel group (one pp rank, every replica) spans more than one node."""
        return any(len({self._node(d * pp + p) for d in range(dp)}) > 1 for p in range(pp))

    def dp_link(self, pp: int, dp: int) -> tuple[float, float]:
        """``(bytes/s, seconds)`` a data-parallel ring runs at: ``inter`` if any of its groups leaves a node.

        A ring is as fast as its slowest hop, so one hop between nodes sets the pace.
        """
        return self.inter_link if self.dp_crosses_nodes(pp, dp) else self.intra_link

    def crossing(self, pp: int, dp: int) -> str:
        """Which dimension leaves a node: ``"none"``, ``"dp"``, ``"pp"`` or ``"both"``.

        Example:
            >>> Topology(gpus_per_node=8).crossing(pp=16, dp=2)
            'both'
        """
        pp_out = any(self._node(d * pp + p) != self._node(d * pp + p + 1) for d in range(dp) for p in range(pp - 1))
        dp_out = self.dp_crosses_nodes(pp, dp)
        return {(False, False): "none", (False, True): "dp", (True, False): "pp", (True, True): "both"}[(pp_out, dp_out)]
