"""Reading plan files safely: every field checked before any of it is used.

A plan file is data, never code: it is read as UTF-8 JSON (no pickle, no imports, no
``eval``), and :func:`plan_from_data` checks every field against what it may hold before a
:class:`~autopipe.planning.plan.Plan` is built from it. A file that fails raises one error type,
:class:`~autopipe.errors.PlanFileError`, whose ``field`` names the field at fault.

What is checked (``docs/api.md`` lists it for users):

* the file: at most :data:`MAX_PLAN_FILE_BYTES`, UTF-8, JSON, one object, no key twice,
  nesting at most :data:`MAX_NESTING` deep, ``format_version`` one this autopipe reads;
* every field of the plan, of each stage and of each baseline: present unless it has a
  default, no unknown field, the right type (an integer is not a float, a bool is not a
  number), counts within bounds, times and byte counts finite and >= 0;
* that the fields agree: ``num_stages == len(split_points) + 1 == len(stages)``, split
  points distinct non-empty names, stages numbered in order over contiguous segments,
  ``num_stages % stages_per_rank == 0``, a schedule torch can run with these counts, and a
  step of at most :data:`~autopipe.planning.schedules.MAX_SCHEDULE_SIZE` (stage, micro-batch) pairs;
* the entries of ``extras`` that autopipe reads back (per-segment costs, links, overheads,
  the report's figures); other entries are kept as they are.

Example:
    >>> from autopipe.planning.plan_file import plan_from_data
    >>> plan_from_data(["not", "a", "plan"])
    Traceback (most recent call last):
    ...
    autopipe.errors.PlanFileError: plan data is not an autopipe plan: a plan is one JSON object, got list ['not', 'a', 'plan']
"""

from __future__ import annotations

import collections
import json
import math
import numbers
import os
from collections.abc import Callable, Mapping
from dataclasses import MISSING, fields
from typing import TYPE_CHECKING, Any, NoReturn

from ..errors import PlanFileError
from .schedules import MAX_SCHEDULE_SIZE, check_schedule_size, validate_schedule

if TYPE_CHECKING:
    import torch

    from .plan import Plan

__all__ = ["MAX_PLAN_FILE_BYTES", "MAX_NESTING", "MAX_STAGES", "MAX_PLAN_INT", "read_plan_file",
           "plan_from_data", "check_model_names"]

#: Largest plan file read, in bytes. A plan autopipe writes takes about 1 KB per segment
#: of the model, so this holds tens of thousands of segments; a larger file is refused
#: before it is read.
MAX_PLAN_FILE_BYTES = 64 * 2**20

#: Deepest nesting of JSON arrays and objects a plan may hold. Plans autopipe writes nest 5
#: deep (plan, extras, segments, a segment, its modules); the bound keeps every later walk
#: of the data (copies, ``asdict``) far from Python's recursion limit.
MAX_NESTING = 32

#: Most pipeline stages a plan, or ``partition(n_gpus=...)``, may ask for.
MAX_STAGES = 10**5

#: Largest integer a plan may hold (byte counts, segment numbers): int64, what numpy and
#: torch count bytes in.
MAX_PLAN_INT = 2**63 - 1

_SHOWN_CHARS = 60  # how much of a bad value an error message repeats


# --------------------------------------------------------------------------- reading


def read_plan_file(path: str | os.PathLike) -> Any:
    """The JSON data of the plan file at ``path``, read within the limits above.

    Raises:
        PlanFileError: too large, not UTF-8, not JSON, a key given twice, or nested too deep.
        OSError: the file cannot be opened (missing, a directory, no permission).

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


# --------------------------------------------------------------------------- field checks


class _Check:
    """Checks of single values; every failure names the field and what it accepts."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self.where = "plan data" if path is None else f"plan file {path!r}"

    def fail(self, field: str, problem: str, *, not_a_plan: bool = False) -> NoReturn:
        where = f"{self.where} is not an autopipe plan" if not_a_plan else self.where
        raise PlanFileError(f"{where}: {problem}", field=field, path=self.path)

    def bad(self, field: str, value: Any, expected: str) -> NoReturn:
        self.fail(field, f"{field}={_show(value)} {expected}")

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
        """An object with the given fields: each checked, the required ones present.

        ``open_ended`` keeps unknown keys unchecked (``extras`` may grow without a new
        format version); otherwise an unknown key is refused, so a misspelt field cannot
        silently fall back to its default.
        """
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


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _SHOWN_CHARS else text[:_SHOWN_CHARS] + "..."


