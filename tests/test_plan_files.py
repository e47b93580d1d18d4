"""Plan files: every malformed file is refused by Plan.load with PlanFileError naming the field.

The corpus below is made from one valid plan (the planner's own, with its typed parts) by
breaking one thing at a time: the file as a whole (not JSON, binary, empty, too deep), the
format version, each kind of field (missing, unknown, wrong type, extra nesting, out of
range, NaN and infinities, negative), and fields that disagree with each other.
"""

from __future__ import annotations

import copy
import json
import math
import os
import pathlib
import pickle
from collections.abc import Callable
from typing import Any

import pytest
import torch

import autopipe
from autopipe import Plan
from autopipe.errors import PlanFileError
from autopipe.planning.plan import PLAN_FORMAT_VERSION

from _time_limit import refused_within

Mutation = Callable[[dict[str, Any]], Any]


@pytest.fixture(scope="module")
def valid(small_transformer) -> dict[str, Any]:
    """A real plan as its file holds it, with per-segment costs, links, overheads and alternatives."""
    model, args = small_transformer
    plan = autopipe.partition(model, 2, example_args=args, schedule="auto",
                              planner=autopipe.PlannerOptions(cost="params", profiling=autopipe.ProfileOptions(progress=False)))
    assert plan.num_stages >= 2 and plan.segments and plan.alternatives
    return json.loads(json.dumps(plan.to_dict()))


def _set(path: str, value: Any) -> Mutation:
    """Set one field, given as "a.b[0].c", to ``value``."""
    def mutate(data: dict[str, Any]) -> dict[str, Any]:
        *parents, last = _steps(path)
        target = data
        for step in parents:
            target = target[step]
        target[last] = value
        return data
    return mutate


def _drop(path: str) -> Mutation:
    def mutate(data: dict[str, Any]) -> dict[str, Any]:
        *parents, last = _steps(path)
        target = data
        for step in parents:
            target = target[step]
        del target[last]
        return data
    return mutate


def _steps(path: str) -> list[str | int]:
    steps: list[str | int] = []
    for part in path.split("."):
        name, *indices = part.replace("]", "").split("[")
        steps.append(name)
        steps.extend(int(i) for i in indices)
    return steps


def _text(transform: Callable[[str], str]) -> Mutation:
    """Edit the file's text rather than its data (for what JSON data cannot hold)."""
    return lambda data: transform(json.dumps(data))


def _raw(content: bytes) -> Mutation:
    return lambda data: content


def _swap_stage_indices(data: dict[str, Any]) -> dict[str, Any]:
    data["stages"][0]["index"], data["stages"][1]["index"] = 1, 0
    return data


def _nested(depth: int) -> list[Any]:
    value: list[Any] = []
    for _ in range(depth):
        value = [value]
    return value


def _huge_field(data: dict[str, Any]) -> str:
    data["num_stages"] = 123456789
    return json.dumps(data).replace("123456789", "9" * 5000)  # past Python's int conversion limit


def _repeat_key(data: dict[str, Any]) -> str:
    return json.dumps(data).replace('"num_stages": ', '"num_stages": 3, "num_stages": ', 1)


def _stage_value_text(field: str, literal: str) -> Mutation:
    """A stage field spelt ``literal`` in the file (1e999 reads back as an infinity)."""
    def mutate(data: dict[str, Any]) -> str:
        data["stages"][0][field] = 0.123456789
        return json.dumps(data).replace("0.123456789", literal)
    return mutate


