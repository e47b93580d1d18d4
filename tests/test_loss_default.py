"""The loss counts by default: partition() without loss_fn, and the plans Pipeline makes with its loss.

Every plan here uses ``cost="flops"``, so splits depend on counted FLOPs and bytes, never on
measured time.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autopipe
from zoo import hf
from zoo import build
from autopipe.planning.default_loss import (ASSUMED_LOSS_NOTE, NO_LOSS_NOTE, assumed_loss, example_target_for,
                                            lm_vocabulary, pipeline_loss, token_cross_entropy)
from autopipe.planning.tracing import trace, traces_reused
from autopipe.reporting.data import report_data
from autopipe.reporting.html import plan_to_html
from autopipe.reporting.markdown import plan_to_markdown
from autopipe.runtime.plan_setup import planner_kwargs
from _planning import partition_with

QUICK = autopipe.ProfileOptions(progress=False, warmup=0, repeats=1)
HF_LMS = ["gpt2_tied", "gpt2_untied", "llama"]
LANGUAGE_MODELS = ["seed_transformer", *HF_LMS]
# Small sizes of each zoo language model: the vocabulary still the largest tensor at the head.
SIZES: dict[str, dict[str, Any]] = {
    "seed_transformer": {"vocab_size": 2000, "d_model": 32, "d_ff": 64, "num_layers": 3, "seq_len": 16},
}


@pytest.fixture(scope="module", autouse=True)
def _one_trace_per_model():
    """Every plan of one model here is made from its first trace (no test changes a model's modules or
    modes), as ``plan_data_parallel`` plans every layout: the loss is what these tests compare."""
    with traces_reused():
        yield


def user_lm_loss(output: Any, target: torch.Tensor) -> torch.Tensor:
    """The token cross-entropy a user writes for a language model (a tensor or an output with ``logits``)."""
    logits = getattr(output, "logits", output)
    return nn.CrossEntropyLoss()(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def zoo_lm(name: str) -> tuple[nn.Module, tuple[Any, ...]]:
    if name in HF_LMS and not hf.HF_AVAILABLE:
        pytest.skip("transformers is not installed")
    return build(name, **SIZES.get(name, {}))


def plan_of(model: nn.Module, args: tuple, **kwargs: Any) -> autopipe.Plan:
    return partition_with(model, 2, example_args=args, cost="flops", profiling=QUICK, **kwargs)


@pytest.fixture(scope="module")
def lm_plans() -> dict[str, tuple[nn.Module, tuple, autopipe.Plan]]:
    """Each zoo language model with its plan from partition() without loss_fn (built once)."""
    plans = {}
    for name in LANGUAGE_MODELS:
        if name in HF_LMS and not hf.HF_AVAILABLE:
            continue
        model, args = zoo_lm(name)
        plans[name] = (model, args, plan_of(model, args))
    return plans


def _lm(lm_plans: dict, name: str) -> tuple[nn.Module, tuple, autopipe.Plan]:
    if name not in lm_plans:
        pytest.skip("transformers is not installed")
    return lm_plans[name]


@pytest.mark.parametrize("name", LANGUAGE_MODELS)
def test_language_model_is_charged_its_loss_by_default(lm_plans: dict, name: str) -> None:
    model, args, plan = _lm(lm_plans, name)
    assert plan.loss is not None and plan.loss.act_bytes > 0
    assert plan.loss.fwd_s == 0.0 and plan.loss.bwd_s == 0.0  # counted FLOPs: the loss adds bytes, no time
    notes = [n for n in plan.notes if n.startswith(ASSUMED_LOSS_NOTE)]
    assert len(notes) == 1 and "loss_fn=False" in notes[0]
    # The last stage holds the loss's saved bytes for every micro-batch it has in flight.
    without = plan_of(model, args, loss_fn=False)
    assert without.loss is None and not any(n.startswith("loss:") for n in without.notes)
    assert without.split_points == plan.split_points
    last, last_without = plan.stages[-1], without.stages[-1]
    assert last.peak_bytes - last_without.peak_bytes >= plan.loss.act_bytes
    assert plan.stages[0].peak_bytes == without.stages[0].peak_bytes


@pytest.mark.parametrize("name", LANGUAGE_MODELS)
def test_every_report_form_prints_the_loss_note(lm_plans: dict, name: str) -> None:
    _, _, plan = _lm(lm_plans, name)
    data = report_data(plan)
    for text in (plan.report(), plan_to_markdown(data), plan_to_html(data, figures=False)):
        assert ASSUMED_LOSS_NOTE in text


@pytest.mark.parametrize("name", LANGUAGE_MODELS)
def test_assumed_loss_plans_like_the_users_cross_entropy(lm_plans: dict, name: str) -> None:
    model, args, plan = _lm(lm_plans, name)
    chosen = assumed_loss(model, trace(model, args))
    given = plan_of(model, args, loss_fn=user_lm_loss, example_target=chosen.target)
    assert given.split_points == plan.split_points
    assert given.loss.act_bytes == plan.loss.act_bytes
    assert [s.peak_bytes for s in given.stages] == [s.peak_bytes for s in plan.stages]
    assert not any(n.startswith("loss:") for n in given.notes)  # the caller's own loss: nothing to say


@pytest.mark.parametrize("name", LANGUAGE_MODELS)
def test_pipeline_plans_like_partition(lm_plans: dict, name: str) -> None:
    """The planning path of Pipeline (its loss_fn, no example_target) gives partition()'s plan."""
    model, args, plan = _lm(lm_plans, name)
    kwargs, note = planner_kwargs(autopipe.PlannerOptions(cost="flops"), model, args, None, user_lm_loss)
    assert note is None and kwargs["loss_fn"] is user_lm_loss
    piped = partition_with(model, 2, example_args=args, profiling=QUICK, **kwargs)
    assert piped.split_points == plan.split_points
    assert piped.loss.act_bytes == plan.loss.act_bytes
    assert [s.peak_bytes for s in piped.stages] == [s.peak_bytes for s in plan.stages]