def _check_nesting(check: _Check, data: Any) -> None:
    """Refuse data nested deeper than MAX_NESTING, walking it without recursion."""
    stack = [(data, 1, "")]
    while stack:
        value, depth, field = stack.pop()
        if isinstance(value, (Mapping, list, tuple)):
            if depth > MAX_NESTING:
                check.fail(field, f"{field or 'the plan'} is nested more than MAX_NESTING={MAX_NESTING} deep; "
                           "a plan autopipe writes nests 5 deep")
            items = value.items() if isinstance(value, Mapping) else enumerate(value)
            for k, v in items:
                sub = (f"{field}.{k}" if field else f"{k}") if isinstance(value, Mapping) else f"{field}[{k}]"
                stack.append((v, depth + 1, sub))


def _required(cls: type) -> frozenset[str]:
    return frozenset(f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING)


# --------------------------------------------------------------------------- the plan


def plan_from_data(data: Any, cls: type[Plan] | None = None, *, path: str | None = None) -> Plan:
    """A :class:`~autopipe.planning.plan.Plan` (or ``cls``) from plan data, every field checked first.

    Args:
        data: what ``json.load`` gives for a plan file (``Plan.to_dict()``'s layout).
        cls: the Plan class to build (a subclass of Plan); default Plan.
        path: the file the data came from, named in errors.

    Raises:
        PlanFileError: the first field at fault, named in the message and in ``.field``.

    Example:
        >>> from autopipe.planning.plan import Plan
        >>> plan = Plan.load("plan.json")  # doctest: +SKIP
        >>> plan_from_data(plan.to_dict()) == plan  # doctest: +SKIP
        True
    """
    from .plan import PLAN_FORMAT_VERSION, BaselinePlan, Plan, StagePlan

    cls = cls or Plan
    c = _Check(path)
    if not isinstance(data, Mapping):
        c.fail("", f"a plan is one JSON object, got {type(data).__name__} {_show(data)}", not_a_plan=True)
    if "format_version" not in data:
        c.fail("format_version", f"missing field 'format_version'; this autopipe reads plan format versions "
               f"1..{PLAN_FORMAT_VERSION} (files written by Plan.save carry it)")
    version = data["format_version"]
    if isinstance(version, bool) or not isinstance(version, int) or not 1 <= version <= PLAN_FORMAT_VERSION:
        c.fail("format_version", f"plan format_version={_show(version)} is not supported; this autopipe reads "
               f"versions 1..{PLAN_FORMAT_VERSION}")
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
        "model_name": c.text,
        "segment_names": lambda f, v: c.sequence(f, v, c.text),
        "extras": c.mapping,
    }
    assert set(top) - {"format_version", "split_spec"} == {f.name for f in fields(Plan)}, "plan fields changed"
    kw = c.record("", data, top, _required(Plan) | {"format_version"})
    kw.pop("format_version")
    split_spec = kw.pop("split_spec", None)

    p, m = kw["num_stages"], kw["n_microbatches"]
    _check_counts(c, kw)
    if split_spec is not None and split_spec != {name: "BEGINNING" for name in kw["split_points"]}:
        c.fail("split_spec", f"split_spec={_show(split_spec)} disagrees with split_points="
               f"{_show(kw['split_points'])}; it must map each split point to 'BEGINNING'")

    stage_checks = {
        "index": lambda f, v: c.integer(f, v, 0, MAX_STAGES),
        "fqns": lambda f, v: c.sequence(f, v, c.text),
        "first_segment": c.integer, "last_segment": c.integer,
        "fwd_s": c.number, "bwd_s": c.number, "comm_s": c.number,
        **{k: c.integer for k in ("param_bytes", "act_bytes", "peak_bytes", "send_bytes", "recv_bytes")},
        "inflight_microbatches": lambda f, v: c.integer(f, v, 0, m),
        "device": c.text,
    }
    assert set(stage_checks) == {f.name for f in fields(StagePlan)}, "StagePlan fields changed"
    stages = [c.record(f"stages[{i}]", s, stage_checks, _required(StagePlan)) for i, s in enumerate(kw["stages"])]
    _check_stage_order(c, stages, kw.get("segment_names", []))
    kw["stages"] = [StagePlan(**s) for s in stages]

    baseline_checks = {
        "name": lambda f, v: c.text(f, v, nonempty=True), "description": c.text, "split_points": c.names,
        "bottleneck_s": c.number, "predicted_step_s": c.number, "peak_bytes": c.integer, "fits_memory": c.flag,
    }
    assert set(baseline_checks) == {f.name for f in fields(BaselinePlan)}, "BaselinePlan fields changed"
    kw["baselines"] = [BaselinePlan(**c.record(f"baselines[{i}]", b, baseline_checks, _required(BaselinePlan)))
                       for i, b in enumerate(kw.get("baselines", []))]
    if kw.get("memory_limit_bytes") is not None and len(kw["memory_limit_bytes"]) != p // kw.get("stages_per_rank", 1):
        c.fail("memory_limit_bytes", f"memory_limit_bytes has {len(kw['memory_limit_bytes'])} entries but the plan "
               f"runs on {p // kw.get('stages_per_rank', 1)} ranks; give one per rank")
    if "extras" in kw:
        _check_extras(c, kw["extras"], p, len(kw.get("segment_names", [])), stages)
    return cls(**kw)


