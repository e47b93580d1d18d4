"""A wall-clock bound for tests of "refuses absurd input instead of working on it".

The bound is generous on purpose: it is not a speed target, it only turns "works for
minutes, then runs out of memory" into a test failure within seconds.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator

#: Seconds a refusal may take: far above what checking arguments needs (well under one
#: second), far below the minutes the refused work would take.
REFUSAL_BOUND_S = 5.0


class StillWorking(BaseException):
    """Raised inside the block when the bound passes; a BaseException, so that neither the
    code under test nor ``pytest.raises(ValueError)`` can take it for an ordinary error."""


@contextlib.contextmanager
def refused_within(seconds: float = REFUSAL_BOUND_S) -> Iterator[None]:
    """Interrupt the block with :class:`StillWorking` once ``seconds`` of wall time have passed.

    Example:
        >>> with refused_within():  # doctest: +SKIP
        ...     with pytest.raises(ValueError):
        ...         autopipe.partition(model, 10**6, example_args=args)
    """
    def stop(signum: int, frame: object) -> None:
        raise StillWorking(f"still working after {seconds} s: the input was not refused before the work")

    previous = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
