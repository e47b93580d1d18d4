"""The plan's file format: every field of a plan file checked before any of it is used.

Example:
    >>> from autopipe.planning.plan import Plan
    >>> plan_from_data(["not", "a", "plan"], Plan)
    Traceback (most recent call last):
    ...
    autopipe.errors.PlanFileError: plan data is not an autopipe plan: a plan is one JSON object, got list ['not', 'a', 'plan']
    >>> FieldCheck(None).number("stages[0].fwd_s", -1.0)
    Traceback (most recent call last):
    ...
    autopipe.errors.PlanFileError: plan data: stages[0].fwd_s=-1.0 must be a finite number >= 0
"""

from __future__ import annotations

import collections
import json
import math
import numbers
import os
from collections.abc import Callable, Mapping
from dataclasses import MISSING, fields
from typing import TYPE_CHECKING, Any, NamedTuple, NoReturn, TypeVar

from ..errors import PlanFileError
from ..machine.passes import WholePass
from .costmodel import StepTail
from ..machine.precision import MIXED_PRECISIONS
from .options import TARGETS
from .plan_records import (BaselinePlan, Calibration, DataParallelRecord, Factorization, Link, MachineModel,
                           PlanSegment, ScheduleAlternative, SearchRecord, StagePlan, TuningRecord)
from .profile import LossCost
from .schedules import MAX_SCHEDULE_SIZE, check_schedule_size, validate_schedule


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


#: The Plan fields beyond the stages and baselines, each checked by :func:`typed_parts`.
TYPED_FIELDS = ("segments", "machine", "step_tail", "rank_peak_bytes", "search", "alternatives", "notes", "loss",
                "whole_pass", "global_batch", "scaling_fit_error", "calibration", "tuning")


class PlanShape(NamedTuple):
    """The counts the typed parts must agree with."""

    stages: int
    ranks: int
    segment_names: int
    stage_records: list[dict[str, Any]]


def typed_parts(c: FieldCheck, raw: dict[str, Any], shape: PlanShape) -> dict[str, Any]:
    """The typed fields of a plan file, each checked under its own name."""

    out: dict[str, Any] = {}
    if "segments" in raw:
        out["segments"] = _segments(c, "segments", raw["segments"], shape)
    if "machine" in raw:
        machine = c.record("machine", raw["machine"], {
            "links": lambda f, v: _sized(c, f, c.sequence(f, v, lambda g, x: _link(c, g, x)), shape.stages - 1),
            "action_overhead_s": lambda f, v: _sized(c, f, c.sequence(f, v, c.number), shape.stages),
            "lazy_sends": c.flag,
        }, frozenset())
        out["machine"] = MachineModel(**machine)
    if "step_tail" in raw:
        out["step_tail"] = StepTail(**c.record("step_tail", raw["step_tail"], dict.fromkeys(
            ("merge_outputs_s", "loss_broadcast_s", "shared_grads_s", "start_agreement_s"), c.number), frozenset()))
    if "rank_peak_bytes" in raw:
        out["rank_peak_bytes"] = _sized(c, "rank_peak_bytes", c.sequence("rank_peak_bytes", raw["rank_peak_bytes"],
                                                                         c.integer), shape.ranks)
    if raw.get("search") is not None:
        out["search"] = _search(c, "search", raw["search"])
    if "alternatives" in raw:
        out["alternatives"] = _alternatives(c, "alternatives", raw["alternatives"])
    if "notes" in raw:
        out["notes"] = c.sequence("notes", raw["notes"], c.text)
    if raw.get("loss") is not None:
        out["loss"] = _loss(c, "loss", raw["loss"])
    if raw.get("whole_pass") is not None:
        out["whole_pass"] = _whole_pass(c, "whole_pass", raw["whole_pass"])
    if raw.get("global_batch") is not None:
        out["global_batch"] = c.integer("global_batch", raw["global_batch"], 1)
    if "scaling_fit_error" in raw:
        out["scaling_fit_error"] = _fit_error(c, "scaling_fit_error", raw["scaling_fit_error"])
    if raw.get("calibration") is not None:
        out["calibration"] = _calibration(c, "calibration", raw["calibration"], shape)
    if raw.get("tuning") is not None:
        out["tuning"] = _tuning(c, "tuning", raw["tuning"])
    return out


