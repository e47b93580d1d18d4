"""Argument checks shared by every entry point."""

from __future__ import annotations

import numbers
from collections.abc import Collection, Sequence
from typing import Any

def is_int(value: Any) -> bool:
    """Whether ``value`` is an integer (numpy's included), and not a bool."""
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
    """``value`` as an ``int``, or an error naming ``name``, the value and the accepted range."""
    accepted = f"an integer >= {minimum}" + (f" and <= {maximum}" if maximum is not None else "")
    suffix = f" ({what})" if what else ""
    if not is_int(value):
        raise not_int(f"{name}={value!r} must be {accepted}{suffix}")
    if value < minimum or (maximum is not None and value > maximum):
        raise ValueError(f"{name}={value!r} must be {accepted}{suffix}")
    return int(value)


def check_distinct_sizes(name: str, values: Any, *, unit: str, why: str, example: str) -> list[int]:
    """``values`` as a sorted list of its distinct integers >= 1, of which there must be two or more.

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
    """Refuse a count past ``most`` before any work sized by it starts."""
    if value > most:
        raise ValueError(f"{name}={value} is more than autopipe plans for; use at most {most} {what}")


def check_choice(name: str, value: Any, choices: Collection[Any]) -> Any:
    """``value`` if it is one of ``choices``, else a ValueError listing them."""
    try:
        known = value in choices
    except TypeError:  # an unhashable value against a set or mapping
        known = False
    if not known:
        raise ValueError(f"{name}={value!r} is not known; use one of {list(choices)}")
    return value


def check_bool(name: str, value: Any, *, allow_none: bool = False) -> None:
    """Raise ``ValueError`` unless ``value`` is True or False (or None, with ``allow_none``)."""
    if isinstance(value, bool) or (allow_none and value is None):
        return
    raise ValueError(f"{name}={value!r} must be " + ("True, False or None" if allow_none else "True or False"))


