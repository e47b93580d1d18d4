"""Argument checks shared by every entry point.

Each check raises an error that names the argument, repeats the value given and says what
is accepted, so that a bad call fails before any tracing, profiling or process start.

Example::

    from autopipe._checks import check_int, check_choice
    n = check_int("n_microbatches", 8)                  # 8
    check_choice("objective", "step", ("step", "bottleneck"))
    check_int("repeats", 0)  # ValueError: repeats=0 must be an integer >= 1
"""

from __future__ import annotations

import numbers
from collections.abc import Collection, Sequence
from typing import Any

def is_int(value: Any) -> bool:
    """Whether ``value`` is an integer (numpy's included), and not a bool.

    ``True`` is an ``int`` to Python; as a count it is almost always a mistake.

    Example::

        is_int(3), is_int(True), is_int(3.0)   # (True, False, False)
    """
    return not isinstance(value, bool) and isinstance(value, numbers.Integral)


def listed(items: Collection[Any], most: int = 8) -> str:
    """``items`` for an error message: all of them, or the first ``most`` and how many more.

    Example:
        >>> listed(range(3)), listed([f"w{i}" for i in range(10)], most=2)
        ('[0, 1, 2]', "['w0', 'w1'] and 8 more")
    """
    items = list(items)
    return str(items) if len(items) <= most else f"{items[:most]} and {len(items) - most} more"


def check_int(name: str, value: Any, minimum: int = 1, maximum: int | None = None, *, what: str = "",
              not_int: type[Exception] = ValueError) -> int:
    """``value`` as an ``int``, or an error naming ``name``, the value and the accepted range.

    Args:
        name: The argument's name, as the caller spells it.
        value: What was given.
        minimum: The smallest accepted value.
        maximum: The largest accepted value; None = no bound.
        what: What the number counts, added to the message (``"micro-batches per step"``).
        not_int: The exception raised when ``value`` is not an integer at all; a value out
            of range always raises ``ValueError``.

    Raises:
        ValueError: out of range (or not an integer, unless ``not_int`` says otherwise).

    Example::

        check_int("warmup", 0, minimum=0)   # 0
        check_int("n_gpus", 2.5)            # ValueError: n_gpus=2.5 must be an integer >= 1
    """
    accepted = f"an integer >= {minimum}" + (f" and <= {maximum}" if maximum is not None else "")
    suffix = f" ({what})" if what else ""
    if not is_int(value):
        raise not_int(f"{name}={value!r} must be {accepted}{suffix}")
    if value < minimum or (maximum is not None and value > maximum):
        raise ValueError(f"{name}={value!r} must be {accepted}{suffix}")
    return int(value)


def check_distinct_sizes(name: str, values: Any, *, unit: str, why: str, example: str) -> list[int]:
    """``values`` as a sorted list of its distinct integers >= 1, of which there must be two or more.

    For the size ladders a fit needs (message sizes for a link, micro-batch sizes for a
    scaling fit): one size cannot separate a fixed cost from a per-unit one.

    Example:
        >>> check_distinct_sizes("sizes", [4, 1, 4], unit="micro-batch size", why="to fit costs", example="(1, 2, 4)")
        [1, 4]
    """
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise ValueError(f"{name}={values!r} must be a list of {unit}s (integers >= 1), e.g. {example}")
    for v in values:
        if not is_int(v) or v < 1:
            raise ValueError(f"{name}={list(values)!r}: {v!r} is not a {unit}; use integers >= 1")
    distinct = sorted({int(v) for v in values})
    if len(distinct) < 2:
        raise ValueError(f"{name}={list(values)!r} must hold at least two distinct {unit}s {why}, e.g. {example}")
    return distinct


def check_at_most(name: str, value: int, most: int, what: str) -> None:
    """Refuse a count past ``most`` before any work sized by it starts.

    Example::

        check_at_most("n_gpus", 4, 8, "ranks")   # passes
        check_at_most("n_gpus", 9, 8, "ranks")   # ValueError: n_gpus=9 is more than ...; use at most 8 ranks
    """
    if value > most:
        raise ValueError(f"{name}={value} is more than autopipe plans for; use at most {most} {what}")


def check_choice(name: str, value: Any, choices: Collection[Any]) -> Any:
    """``value`` if it is one of ``choices``, else a ValueError listing them.

    Example::

        check_choice("objective", "step", ("step", "bottleneck"))   # "step"
    """
    try:
        known = value in choices
    except TypeError:  # an unhashable value against a set or mapping
        known = False
    if not known:
        raise ValueError(f"{name}={value!r} is not known; use one of {list(choices)}")
    return value


def check_bool(name: str, value: Any, *, allow_none: bool = False) -> None:
    """Raise ``ValueError`` unless ``value`` is True or False (or None, with ``allow_none``).

    Example::

        check_bool("flush_cache", True)   # passes
        check_bool("flush_cache", 1)      # ValueError: flush_cache=1 must be True or False
    """
    if isinstance(value, bool) or (allow_none and value is None):
        return
    raise ValueError(f"{name}={value!r} must be " + ("True, False or None" if allow_none else "True or False"))