@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_other_models_say_no_loss_is_costed(name: str) -> None:
    model, args = build(name)
    plan = plan_of(model, args)
    assert plan.loss is None
    notes = [n for n in plan.notes if n.startswith(NO_LOSS_NOTE)]
    assert len(notes) == 1 and "example_target=" in notes[0]
    assert NO_LOSS_NOTE in plan.report()
    without = plan_of(model, args, loss_fn=False)
    assert not any(n.startswith("loss:") for n in without.notes)
    assert without.split_points == plan.split_points


def test_a_given_loss_on_a_classifier_is_charged() -> None:
    model, args = build("mlp")
    target = torch.zeros(args[0].shape[0], dtype=torch.long)
    plan = plan_of(model, args, loss_fn=F.cross_entropy, example_target=target)
    assert plan.loss is not None and plan.loss.act_bytes > 0
    assert not any(n.startswith("loss:") for n in plan.notes)


@pytest.mark.parametrize("loss_fn", ["cross_entropy", True, 0, torch.zeros(2)])
def test_bad_loss_fn_is_named(loss_fn: Any) -> None:
    model, args = build("mlp", widths=(4, 8, 4), batch=2)
    with pytest.raises(TypeError, match=r"(?s)loss_fn=.*must be callable.*None.*False"):
        plan_of(model, args, loss_fn=loss_fn)


def test_loss_fn_and_example_target_go_together() -> None:
    model, args = build("mlp", widths=(4, 8, 4), batch=2)
    with pytest.raises(ValueError, match="loss_fn and example_target together.*loss_fn=set, example_target=None"):
        plan_of(model, args, loss_fn=F.cross_entropy)
    with pytest.raises(ValueError, match="loss_fn=False, example_target=set"):
        plan_of(model, args, loss_fn=False, example_target=torch.zeros(2, dtype=torch.long))


def test_example_target_for_mse_cross_entropy_and_a_loss_that_accepts_nothing() -> None:
    model, args = build("mlp", widths=(4, 8, 4), batch=3)  # (3, 10) logits, not a language model
    target, output = example_target_for(model, args, None, F.mse_loss)
    assert target.shape == output.shape and target.is_floating_point()
    target, _ = example_target_for(model, args, None, F.cross_entropy)  # takes class probabilities too
    assert target.shape == output.shape and target.is_floating_point()
    target, _ = example_target_for(model, args, None, lambda out, y: F.nll_loss(F.log_softmax(out, -1), y))
    assert target.shape == (3,) and target.dtype == torch.long and int(target.max()) < 10

    def refuses(output: Any, target: Any) -> torch.Tensor:
        raise ValueError("no target fits")
    assert example_target_for(model, args, None, refuses)[0] is None
    assert example_target_for(model, args, None, lambda out, y: torch.tensor(1.0))[0] is None  # ignores the output

    lm, lm_args = zoo_lm("seed_transformer")
    target, output = example_target_for(lm, lm_args, None, user_lm_loss)
    assert target.shape == lm_args[0].shape and target.dtype == torch.long
    assert int(target.max()) < SIZES["seed_transformer"]["vocab_size"]
    assert lm_vocabulary(lm, lm_args, output) == SIZES["seed_transformer"]["vocab_size"]


