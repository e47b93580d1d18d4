"""How reports write quantities: bytes, seconds, and the profile's one-line summary.

Example:
    >>> format_seconds(0.0123)
    '12.30 ms'
"""

from __future__ import annotations

from typing import Any


def format_seconds(s: float) -> str:
    """Seconds in the unit that reads best (s, ms, us)."""
    if s >= 1:
        return f"{s:.3f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    return f"{s * 1e6:.1f} us"


def whole_pass_line(whole: dict[str, Any]) -> str:
    """One sentence on the profile's segments against the whole graph timed beside them (``WholePass`` as a dict).

    Example:
        >>> whole_pass_line(dict(segments_fwd_s=0.012, segments_bwd_s=0.02, fwd_s=0.008, bwd_s=0.01,
        ...                      scales=(0.67, 0.5, 0.4), fitted=True))  # doctest: +NORMALIZE_WHITESPACE
        'Profile: the segments timed one by one came to 12.00 ms forward and 20.00 ms backward, the whole graph
        timed as one to 8.00 ms and 10.00 ms; segments scaled x0.67 and x0.50 to it.'
    """
    scaled = (f"segments scaled x{whole['scales'][0]:.2f} and x{whole['scales'][1]:.2f} to it" if whole["fitted"]
              else "segments not scaled to it")
    return (f"Profile: the segments timed one by one came to {format_seconds(whole['segments_fwd_s'])} forward "
            f"and {format_seconds(whole['segments_bwd_s'])} backward, the whole graph timed as one to "
            f"{format_seconds(whole['fwd_s'])} and {format_seconds(whole['bwd_s'])}; {scaled}.")