# (case id, mutation, the field PlanFileError must name; "" = the file as a whole)
CORPUS: list[tuple[str, Mutation, str]] = [
    # the file as a whole
    ("not-json", _raw(b"not json"), ""),
    ("empty-file", _raw(b""), ""),
    ("binary-garbage", _raw(bytes(range(256)) * 4), ""),
    ("utf16-text", lambda d: json.dumps(d).encode("utf-16"), ""),
    ("truncated", lambda d: json.dumps(d)[: len(json.dumps(d)) // 2], ""),
    ("deeply-nested-array", _raw(b"[" * 200_000 + b"]" * 200_000), ""),
    ("deeply-nested-object", _raw(b'{"a":' * 200_000 + b"1" + b"}" * 200_000), ""),
    ("integer-too-long-to-read", _huge_field, ""),
    ("top-level-list", lambda d: [d], ""),
    ("top-level-string", _raw(b'"plan"'), ""),
    ("top-level-null", _raw(b"null"), ""),
    ("key-given-twice", _repeat_key, "num_stages"),
    ("nested-past-the-bound", _set("notes", _nested(100)), "notes[0]..."),
    # the format version
    ("newer-version", _set("format_version", PLAN_FORMAT_VERSION + 1), "format_version"),
    ("version-zero", _set("format_version", 0), "format_version"),
    ("version-as-string", _set("format_version", "1"), "format_version"),
    ("version-missing", _drop("format_version"), "format_version"),
    ("version-1", _set("format_version", 1), "format_version"),
    # missing and unknown fields
    ("missing-n_microbatches", _drop("n_microbatches"), "n_microbatches"),
    ("missing-stages", _drop("stages"), "stages"),
    ("misspelt-field", _set("stage_per_rank", 1), "stage_per_rank"),
    ("missing-stage-field", _drop("stages[1].fwd_s"), "stages[1].fwd_s"),
    ("unknown-stage-field", _set("stages[0].gpu", 3), "stages[0].gpu"),
    ("missing-baseline-name", _drop("baselines[0].name"), "baselines[0].name"),
    # wrong types and extra nesting
    ("num_stages-as-string", _set("num_stages", "2"), "num_stages"),
    ("num_stages-as-float", _set("num_stages", 2.0), "num_stages"),
    ("num_stages-as-bool", _set("num_stages", True), "num_stages"),
    ("num_stages-nested", _set("num_stages", {"value": 2}), "num_stages"),
    ("split_points-as-string", lambda d: _set("split_points", d["split_points"][0])(d), "split_points"),
    ("split_point-not-a-string", _set("split_points[0]", 3), "split_points[0]"),
    ("split_point-empty", _set("split_points[0]", ""), "split_points[0]"),
    ("stages-as-object", lambda d: _set("stages", {"0": d["stages"][0]})(d), "stages"),
    ("stage-nested-in-a-list", lambda d: _set("stages[0]", [d["stages"][0]])(d), "stages[0]"),
    ("fwd_s-as-string", _set("stages[0].fwd_s", "fast"), "stages[0].fwd_s"),
    ("param_bytes-as-float", _set("stages[0].param_bytes", 1.5), "stages[0].param_bytes"),
    ("schedule-as-number", _set("schedule", 7), "schedule"),
    ("baselines-as-object", _set("baselines", {}), "baselines"),
    ("fits_memory-as-string", _set("baselines[0].fits_memory", "yes"), "baselines[0].fits_memory"),
    ("memory_limit-as-string", _set("memory_limit_bytes", "16GiB"), "memory_limit_bytes"),
    ("segment_names-as-string", _set("segment_names", "layers"), "segment_names"),
    ("extras-in-version-2", _set("extras", {}), "extras"),
    ("machine-as-list", _set("machine", []), "machine"),
    ("segment-time-as-string", _set("segments[0].fwd_s", "x"), "segments[0].fwd_s"),
    ("segment-bytes-as-float", _set("segments[0].act_bytes", 1.5), "segments[0].act_bytes"),
    ("unknown-segment-field", _set("segments[0].gpu", 1), "segments[0].gpu"),
    ("lazy_sends-as-string", _set("machine.lazy_sends", "yes"), "machine.lazy_sends"),
    ("note-not-a-string", _set("notes", [1]), "notes[0]"),
    ("alternative-missing-fits", _drop("alternatives[0].fits"), "alternatives[0].fits"),
    ("unknown-step-tail-part", _set("step_tail.sleep_s", 1.0), "step_tail.sleep_s"),
    # out of range: zero, negative, huge
    ("zero-stages", _set("num_stages", 0), "num_stages"),
    ("huge-num_stages", _set("num_stages", 10**12), "num_stages"),
    ("huge-n_microbatches", _set("n_microbatches", 10**7), "n_microbatches"),
    ("negative-n_microbatches", _set("n_microbatches", -3), "n_microbatches"),
    ("zero-stages_per_rank", _set("stages_per_rank", 0), "stages_per_rank"),
    ("negative-comm_s", _set("stages[0].comm_s", -1e-3), "stages[0].comm_s"),
    ("negative-predicted_step_s", _set("predicted_step_s", -1.0), "predicted_step_s"),
    ("param_bytes-past-int64", _set("stages[0].param_bytes", 2**64), "stages[0].param_bytes"),
    ("inflight-past-the-micro-batches", lambda d: _set("stages[0].inflight_microbatches", d["n_microbatches"] + 1)(d),
     "stages[0].inflight_microbatches"),
    ("zero-memory-limit", lambda d: _set("memory_limit_bytes", [0] * (d["num_stages"] // d["stages_per_rank"]))(d),
     "memory_limit_bytes[0]"),
    ("zero-bandwidth", _set("machine.links[0].bandwidth", 0.0), "machine.links[0].bandwidth"),
    ("negative-step-tail", _set("step_tail.merge_outputs_s", -1.0), "step_tail.merge_outputs_s"),
    ("pairs-past-the-schedule-bound", _set("n_microbatches", 200_000), "n_microbatches"),
    # NaN and infinities
    ("nan-time", _set("stages[0].fwd_s", math.nan), "stages[0].fwd_s"),
    ("infinite-time", _set("stages[1].bwd_s", math.inf), "stages[1].bwd_s"),
    ("minus-infinite-bottleneck", _set("bottleneck_s", -math.inf), "bottleneck_s"),
    ("overflowing-literal", _stage_value_text("fwd_s", "1e999"), "stages[0].fwd_s"),
    ("nan-overhead", _set("machine.action_overhead_s[0]", math.nan), "machine.action_overhead_s[0]"),
    # empty
    ("empty-object", _raw(b"{}"), "format_version"),
    ("no-stages", _set("stages", []), "stages"),
    ("empty-schedule", _set("schedule", ""), "schedule"),
    # fields that disagree
    ("extra-split-point", lambda d: _set("split_points", d["split_points"] + ["out_linear"])(d), "split_points"),
    ("repeated-split-point", lambda d: _set("split_points", [d["split_points"][0]] * 2)(d), "split_points"),
    ("stage-dropped", lambda d: _set("stages", d["stages"][:-1])(d), "stages"),
    ("stages_per_rank-not-dividing", lambda d: _set("stages_per_rank", d["num_stages"] + 1)(d), "stages_per_rank"),
    ("unknown-schedule", _set("schedule", "ZigZag"), "schedule"),
    ("schedule-cannot-run-the-counts", lambda d: _set("n_microbatches", 1)(_set("schedule", "DualPipeV")(d)),
     "schedule"),
    ("stages-out-of-order", _swap_stage_indices, "stages[0].index"),
    ("segment-gap", lambda d: _set("stages[1].first_segment", d["stages"][1]["first_segment"] + 1)(d),
     "stages[1].first_segment"),
    ("last-stage-short-of-the-segments", lambda d: _set("segment_names", d["segment_names"] + ["extra"])(d),
     "stages[-1].last_segment"),
    ("split_spec-disagrees", _set("split_spec", {"out_linear": "BEGINNING"}), "split_spec"),
    ("overheads-for-another-stage-count", _set("machine.action_overhead_s", [0.0]), "machine.action_overhead_s"),
    ("links-for-another-cut-count", lambda d: _set("machine.links", d["machine"]["links"] * 2)(d), "machine.links"),
    ("peaks-for-another-rank-count", _set("rank_peak_bytes", [1, 2, 3]), "rank_peak_bytes"),
    ("segments-for-another-segment-count", lambda d: _set("segments", d["segments"][:-1])(d), "segments"),
    ("memory-limits-for-another-rank-count", _set("memory_limit_bytes", [2**30] * 7), "memory_limit_bytes"),
]


def _write(tmp_path: pathlib.Path, valid: dict[str, Any], mutation: Mutation) -> pathlib.Path:
    content = mutation(copy.deepcopy(valid))
    if isinstance(content, (dict, list)):
        content = json.dumps(content)  # NaN and Infinity as Python's json writes them
    path = tmp_path / "plan.json"
    path.write_bytes(content if isinstance(content, bytes) else content.encode("utf-8"))
    return path


# Only a file can spell these (the data of a key given twice holds it once).
FILE_ONLY = {"key-given-twice"}


def _expected_field(field: str, valid: dict[str, Any]) -> str:
    return field.replace("stages[-1]", f"stages[{len(valid['stages']) - 1}]")


def _assert_names(error: PlanFileError, field: str) -> None:
    """``error.field`` is ``field``, or starts with it when ``field`` ends in "..." (a deep path)."""
    if field.endswith("..."):
        assert error.field.startswith(field[:-3]), error.field
        assert field[:-3] in str(error)
    else:
        assert error.field == field, (error.field, str(error))
        if field:
            assert field in str(error)


def test_the_corpus_is_large_and_its_cases_distinct():
    assert len(CORPUS) >= 30
    assert len({case for case, _, _ in CORPUS}) == len(CORPUS)


def test_the_valid_plan_loads(valid, tmp_path):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(valid))
    assert Plan.load(path).to_dict() == valid


@pytest.mark.parametrize("case, mutation, field", CORPUS, ids=[c for c, _, _ in CORPUS])
def test_a_malformed_plan_file_is_refused_naming_the_field(case, mutation, field, valid, tmp_path):
    path = _write(tmp_path, valid, mutation)
    with refused_within(), pytest.raises(PlanFileError) as info:
        Plan.load(path)
    error = info.value
    _assert_names(error, _expected_field(field, valid))
    assert error.path == os.fspath(path)
    assert os.fspath(path) in str(error)
    if not field:
        assert "is not a plan JSON file" in str(error) or "a plan is one JSON object" in str(error)


DATA_CASES = [c for c in CORPUS if c[2] and c[0] not in FILE_ONLY]


@pytest.mark.parametrize("case, mutation, field", DATA_CASES, ids=[c for c, _, _ in DATA_CASES])
def test_from_dict_refuses_the_same_data_naming_the_same_field(case, mutation, field, valid):
    content = mutation(copy.deepcopy(valid))
    if isinstance(content, (str, bytes)):
        content = json.loads(content)
    with pytest.raises(PlanFileError) as info:
        Plan.from_dict(content)
    _assert_names(info.value, _expected_field(field, valid))
    assert info.value.path is None
    assert str(info.value).startswith("plan data")


def test_from_dict_takes_to_dict_output_as_it_is(valid):
    # to_dict() is asdict(): tuples stay tuples and numpy scalars stay numpy, unlike JSON's data.
    import numpy as np

    data = copy.deepcopy(valid)
    data["whole_pass"] = {"segments_fwd_s": 1e-3, "segments_bwd_s": 2e-3, "segments_accum_s": 0.0, "fwd_s": 1e-3,
                          "bwd_s": 2e-3, "accum_s": 0.0, "scales": (1.0, 1.0, 1.0), "fitted": True}
    data["segments"][0]["cut_fwd_bytes"] = np.int64(64)
    data["stages"][0]["fwd_s"] = np.float64(data["stages"][0]["fwd_s"])
    data["split_points"] = tuple(data["split_points"])
    plan = Plan.from_dict(data)
    assert plan.split_points == list(valid["split_points"])
    assert Plan.from_dict(plan.to_dict()) == plan


def test_plan_file_error_is_a_value_error_under_the_top_level_error():
    assert issubclass(PlanFileError, autopipe.AutopipeError) and issubclass(PlanFileError, ValueError)
    assert "AutopipeError" in autopipe.__all__


def test_a_file_larger_than_the_bound_is_refused_before_it_is_parsed(valid, tmp_path, monkeypatch):
    import autopipe.planning.plan_file as plan_file

    path = tmp_path / "plan.json"
    path.write_text(json.dumps(valid))
    monkeypatch.setattr(plan_file, "MAX_PLAN_FILE_BYTES", path.stat().st_size - 1)
    monkeypatch.setattr(plan_file.json, "loads", lambda *a, **k: pytest.fail("parsed a file past the bound"))
    with pytest.raises(PlanFileError, match="MAX_PLAN_FILE_BYTES") as info:
        Plan.load(path)
    assert info.value.field == ""


def test_old_failures_now_name_their_field(valid, tmp_path):
    # stages_per_rank 0 divided by zero in the runtime; a string of split points became one
    # split per character.
    path = _write(tmp_path, valid, _set("stages_per_rank", 0))
    with pytest.raises(PlanFileError, match=r"stages_per_rank=0 must be an integer >= 1"):
        Plan.load(path)
    path = _write(tmp_path, valid, _set("split_points", "layers.1"))
    with pytest.raises(PlanFileError, match=r"split_points='layers.1' must be a list"):
        Plan.load(path)


# ---------------------------------------------------------------------- the model


def test_split_points_are_checked_against_a_given_model(valid, tmp_path, small_transformer):
    model, _ = small_transformer
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(valid))
    assert Plan.load(path, model=model).split_points == valid["split_points"]
    other = torch.nn.Sequential(torch.nn.Linear(2, 2))
    with pytest.raises(PlanFileError, match="not submodules of Sequential") as info:
        Plan.load(path, model=other)
    assert info.value.field == "split_points"
    with pytest.raises(PlanFileError):
        Plan.load(path).check_model(other)


# ---------------------------------------------------------------------- nothing runs


class _TouchOnUnpickle:
    """Unpickling this creates ``path``: what loading a plan must never do."""

    def __init__(self, path: pathlib.Path) -> None:
        self.path = path

    def __reduce__(self):
        return (pathlib.Path.touch, (self.path,))


def test_a_pickle_is_refused_without_being_run(tmp_path):
    marker = tmp_path / "ran"
    path = tmp_path / "plan.json"
    path.write_bytes(pickle.dumps({"format_version": 1, "payload": _TouchOnUnpickle(marker)}))
    with pytest.raises(PlanFileError):
        Plan.load(path)
    assert not marker.exists()


def test_code_in_a_string_field_stays_a_string(valid, tmp_path):
    marker = tmp_path / "ran"
    code = f"__import__('pathlib').Path({os.fspath(marker)!r}).touch()"
    path = _write(tmp_path, valid, _set("model_name", code))
    assert Plan.load(path).model_name == code
    assert not marker.exists()


# ---------------------------------------------------------------------- where plans are read


def test_pipeline_refuses_a_huge_micro_batch_count_before_joining_the_job(valid, tmp_path, monkeypatch):
    import _runtime_workers as workers
    from autopipe.runtime import Pipeline

    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)  # joining the job would fail differently
    path = _write(tmp_path, valid, _set("n_microbatches", 10**7))  # read before the model is consulted
    with refused_within(), pytest.raises(PlanFileError, match="n_microbatches=10000000") as info:
        Pipeline(workers.tutorial_model(), example_args=workers.example_args(), plan=path)
    assert info.value.field == "n_microbatches"


def test_report_names_the_field_of_a_bad_plan_instead_of_running_out_of_memory(valid, tmp_path, capsys):
    from autopipe.cli.main import main

    path = _write(tmp_path, valid, _set("n_microbatches", 10**7))
    with refused_within():
        status = main(["report", os.fspath(path)])
    err = capsys.readouterr().err
    assert status != 0
    assert "n_microbatches=10000000" in err and "<= 262144" in err


def test_a_plan_of_an_earlier_format_is_refused_saying_to_plan_again(valid):
    with pytest.raises(PlanFileError, match=r"format_version=1 \(written by an earlier autopipe: plan the "
                                                     r"model again to write the current format\)"):
        autopipe.Plan.from_dict({**valid, "format_version": 1})
