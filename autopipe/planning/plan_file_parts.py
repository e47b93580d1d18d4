"""The typed parts of a plan file, checked.

Example:
    >>> from autopipe.planning.plan_checks import FieldCheck
    >>> shape = PlanShape(stages=2, ranks=2, segment_names=0, stage_records=[{"last_segment": 1}])
    >>> typed_parts(FieldCheck(None), {"notes": ["made by hand"]}, shape)["notes"]
    ['made by hand']
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from .costmodel import StepTail
from .plan_checks import MAX_STAGES, FieldCheck, required_fields
from .plan_records import (Calibration, Link, MachineModel, PlanSegment, ScheduleAlternative, SearchRecord,
                           TuningRecord)
from ..machine.passes import WholePass
from .profile import LossCost
from .schedules import MAX_SCHEDULE_SIZE

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
        "rounds": lambda f, v: c.integer(f, v, 1), "chosen": c.integer}, required_fields(TuningRecord))
    n = len(record["split_points"])
    if not (len(record["predicted_step_s"]) == len(record["measured_step_s"]) == n and 0 <= record["chosen"] < n):
        c.fail(field, f"{field} needs one predicted and one measured step per candidate ({n}) and chosen in 0..{n - 1}")
    return TuningRecord(**record)
