"""Checks of single values read from a plan file: each failure names the field and what it accepts.

Example:
    >>> from autopipe.planning.plan_checks import FieldCheck
    >>> FieldCheck(None).integer("n_microbatches", 4, 1)
    4
    >>> FieldCheck(None).number("stages[0].fwd_s", -1.0)
    Traceback (most recent call last):
    ...
    autopipe.errors.PlanFileError: plan data: stages[0].fwd_s=-1.0 must be a finite number >= 0
"""

from __future__ import annotations

import collections
import math
import numbers
from collections.abc import Callable, Mapping
from dataclasses import MISSING, fields
from typing import Any, NoReturn

from ..errors import PlanFileError

#: Most pipeline stages a plan, or ``partition(n_gpus=...)``, may ask for.
MAX_STAGES = 10**5

#: Largest integer a plan may hold (byte counts, segment numbers): int64, what numpy and
#: torch count bytes in.
MAX_PLAN_INT = 2**63 - 1

_SHOWN_CHARS = 60  # how much of a bad value an error message repeats


class FieldCheck:
    """Checks of single values; every failure names the field and what it accepts."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self.where = "plan data" if path is None else f"plan file {path!r}"

    def fail(self, field: str, problem: str, *, not_a_plan: bool = False) -> NoReturn:
        where = f"{self.where} is not an autopipe plan" if not_a_plan else self.where
        raise PlanFileError(f"{where}: {problem}", field=field, path=self.path)

    def bad(self, field: str, value: Any, expected: str) -> NoReturn:
        self.fail(field, f"{field}={show(value)} {expected}")

    # numbers.Integral / numbers.Real: from_dict may be given numpy scalars, not only JSON's.
    def integer(self, field: str, value: Any, lo: int = 0, hi: int = MAX_PLAN_INT) -> int:
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not lo <= value <= hi:
            most = "2**63 - 1 (int64)" if hi == MAX_PLAN_INT else hi
            self.bad(field, value, f"must be an integer >= {lo} and <= {most}")
        return int(value)

    def number(self, field: str, value: Any, *, positive: bool = False, signed: bool = False,
            none: bool = False) -> float | None:
        if value is None and none:
            return None
        ok = (not isinstance(value, bool) and isinstance(value, numbers.Real) and math.isfinite(value)
              and (signed or (value > 0 if positive else value >= 0)))
        if not ok:
            bound = "" if signed else " > 0" if positive else " >= 0"
            self.bad(field, value, f"must be a finite number{bound}" + (" or null" if none else ""))
        return float(value)

    def text(self, field: str, value: Any, *, nonempty: bool = False) -> str:
        if not isinstance(value, str) or (nonempty and not value):
            self.bad(field, value, "must be a non-empty string" if nonempty else "must be a string")
        return value

    def flag(self, field: str, value: Any) -> bool:
        if not isinstance(value, bool):
            self.bad(field, value, "must be true or false")
        return value

    def sequence(self, field: str, value: Any, item: Callable[[str, Any], Any] | None = None,
             length: int | None = None) -> list[Any]:
        # A tuple is what asdict() leaves of a tuple field: to_dict()'s output, given to from_dict as it is.
        if not isinstance(value, (list, tuple)):
            self.bad(field, value, "must be a list" + (f" of {length} entries" if length is not None else ""))
        if length is not None and len(value) != length:
            self.fail(field, f"{field} has {len(value)} entries but must have {length}")
        return [item(f"{field}[{i}]", v) for i, v in enumerate(value)] if item else list(value)

    def names(self, field: str, value: Any, length: int | None = None) -> list[str]:
        """Distinct non-empty names, such as split points."""
        names = self.sequence(field, value, lambda f, v: self.text(f, v, nonempty=True), length)
        repeated = sorted(n for n, times in collections.Counter(names).items() if times > 1)
        if repeated:
            self.fail(field, f"{field} names {repeated} more than once; each name may appear once")
        return names

    def mapping(self, field: str, value: Any) -> dict[str, Any]:
        if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
            self.bad(field, value, "must be an object with string keys")
        return dict(value)

    def record(self, field: str, value: Any, checks: Mapping[str, Callable[[str, Any], Any]],
               required: set[str] | frozenset[str], *, open_ended: bool = False) -> dict[str, Any]:
        """An object with the given fields: each checked, the required ones present."""
        data = self.mapping(field, value)
        prefix = f"{field}." if field else ""
        if not open_ended:
            unknown = sorted(set(data) - set(checks))
            if unknown:
                self.fail(prefix + unknown[0], f"unknown field(s) {[prefix + k for k in unknown]}; "
                          f"{field or 'a plan'} has the fields {sorted(checks)}", not_a_plan=not field)
        missing = sorted(required - set(data))
        if missing:
            self.fail(prefix + missing[0], f"missing field(s) {[prefix + k for k in missing]}", not_a_plan=not field)
        return {k: checks[k](prefix + k, v) if k in checks else v for k, v in data.items()}


def show(value: Any) -> str:
    """``repr(value)``, cut to the length an error message repeats."""
    text = repr(value)
    return text if len(text) <= _SHOWN_CHARS else text[:_SHOWN_CHARS] + "..."


def required_fields(cls: type) -> frozenset[str]:
    """The fields of dataclass ``cls`` that have no default."""
    return frozenset(f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING)
