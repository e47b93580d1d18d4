"""Reading plan files safely: every field checked before any of it is used.

Example:
    >>> from autopipe.planning.plan import Plan
    >>> from autopipe.planning.plan_file import plan_from_data
    >>> plan_from_data(["not", "a", "plan"], Plan)
    Traceback (most recent call last):
    ...
    autopipe.errors.PlanFileError: plan data is not an autopipe plan: a plan is one JSON object, got list ['not', 'a', 'plan']
"""

from __future__ import annotations

import json
import numbers
import os
from collections.abc import Callable, Mapping
from dataclasses import fields
from typing import TYPE_CHECKING, Any, TypeVar

from ..errors import PlanFileError
from .dp_records import record_from_data
from .plan_checks import MAX_PLAN_INT, MAX_STAGES, FieldCheck, required_fields, show
from .plan_file_parts import TYPED_FIELDS, PlanShape, typed_parts
from .plan_records import BaselinePlan, StagePlan
from .schedules import MAX_SCHEDULE_SIZE, check_schedule_size, validate_schedule

if TYPE_CHECKING:
    import torch

#: The class a plan is built as: :class:`autopipe.planning.plan.Plan` or a subclass, which
#: this module is handed rather than imports (the Plan reads its files through it).
PlanT = TypeVar("PlanT")

#: The plan file layout :meth:`Plan.save` writes; bumped whenever the layout changes.
PLAN_FORMAT_VERSION = 2

#: Every layout :meth:`Plan.load` reads.
READ_FORMAT_VERSIONS = (PLAN_FORMAT_VERSION,)

#: Largest plan file read, in bytes. A plan autopipe writes takes about 1 KB per segment
#: of the model, so this holds tens of thousands of segments; a larger file is refused
#: before it is read.
MAX_PLAN_FILE_BYTES = 64 * 2**20

#: Deepest nesting of JSON arrays and objects a plan may hold. Plans autopipe writes nest 4
#: deep (plan, segments, a segment, its modules); the bound keeps every later walk
#: of the data (copies, ``asdict``) far from Python's recursion limit.
MAX_NESTING = 32


# --------------------------------------------------------------------------- reading


def read_plan_file(path: str | os.PathLike) -> Any:
    """The JSON data of the plan file at ``path``, read within the limits above.

    Example:
        >>> data = read_plan_file("plan.json")  # doctest: +SKIP
    """
    source = os.fspath(path)
    where = f"plan file {source!r}"
    with open(path, "rb") as f:
        # Read one byte past the limit instead of trusting the size on disk: a pipe or a
        # device file reports none.
        raw = f.read(MAX_PLAN_FILE_BYTES + 1)
    if len(raw) > MAX_PLAN_FILE_BYTES:
        raise PlanFileError(f"{where} is larger than MAX_PLAN_FILE_BYTES={MAX_PLAN_FILE_BYTES} bytes; "
                            "a plan autopipe writes takes about 1 KB per segment", path=source)
    if not raw.strip():
        raise PlanFileError(f"{where} is not a plan JSON file: it is empty", path=source)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise PlanFileError(f"{where} is not a plan JSON file: not UTF-8 text ({e})", path=source) from None
    try:
        data = json.loads(text, object_pairs_hook=_object_without_repeats)
    except _RepeatedKey as e:
        raise PlanFileError(f"{where}: key {e.key!r} appears twice in one object; a plan gives each field once",
                            field=e.key, path=source) from None
    except RecursionError:
        raise PlanFileError(f"{where} is not a plan JSON file: nested deeper than Python can read "
                            f"(a plan nests at most MAX_NESTING={MAX_NESTING} deep)", path=source) from None
    except ValueError as e:  # JSONDecodeError, and integers too long to convert
        raise PlanFileError(f"{where} is not a plan JSON file: {e}", path=source) from None
    return data