def _sized(c: FieldCheck, field: str, values: list[Any], length: int) -> list[Any]:
    """``values`` when it has ``length`` entries or none (nothing recorded)."""
    if values and len(values) != length:
        c.fail(field, f"{field} has {len(values)} entries but must have {length} (or none)")
    return values


def _link(c: FieldCheck, field: str, value: Any) -> Link:
    return Link(**c.record(field, value, {"bandwidth": lambda f, v: c.number(f, v, positive=True),
                                          "latency_s": c.number}, frozenset({"bandwidth", "latency_s"})))


def _segments(c: FieldCheck, field: str, value: Any, shape: PlanShape) -> list[PlanSegment]:
    checks: dict[str, Callable[[str, Any], Any]] = {
        **{k: c.number for k in ("fwd_s", "bwd_s", "accum_s", "flops")},
        **{k: c.integer for k in ("param_bytes", "act_bytes", "out_bytes", "trainable_param_bytes",
                                  "cut_fwd_bytes", "cut_bwd_bytes", "cut_fwd_messages", "cut_bwd_messages",
                                  "bwd_peak_bytes",
                                  "bwd_input_peak_bytes")},
        "name": c.text, "modules": lambda f, v: c.sequence(f, v, c.text),
    }
    segments = c.sequence(field, value, lambda f, v: PlanSegment(**c.record(f, v, checks,
                                                                          required_fields(PlanSegment))))
    if shape.segment_names and segments and len(segments) != shape.segment_names:
        c.fail(field, f"{field} has {len(segments)} entries but segment_names has {shape.segment_names}; "
               "one per segment")
    last = shape.stage_records[-1]["last_segment"]
    if segments and last >= len(segments):
        c.fail(f"stages[{shape.stages - 1}].last_segment", f"stages[{shape.stages - 1}].last_segment={last} "
               f"but {field} has {len(segments)} segments")
    return segments


def _search(c: FieldCheck, field: str, value: Any) -> SearchRecord:
    return SearchRecord(**c.record(field, value, {
        "candidates": c.integer, "iterations": c.integer, "step_lower_bound_s": c.number,
        "step_gap": lambda f, v: c.number(f, v, signed=True)}, frozenset()))


def _alternatives(c: FieldCheck, field: str, value: Any) -> list[ScheduleAlternative]:
    def maybe_int(f: str, v: Any) -> int | None:
        return None if v is None else c.integer(f, v)

    checks: dict[str, Callable[[str, Any], Any]] = {
        "schedule": lambda f, v: c.text(f, v, nonempty=True),
        "stages_per_rank": lambda f, v: c.integer(f, v, 1, MAX_STAGES),
        "n_microbatches": lambda f, v: c.integer(f, v, 1, MAX_SCHEDULE_SIZE),
        "predicted_step_s": lambda f, v: c.number(f, v, none=True),
        "peak_bytes": maybe_int, "fits": c.flag, "note": c.text, "split_points_count": maybe_int,
    }
    return c.sequence(field, value, lambda f, v: ScheduleAlternative(**c.record(
        f, v, checks, required_fields(ScheduleAlternative))))


def _loss(c: FieldCheck, field: str, value: Any) -> LossCost:
    return LossCost(**c.record(field, value, {"fwd_s": c.number, "bwd_s": c.number, "act_bytes": c.integer,
                                              "batch": lambda f, v: c.integer(f, v, 1),
                                              "bwd_peak_bytes": c.integer}, required_fields(LossCost)))


def _whole_pass(c: FieldCheck, field: str, value: Any) -> WholePass:
    checks: dict[str, Callable[[str, Any], Any]] = {
        **{k: c.number for k in ("segments_fwd_s", "segments_bwd_s", "fwd_s", "bwd_s", "accum_s", "segments_accum_s")},
        "scales": lambda f, v: c.sequence(f, v, c.number, 3), "fitted": c.flag, "round_spread": c.number,
    }
    whole = c.record(field, value, checks, required_fields(WholePass))
    return WholePass(**{**whole, "scales": tuple(whole["scales"])})


def _fit_error(c: FieldCheck, field: str, value: Any) -> dict[str, float]:
    return {k: c.number(f"{field}.{k}", v) for k, v in c.mapping(field, value).items()}


