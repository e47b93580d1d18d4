"""The host memory a piece of work needs: the process's peak resident set while it runs.

Example:
    >>> with PeakResidentMemory() as peak:
    ...     block = bytearray(64 * 2**20)
    >>> peak.bytes >= 64 * 2**20
    True
"""

from __future__ import annotations

import resource
import sys
from types import TracebackType

_STATUS = "/proc/self/status"


def _status_kib(field: str) -> int | None:
    """A ``kB`` field of ``/proc/self/status`` (Linux), or None where there is none."""
    try:
        with open(_STATUS) as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def resident_bytes() -> int | None:
    """This process's resident memory now, in bytes (None where the system does not say).

    Example:
        >>> resident_bytes() is None or resident_bytes() > 0
        True
    """
    kib = _status_kib("VmRSS")
    return None if kib is None else kib * 1024


def return_freed_heap() -> bool:
    """Give memory the process has freed back to the system (glibc's ``malloc_trim``); whether it could.

    Example:
        >>> return_freed_heap() in (True, False)
        True
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # musl and others have no malloc_trim
        return False
    trim(0)
    return True


class PeakResidentMemory:
    """Context manager: the peak resident memory of the process while the block ran."""

    def __init__(self) -> None:
        self.bytes = 0
        self.since_start = False

    def start(self) -> "PeakResidentMemory":
        """Begin measuring (what entering the ``with`` block does)."""
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current resident size
        except OSError:
            self.since_start = True
        return self

    def stop(self) -> int:
        """End measuring; returns (and keeps in ``bytes``) the peak since :meth:`start`."""
        kib = None if self.since_start else _status_kib("VmHWM")
        if kib is not None:
            self.bytes = kib * 1024
        else:
            self.since_start = True
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            self.bytes = peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB elsewhere
        return self.bytes

    def __enter__(self) -> "PeakResidentMemory":
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