def test_pipeline_loss_keywords() -> None:
    model, args = build("mlp", widths=(4, 8, 4), batch=2)
    assert pipeline_loss(model, args, None, None) == ({"loss_fn": False}, None)  # runs no loss: costs none
    target = torch.zeros(2, dtype=torch.long)
    kwargs, note = pipeline_loss(model, args, None, F.cross_entropy, target)
    assert kwargs == {"loss_fn": F.cross_entropy, "example_target": target} and note is None
    kwargs, note = pipeline_loss(model, args, None, lambda out, y: torch.tensor(1.0))
    assert kwargs == {"loss_fn": False} and note.startswith(NO_LOSS_NOTE) and "example_target=" in note
    with pytest.raises(ValueError, match="example_target.*no loss_fn"):
        pipeline_loss(model, args, None, None, target)


def test_planner_kwargs_keep_the_options_and_plan_without_a_derivable_loss() -> None:
    model, args = build("mlp", widths=(4, 8, 4), batch=2)
    options = autopipe.PlannerOptions(cost="flops", memory="1GiB")
    kwargs, note = planner_kwargs(options, model, args, None, lambda out, y: torch.tensor(1.0))
    assert kwargs == {"cost": "flops", "memory": "1GiB", "loss_fn": False} and note.startswith(NO_LOSS_NOTE)
    plan = partition_with(model, 2, example_args=args, profiling=QUICK, **kwargs)
    assert plan.loss is None and not any(n.startswith("loss:") for n in plan.notes)


def test_token_cross_entropy_reads_logits_fields() -> None:
    logits = torch.randn(2, 3, 5)
    target = torch.randint(0, 5, (2, 3))
    expected = F.cross_entropy(logits.reshape(6, 5), target.reshape(6))
    torch.testing.assert_close(token_cross_entropy({"logits": logits}, target), expected)
    with pytest.raises(ValueError, match="token_cross_entropy needs logits"):
        token_cross_entropy((1, 2), target)


# --------------------------------------------------------------------------- Pipeline on 2 gloo ranks
PIPE_SCHEDULE = {"schedule": "1F1B", "n_microbatches": 4}


def _ignores_the_output(output: Any, target: Any) -> torch.Tensor:
    return torch.tensor(1.0)


def _pipeline_plans_worker(rank: int, world_size: int) -> dict[str, Any]:
    """Each rank: the plans Pipeline makes with a token cross-entropy, and with a loss no target fits."""
    model, args = build("seed_transformer", **SIZES["seed_transformer"])
    options = autopipe.PlannerOptions(cost="flops", profiling=QUICK)
    found = {}
    for name, loss_fn in (("lm", user_lm_loss), ("no_target", _ignores_the_output)):
        with autopipe.Pipeline(model, example_args=args, loss_fn=loss_fn, planner=options, **PIPE_SCHEDULE) as pipe:
            plan = pipe.plan
            found[name] = {"split": plan.split_points, "notes": list(plan.notes),
                           "loss_bytes": plan.loss.act_bytes if plan.loss is not None else None,
                           "peaks": [s.peak_bytes for s in plan.stages]}
    return found


def test_a_pipeline_plans_with_its_own_loss_as_partition_does() -> None:
    from _dist_utils import run_world

    results = run_world(_pipeline_plans_worker, 2, timeout_s=240)
    model, args = build("seed_transformer", **SIZES["seed_transformer"])
    expected = plan_of(model, args, **PIPE_SCHEDULE)
    for found in results:
        lm = found["lm"]
        assert lm["split"] == expected.split_points and lm["loss_bytes"] == expected.loss.act_bytes
        assert lm["peaks"] == [s.peak_bytes for s in expected.stages]
        assert not any(n.startswith("loss:") for n in lm["notes"])  # the pipeline's own loss: nothing assumed
        no_target = found["no_target"]
        assert no_target["loss_bytes"] is None
        assert [n for n in no_target["notes"] if n.startswith(NO_LOSS_NOTE)] and \
            "example_target=" in no_target["notes"][-1]


def test_profile_loss_takes_the_output_already_computed() -> None:
    from autopipe.planning.profile import model_output, profile_loss

    model, args = build("seed_transformer", **SIZES["seed_transformer"])
    target, output = example_target_for(model, args, None, user_lm_loss)
    settings = {"device": "cpu", "warmup": 0, "repeats": 1}
    reused = profile_loss(model, args, None, user_lm_loss, target, output=output, **settings)
    rerun = profile_loss(model, args, None, user_lm_loss, target, **settings)
    assert reused.act_bytes == rerun.act_bytes > 0 and reused.batch == rerun.batch
    torch.testing.assert_close(model_output(model, args, None), output)