class _RepeatedKey(Exception):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _object_without_repeats(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object as a dict, refusing a key given twice (JSON itself keeps the last silently)."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _RepeatedKey(key)
        out[key] = value
    return out


def _check_nesting(check: FieldCheck, data: Any) -> None:
    """Refuse data nested deeper than MAX_NESTING, walking it without recursion."""
    stack = [(data, 1, "")]
    while stack:
        value, depth, field = stack.pop()
        if isinstance(value, (Mapping, list, tuple)):
            if depth > MAX_NESTING:
                check.fail(field, f"{field or 'the plan'} is nested more than MAX_NESTING={MAX_NESTING} deep; "
                           "a plan autopipe writes nests 4 deep")
            items = value.items() if isinstance(value, Mapping) else enumerate(value)
            for k, v in items:
                sub = (f"{field}.{k}" if field else f"{k}") if isinstance(value, Mapping) else f"{field}[{k}]"
                stack.append((v, depth + 1, sub))


# --------------------------------------------------------------------------- the plan


def plan_from_data(data: Any, cls: type[PlanT], *, path: str | None = None) -> PlanT:
    """A ``cls`` (:class:`~autopipe.planning.plan.Plan` or a subclass) from plan data, every field checked first.

    Example:
        >>> from autopipe.planning.plan import Plan
        >>> plan = Plan.load("plan.json")  # doctest: +SKIP
        >>> plan_from_data(plan.to_dict(), Plan) == plan  # doctest: +SKIP
        True
    """
    c = FieldCheck(path)
    if not isinstance(data, Mapping):
        c.fail("", f"a plan is one JSON object, got {type(data).__name__} {show(data)}", not_a_plan=True)
    if "format_version" not in data:
        c.fail("format_version", f"missing field 'format_version'; this autopipe reads plan format versions "
               f"{list(READ_FORMAT_VERSIONS)} (files written by Plan.save carry it)")
    version = data["format_version"]
    if isinstance(version, bool) or not isinstance(version, int) or version not in READ_FORMAT_VERSIONS:
        newer = " (written by a newer autopipe)" if isinstance(version, int) and version > PLAN_FORMAT_VERSION else ""
        c.fail("format_version", f"plan format_version={show(version)}{newer} is not supported; this autopipe "
               f"reads versions {list(READ_FORMAT_VERSIONS)}")
    _check_nesting(c, data)

    top = {
        "format_version": lambda f, v: v,
        "split_spec": c.mapping,  # written for readers of the file; checked against split_points below
        "num_stages": lambda f, v: c.integer(f, v, 1, MAX_STAGES),
        "split_points": c.names,
        "stages": c.sequence,
        "schedule": lambda f, v: c.text(f, v, nonempty=True),
        "n_microbatches": lambda f, v: c.integer(f, v, 1, MAX_SCHEDULE_SIZE),
        "bottleneck_s": c.number,
        "predicted_step_s": c.number,
        "lower_bound_s": c.number,
        "baselines": c.sequence,
        "cost_source": c.text,
        "objective": c.text,
        "device": c.text,
        "stages_per_rank": lambda f, v: c.integer(f, v, 1, MAX_STAGES),
        "memory_limit_bytes": lambda f, v: None if v is None else c.sequence(f, v, _memory_limit(c)),
        "optimizer": c.text,
        "planner_s": c.number,
        "planning_peak_rss_bytes": lambda f, v: None if v is None else c.integer(f, v, 0),
        "model_name": c.text,
        "segment_names": lambda f, v: c.sequence(f, v, c.text),
        "recompute_stages": lambda f, v: c.sequence(f, v, lambda g, x: c.integer(g, x, 0, MAX_STAGES)),
        # Pipeline x data parallel (optional: files without them are one replica).
        "dp_degree": lambda f, v: c.integer(f, v, 1, MAX_STAGES),
        "dp_mode": lambda f, v: _dp_mode(c, f, v),
        "data_parallel": lambda f, v: record_from_data(c, f, v),
        # The typed parts are checked once the stage count is known, below.
        **{k: (lambda f, v: v) for k in TYPED_FIELDS},
    }
    assert set(top) - {"format_version", "split_spec"} == {
        f.name for f in fields(cls)}, "plan fields changed"
    kw = c.record("", data, top, required_fields(cls) | {"format_version"})
    kw.pop("format_version")
    split_spec = kw.pop("split_spec", None)

    p, m = kw["num_stages"], kw["n_microbatches"]
    _check_counts(c, kw)
    again = kw.get("recompute_stages", [])
    if again != sorted(set(again)) or any(x >= p for x in again):
        c.fail("recompute_stages", f"recompute_stages={show(again)} must be distinct stage indices in 0..{p - 1}, "
               "in increasing order")
    if split_spec is not None and split_spec != {name: "BEGINNING" for name in kw["split_points"]}:
        c.fail("split_spec", f"split_spec={show(split_spec)} disagrees with split_points="
               f"{show(kw['split_points'])}; it must map each split point to 'BEGINNING'")

    stage_checks = {
        "index": lambda f, v: c.integer(f, v, 0, MAX_STAGES),
        "fqns": lambda f, v: c.sequence(f, v, c.text),
        "first_segment": c.integer, "last_segment": c.integer,
        "fwd_s": c.number, "bwd_s": c.number, "comm_s": c.number,
        **{k: c.integer for k in ("param_bytes", "act_bytes", "peak_bytes", "send_bytes", "recv_bytes",
                                  "peak_bytes_kept", "peak_bytes_recomputed")},
        "inflight_microbatches": lambda f, v: c.integer(f, v, 0, m),
        "device": c.text,
    }
    assert set(stage_checks) == {f.name for f in fields(StagePlan)}, "StagePlan fields changed"
    stages = [c.record(f"stages[{i}]", s, stage_checks, required_fields(StagePlan)) for i, s in enumerate(kw["stages"])]
    _check_stage_order(c, stages, kw.get("segment_names", []))
    kw["stages"] = [StagePlan(**s) for s in stages]

    baseline_checks = {
        "name": lambda f, v: c.text(f, v, nonempty=True), "description": c.text, "split_points": c.names,
        "bottleneck_s": c.number, "predicted_step_s": c.number, "peak_bytes": c.integer, "fits_memory": c.flag,
        "reason": c.text,
    }
    assert set(baseline_checks) == {f.name for f in fields(BaselinePlan)}, "BaselinePlan fields changed"
    kw["baselines"] = [BaselinePlan(**c.record(f"baselines[{i}]", b, baseline_checks, required_fields(BaselinePlan)))
                       for i, b in enumerate(kw.get("baselines", []))]
    if kw.get("memory_limit_bytes") is not None and len(kw["memory_limit_bytes"]) != p // kw.get("stages_per_rank", 1):
        c.fail("memory_limit_bytes", f"memory_limit_bytes has {len(kw['memory_limit_bytes'])} entries but the plan "
               f"runs on {p // kw.get('stages_per_rank', 1)} ranks; give one per rank")
    shape = PlanShape(p, p // kw.get("stages_per_rank", 1), len(kw.get("segment_names", [])), stages)
    kw.update(typed_parts(c, {k: kw.pop(k) for k in TYPED_FIELDS if k in kw}, shape))
    return cls(**kw)


def _dp_mode(c: FieldCheck, field: str, value: Any) -> str:
    if value not in ("", "fsdp", "replicate"):
        c.bad(field, value, "must be 'fsdp', 'replicate' or '' (one replica)")
    return value


def _memory_limit(c: FieldCheck) -> Callable[[str, Any], int]:
    def check(field: str, value: Any) -> int:
        if (isinstance(value, bool) or not isinstance(value, numbers.Integral)
                or not (value == -1 or 1 <= value <= MAX_PLAN_INT)):
            c.bad(field, value, "must be a byte count >= 1 and <= 2**63 - 1, or -1 for a device without a limit")
        return int(value)
    return check


def _check_counts(c: FieldCheck, kw: dict[str, Any]) -> None:
    """Stages, split points, stages per rank, schedule and micro-batches agree with each other."""
    p, m = kw["num_stages"], kw["n_microbatches"]
    if len(kw["split_points"]) != p - 1:
        c.fail("split_points", f"split_points has {len(kw['split_points'])} names but num_stages={p} needs "
               f"{p - 1} (num_stages == len(split_points) + 1)")
    if len(kw["stages"]) != p:
        c.fail("stages", f"stages has {len(kw['stages'])} entries but num_stages={p} (one per stage)")
    v = kw.get("stages_per_rank", 1)
    if p % v:
        c.fail("stages_per_rank", f"stages_per_rank={v} does not divide num_stages={p}; "
               f"num_stages = ranks x stages_per_rank")
    try:
        check_schedule_size(p, m)
    except ValueError as e:
        c.fail("n_microbatches", str(e))
    try:  # torch's counting rules alone: the order itself is built when the plan is run or drawn
        kw["schedule"] = validate_schedule(kw["schedule"], p // v, m, v, check_order=False)
    except (ValueError, TypeError) as e:
        c.fail("schedule", f"schedule={kw['schedule']!r} cannot run num_stages={p}, stages_per_rank={v}, "
               f"n_microbatches={m}: {e}")


def _check_stage_order(c: FieldCheck, stages: list[dict[str, Any]], segment_names: list[str]) -> None:
    """Stage i is numbered i and starts where stage i - 1 ended; the last ends at the last segment."""
    next_first = 0
    for i, s in enumerate(stages):
        if s["index"] != i:
            c.fail(f"stages[{i}].index", f"stages[{i}].index={s['index']} must be {i} (stages in pipeline order)")
        if s["first_segment"] != next_first:
            c.fail(f"stages[{i}].first_segment", f"stages[{i}].first_segment={s['first_segment']} must be "
                   f"{next_first}: stages cover contiguous segments, the first from segment 0")
        if s["last_segment"] < s["first_segment"]:
            c.fail(f"stages[{i}].last_segment", f"stages[{i}].last_segment={s['last_segment']} is before its "
                   f"first_segment={s['first_segment']}")
        next_first = s["last_segment"] + 1
    if segment_names and next_first != len(segment_names):
        c.fail(f"stages[{len(stages) - 1}].last_segment",
               f"stages[{len(stages) - 1}].last_segment={next_first - 1} but segment_names lists "
               f"{len(segment_names)} segments; the last stage ends at segment {len(segment_names) - 1}")


# --------------------------------------------------------------------------- the model


def check_model_names(plan: Any, model: torch.nn.Module) -> None:
    """Refuse a plan (anything with ``split_points``) whose split points are not submodules of ``model``.

    Example:
        >>> check_model_names(plan, model)  # doctest: +SKIP
    """
    import torch

    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    names = {n for n, _ in model.named_modules() if n}
    unknown = [s for s in plan.split_points if s not in names]
    if unknown:
        some = [n for n, _ in model.named_modules() if n][:5]
        raise PlanFileError(
            f"plan split_points {unknown} are not submodules of {type(model).__name__} (its modules are named "
            f"like {some}); the plan was made for another model", field="split_points")