def _memory_limit(c: _Check) -> Callable[[str, Any], int]:
    def check(field: str, value: Any) -> int:
        if (isinstance(value, bool) or not isinstance(value, numbers.Integral)
                or not (value == -1 or 1 <= value <= MAX_PLAN_INT)):
            c.bad(field, value, "must be a byte count >= 1 and <= 2**63 - 1, or -1 for a device without a limit")
        return int(value)
    return check


def _check_counts(c: _Check, kw: dict[str, Any]) -> None:
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


def _check_stage_order(c: _Check, stages: list[dict[str, Any]], segment_names: list[str]) -> None:
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


# --------------------------------------------------------------------------- extras


def _check_extras(c: _Check, extras: dict[str, Any], p: int, n_segment_names: int,
                  stages: list[dict[str, Any]]) -> None:
    """The entries of ``extras`` that autopipe reads back; any others are kept unchecked."""
    def seconds_list(length: int) -> Callable[[str, Any], list[Any]]:
        return lambda f, v: c.sequence(f, v, c.number, length)

    if "segments" in extras:
        seg_checks = {k: c.number for k in ("fwd_s", "bwd_s", "accum_s", "flops", "param_bytes", "act_bytes",
                                            "out_bytes", "trainable_param_bytes", "cut_fwd_bytes", "cut_bwd_bytes")}
        seg_checks.update(name=c.text, modules=lambda f, v: c.sequence(f, v, c.text))
        required = frozenset({"fwd_s", "bwd_s", "param_bytes", "act_bytes", "out_bytes"})  # Plan.segment_costs
        segments = c.sequence("extras.segments", extras["segments"],
                              lambda f, v: c.record(f, v, seg_checks, required, open_ended=True))
        if n_segment_names and segments and len(segments) != n_segment_names:
            c.fail("extras.segments", f"extras.segments has {len(segments)} entries but segment_names has "
                   f"{n_segment_names}; one per segment")
        if segments and stages[-1]["last_segment"] >= len(segments):
            c.fail(f"stages[{p - 1}].last_segment", f"stages[{p - 1}].last_segment={stages[-1]['last_segment']} "
                   f"but extras.segments has {len(segments)} segments")
    if "action_overhead_s" in extras:
        seconds_list(p)("extras.action_overhead_s", extras["action_overhead_s"])
    comm = extras.get("cut_comm_s")  # one time for every cut, or one per cut (as simulate takes it)
    if isinstance(comm, (list, tuple)):
        seconds_list(p - 1)("extras.cut_comm_s", comm)
    elif comm is not None:
        c.number("extras.cut_comm_s", comm)
    if "lazy_sends" in extras:
        c.flag("extras.lazy_sends", extras["lazy_sends"])
    if extras.get("step_tail_s") is not None:
        for k, v in c.mapping("extras.step_tail_s", extras["step_tail_s"]).items():
            c.number(f"extras.step_tail_s.{k}", v)
    if extras.get("links"):
        c.record("extras.links", extras["links"], {
            "bandwidth": lambda f, v: c.sequence(f, v, lambda g, x: c.number(g, x, positive=True), p - 1),
            "latency_s": seconds_list(p - 1),
        }, frozenset(), open_ended=True)
    if "notes" in extras:
        c.sequence("extras.notes", extras["notes"], c.text)
    if extras.get("whole_pass"):
        whole = c.record("extras.whole_pass", extras["whole_pass"], {
            **{k: c.number for k in ("segments_fwd_s", "segments_bwd_s", "fwd_s", "bwd_s", "accum_s",
                                     "segments_accum_s")},
            "scales": lambda f, v: c.sequence(f, v, c.number), "fitted": c.flag,
        }, frozenset({"segments_fwd_s", "segments_bwd_s", "fwd_s", "bwd_s", "fitted"}), open_ended=True)
        if whole["fitted"] and len(whole.get("scales", [])) < 2:
            c.fail("extras.whole_pass.scales", "extras.whole_pass.scales needs the forward and backward scale "
                   "(2 numbers or more) when fitted is true")
    if "step_lower_bound_s" in extras:
        c.number("extras.step_lower_bound_s", extras["step_lower_bound_s"])
    if "step_gap" in extras:
        c.number("extras.step_gap", extras["step_gap"], signed=True)
    if "search" in extras:
        c.record("extras.search", extras["search"], {"candidates": c.integer}, frozenset(), open_ended=True)
    if "alternatives" in extras:
        alt_checks = {
            "schedule": lambda f, v: c.text(f, v, nonempty=True),
            "stages_per_rank": lambda f, v: c.integer(f, v, 1, MAX_STAGES),
            "n_microbatches": lambda f, v: c.integer(f, v, 1, MAX_SCHEDULE_SIZE),
            "predicted_step_s": lambda f, v: c.number(f, v, none=True),
            "peak_bytes": lambda f, v: c.number(f, v, none=True),
            "fits": c.flag, "note": c.text,
            "split_points_count": lambda f, v: None if v is None else c.integer(f, v),
        }
        required = frozenset({"schedule", "stages_per_rank", "n_microbatches", "predicted_step_s", "peak_bytes",
                              "fits"})  # what the report reads of each
        c.sequence("extras.alternatives", extras["alternatives"],
                   lambda f, v: c.record(f, v, alt_checks, required, open_ended=True))
    if "calibration" in extras:
        def factors(f: str, v: Any) -> list[Any]:  # None: a stage direction with nothing planned to scale
            return c.sequence(f, v, lambda g, x: c.number(g, x, none=True), p)

        c.record("extras.calibration", extras["calibration"], {"fwd_factor": factors, "bwd_factor": factors},
                 frozenset(), open_ended=True)


# --------------------------------------------------------------------------- the model


def check_model_names(plan: Plan, model: torch.nn.Module) -> None:
    """Refuse a plan whose split points are not submodules of ``model``.

    Raises:
        PlanFileError: ``field="split_points"``, listing the unknown names and some of the
            model's own.

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
