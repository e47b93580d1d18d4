"""The machine: device speed and memory, the link between ranks, and timing work on a device.

The bottom of the data flow; nothing here imports the planner or the runtime.

* :mod:`autopipe.machine.device`: :class:`~autopipe.machine.device.Device` (a device's speed,
  memory and link, with presets for planning hardware one does not have);
* :mod:`autopipe.machine.timing`: timing one call on a device, emptying its caches;
* :mod:`autopipe.machine.passes`: timing a module's forward and backward passes, alone or in
  rounds as a pipeline stage runs them (what the profiler builds on);
* :mod:`autopipe.machine.speed`: a device's matmul throughput and measured ``Device`` lists;
* :mod:`autopipe.machine.link`: the latency and bandwidth between two ranks.

The runtime's cost per pipeline action is measured by running the runtime:
:mod:`autopipe.runtime.overhead_probe`. ``autopipe measure`` measures the
machine once from the command line.
"""

from __future__ import annotations

from .._lazy import lazy_exports

# Public name -> the module that defines it, loaded on first use.
_PUBLIC = {
    "Device": "device",
    "parse_bytes": "device",
    "Topology": "topology",
    "Timer": "timing",
    "measure_link": "link",
    "LinkMeasurement": "link",
    "measure_device_speed": "speed",
    "measure_devices": "speed",
}

__all__ = list(_PUBLIC)
__getattr__, __dir__ = lazy_exports(__name__, _PUBLIC)
