"""Which link the planner charges between ranks when the user gives none.

Planning never measures on its own: a link measured before on this host (``autopipe
measure``, or ``ProfileOptions(measure_link=True)``) is charged where it can decide the
split; without one the planner charges the assumed default and its note says how to measure.

Example:
    >>> from autopipe.machine.link import LinkMeasurement
    >>> fake = LinkMeasurement(8e9, 3e-5, [1024, 1 << 20], [3e-5, 1.6e-4], [[3e-5], [1.6e-4]], 0.0, "gloo",
    ...                        ("cpu", "cpu"))
    >>> def search(link):  # a cut at 2 unless a byte costs over 0.2 ns
    ...     cuts = (2,) if 1 / link[0] < 2e-10 else (1,)
    ...     return cuts, cuts
    >>> choice, cuts = choose_link(search, assumed=(2e9, 1e-4), mode="auto", known=lambda: fake)
    >>> choice.source, cuts
    ('measured', (2,))
    >>> choose_link(search, assumed=(2e9, 1e-4), mode="auto", known=lambda: None)[0].source
    'assumed'
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from .._checks import check_bool
from ..machine.device import Device, step_message_s
from ..machine.link import LinkMeasurement
from ..machine.link_cache import MeasureFn, known_link, loopback_link
from .cost_sources import CostSource

#: A link on which communication costs nothing: what the split would be if links were free.
FREE_LINK = (math.inf, 0.0)

#: What :func:`choose_link` may do: charge a measured link only if the link decides the split, always, never.
MODES = ("auto", "always", "never")

R = TypeVar("R")


@dataclass(frozen=True)
class LinkChoice:
    """The default link the planner charged, where it came from, and why."""

    bandwidth: float
    latency_s: float
    source: str
    reason: str
    measurement: LinkMeasurement | None = None

    @property
    def link(self) -> tuple[float, float]:
        """``(bandwidth bytes/s, latency s)``, as the planner's ``link_default``."""
        return self.bandwidth, self.latency_s

    def note(self) -> str:
        """One sentence for ``plan.notes``: the link charged and why."""
        figures = f"{self.bandwidth / 1e9:.3g} GB/s and {self.latency_s * 1e6:.3g} us per message"
        if self.source == "measured":
            idle = self.measurement.latency_s if self.measurement is not None else self.latency_s
            if idle < self.latency_s:  # the in-step cost of a message, not the idle ping-pong's
                figures += f" (idle {idle * 1e6:.3g} us; a message inside a step waits for a core)"
            return f"link between ranks measured on this host: {figures} ({self.reason})"
        return f"link between ranks assumed: {figures} ({self.reason})"


def link_mode(measure_link: bool | None, *, device_type: str, cost_source: CostSource,
              devices: Sequence[Device], in_process_group: bool) -> tuple[str, str]:
    """``(mode, why)``: whether :func:`choose_link` may measure, from the planner's inputs.

    Example:
        >>> from autopipe.planning.cost_sources import FLOPS, MEASURED
        >>> link_mode(None, device_type="cpu", cost_source=FLOPS, devices=[Device()] * 2, in_process_group=False)
        ('never', 'the costs are estimated, not measured on this host')
        >>> link_mode(None, device_type="cpu", cost_source=MEASURED, devices=[Device()] * 2,
        ...           in_process_group=False)[0]
        'auto'
    """
    check_bool("ProfileOptions measure_link", measure_link, allow_none=True)
    given = all(d.bandwidth is not None and d.latency_s is not None for d in devices)
    if measure_link is False:
        return "never", "ProfileOptions(measure_link=False)"
    if len(devices) < 2:
        return "never", "one rank: no link"
    if measure_link is True:
        if given:
            return "never", "every Device gives its link"
        if device_type not in ("cpu", "cuda"):
            raise ValueError(f"ProfileOptions measure_link=True: a link is measured between 'cpu' processes or "
                             f"'cuda' GPUs, not on device type {device_type!r}; give Device(bandwidth=..., "
                             "latency_s=...) instead")
        return "always", "ProfileOptions(measure_link=True)"
    if any(d.bandwidth is not None or d.latency_s is not None for d in devices):
        return "never", "a Device gives its link"
    if not cost_source.measured:
        return "never", "the costs are estimated, not measured on this host"
    if device_type != "cpu":
        return "never", f"the default for {device_type} ranks; measure yours with measure_link or measure_devices"
    if in_process_group:
        return "never", "planned inside a process group, whose ranks wait for the plan"
    if os.environ.get("AUTOPIPE_MEASURE_LINK", "").strip().lower() in ("0", "false", "no", "off"):
        return "never", "AUTOPIPE_MEASURE_LINK=0"
    return "auto", "the link may decide the split"


def choose_link(
    search: Callable[[tuple[float, float]], tuple[R, Hashable]], *, assumed: tuple[float, float], mode: str,
    device_type: str = "cpu", measure: MeasureFn | None = None, why: str = "",
    known: Callable[[], LinkMeasurement | None] | None = None,
) -> tuple[LinkChoice, R]:
    """Run ``search`` with the link that ``mode`` calls for, and say which link it was.

    Example:
        >>> choice, result = choose_link(lambda link: ("plan", (3,)), assumed=(2e9, 1e-4), mode="auto",
        ...                              measure=lambda: 1 / 0)  # the same split: never measured
        >>> choice.source, choice.reason
        ('assumed', 'the split is the same with free communication')
    """
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is not one of {list(MODES)}")
    if mode == "never":
        return LinkChoice(*assumed, source="assumed", reason=why or "not measured"), search(assumed)[0]
    if mode == "auto":
        result, split = search(assumed)
        _, free_split = search(FREE_LINK)
        if split == free_split:
            return LinkChoice(*assumed, source="assumed", reason="the split is the same with free communication"), result
        reason = (f"the assumed {assumed[0] / 1e9:.3g} GB/s and {assumed[1] * 1e6:.3g} us gave the split "
                  f"{_show(split)}, free communication {_show(free_split)}")
        link = known() if known is not None else known_link(device_type)
        if link is None:  # planning measures nothing by itself: say how to
            return LinkChoice(*assumed, source="assumed", reason=f"{reason}; no link measured on this host: run "
                              "`autopipe measure` or give ProfileOptions(measure_link=True)"), result
        return _measured(link, reason, device_type, search)
    # "always": asked for by name, so measured now where this host has no measurement; a failure is raised.
    return _measured(loopback_link(device_type, measure=measure), why or "asked for", device_type, search)


def _measured(link: LinkMeasurement, reason: str, device_type: str,
              search: Callable[[tuple[float, float]], tuple[R, Hashable]]) -> tuple[LinkChoice, R]:
    # An idle ping-pong measures the wire; a message inside a step between CPU ranks costs more.
    choice = LinkChoice(link.bandwidth_bytes_per_s, step_message_s(device_type, link.latency_s), source="measured",
                        reason=reason, measurement=link)
    return choice, search(choice.link)[0]


def _show(split: Any) -> str:
    return str(list(split)) if isinstance(split, tuple) and all(isinstance(x, int) for x in split) else str(split)
