"""The host memory a piece of work needs: the process's peak resident set while it runs.

Planning a model far bigger than one device must not need that model in host memory;
:class:`PeakResidentMemory` measures what planning did need, for the plan to report.

On Linux the kernel keeps the resident high-water mark (``VmHWM`` in ``/proc/self/status``)
and lets a process reset it (writing ``5`` to ``/proc/self/clear_refs``), so the peak is the
work's own. Elsewhere only the process's peak since it started is known
(``resource.getrusage``), which is an upper bound; ``since_start`` says which was measured.

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

    glibc keeps freed heap pages in the process, for its next allocations, unless they lie at
    the heap's top. Building a pipeline frees tens of MiB of tracing objects in the middle of
    the heap, so without this a rank's resident memory keeps them through training. A no-op
    (False) where the C library is not glibc.

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
    """Context manager: the peak resident memory of the process while the block ran.

    Attributes:
        bytes: the peak, in bytes, once the block has ended (0 before).
        since_start: True where only the process's peak since it started could be read
            (not Linux), which includes everything before the block.
    """

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
