"""``partition`` with the planner's options given flat, as the tests' helpers pass them on."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

import autopipe
from autopipe import PlannerOptions

PLANNER_FIELDS = frozenset(f.name for f in fields(PlannerOptions))


def partition_with(model: Any, n_gpus: int, *args: Any, **kwargs: Any) -> autopipe.Plan:
    """``autopipe.partition`` where any :class:`PlannerOptions` field may be a keyword of its own."""
    options = {k: kwargs.pop(k) for k in list(kwargs) if k in PLANNER_FIELDS}
    return autopipe.partition(model, n_gpus, *args, planner=PlannerOptions(**options), **kwargs)