def _calibration(c: FieldCheck, field: str, value: Any, shape: PlanShape) -> Calibration:
    def factors(f: str, v: Any) -> list[Any]:  # None: a stage direction with nothing planned to scale
        return c.sequence(f, v, lambda g, x: c.number(g, x, none=True), shape.stages)

    return Calibration(**c.record(field, value, {"fwd_factor": factors, "bwd_factor": factors},
                                  required_fields(Calibration)))


def _tuning(c: FieldCheck, field: str, value: Any) -> TuningRecord:
    record = c.record(field, value, {
        "split_points": lambda f, v: c.sequence(f, v, lambda g, x: c.sequence(g, x, c.text)),
        "predicted_step_s": lambda f, v: c.sequence(f, v, c.number),
        "measured_step_s": lambda f, v: c.sequence(f, v, c.number),
        "rounds": lambda f, v: c.integer(f, v, 1), "chosen": c.integer,
        "vs_chosen": lambda f, v: c.sequence(f, v, c.number),
        "round_steps_s": lambda f, v: c.sequence(f, v, lambda g, x: c.sequence(g, x, c.number))},
        required_fields(TuningRecord))
    n, rounds = len(record["split_points"]), record["rounds"]
    per_round = record.get("round_steps_s", [])
    if not (len(record["predicted_step_s"]) == len(record["measured_step_s"]) == n and 0 <= record["chosen"] < n
            and len(record.get("vs_chosen", [])) in (0, n)
            and (not per_round or (len(per_round) == n and all(len(row) == rounds for row in per_round)))):
        c.fail(field, f"{field} needs one predicted and one measured step per candidate ({n}), as many ratios "
                      f"over the chosen one or none, {rounds} round steps per candidate or none, "
                      f"and chosen in 0..{n - 1}")
    return TuningRecord(**record)


def record_from_data(c: FieldCheck, name: str, value: Any) -> DataParallelRecord | None:
    """A :class:`DataParallelRecord` from plan-file data, every field checked (None stays None)."""
    if value is None:
        return None

    def maybe_int(f: str, v: Any) -> int | None:
        return None if v is None else c.integer(f, v)

    def maybe_number(f: str, v: Any) -> float | None:
        return c.number(f, v, none=True)

    rows = {
        "pp": lambda f, v: c.integer(f, v, 1, MAX_STAGES), "dp": lambda f, v: c.integer(f, v, 1, MAX_STAGES),
        "mode": c.text, "n_microbatches": maybe_int, "schedule": c.text, "pipeline_step_s": maybe_number,
        "reduction_s": maybe_number, "peak_bytes": maybe_int, "fits": c.flag, "reason": c.text, "crossing": c.text,
        "min_memory_bytes": maybe_int,
    }
    top = {
        "mode": c.text, "reduction_s": c.number, "dp_bandwidth": lambda f, v: c.number(f, v, positive=True),
        "dp_latency_s": c.number, "crossing": c.text,
        "factorizations": lambda f, v: c.sequence(f, v, lambda g, x: Factorization(
            **c.record(g, x, rows, required_fields(Factorization)))),
    }
    return DataParallelRecord(**c.record(name, value, top, required_fields(DataParallelRecord)))


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
        known = isinstance(version, int) and not isinstance(version, bool)
        which = (" (written by a newer autopipe)" if known and version > PLAN_FORMAT_VERSION else
                 " (written by an earlier autopipe: plan the model again to write the current format)"
                 if known and 0 < version < PLAN_FORMAT_VERSION else "")
        c.fail("format_version", f"plan format_version={show(version)}{which} is not supported; this autopipe "
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
        "target": lambda f, v: c.text(f, v) if v in ("", *TARGETS) else c.bad(f, v, f"one of {['', *TARGETS]}"),
        "microbatch_rows": lambda f, v: None if v is None else c.integer(f, v, 1),
        "input_shapes": lambda f, v: c.sequence(f, v, lambda g, x: c.sequence(g, x, lambda h, d: c.integer(h, d, 0))),
        "mixed_precision": lambda f, v: c.text(f, v) if v in ("", *MIXED_PRECISIONS) else c.bad(
            f, v, f"one of {['', *MIXED_PRECISIONS]}"),
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
