"""The machine: device speed and memory, the link between ranks, the per-action overhead.

:mod:`autopipe.machine.device` holds :class:`~autopipe.machine.device.Device` (a device's
speed, memory and link, with presets for planning hardware one does not have);
:mod:`autopipe.machine.measure` measures them on this machine.
"""
