"""Specification of autopipe.Pipeline, the drop-in pipeline runtime (CPU, gloo, loopback).

Each distributed scenario runs once per session in a small spawned world (see
``_runtime_workers.py``); the tests below each check one behaviour of its results.
Bad-argument tests that fail before joining a job run in this process.
"""

from __future__ import annotations

import functools
import math

import pytest

from autopipe.planning.plan import Plan, StagePlan
from autopipe import PlannerOptions
from autopipe.runtime import Pipeline
from autopipe.planning.schedules import SCHEDULES

import _runtime_workers as workers
from _dist_utils import run_world

pytestmark = pytest.mark.distributed

TOL = 1e-5


@functools.lru_cache(maxsize=None)
def schedule_results(schedule: str) -> list[dict]:
    return run_world(workers.schedule_run, 2, schedule, 50, timeout_s=240)


# Cases that share a world: (schedule, stages_per_rank, split points or () for the default).
FOUR_RANK_CASES = (("1F1B", 1, ()), ("Interleaved1F1B", 2, ()))
TWO_RANK_CASES = (("1F1B", 1, tuple(workers.NON_CONTIGUOUS_SPLIT)),)
GPT2_SCHEDULES = ("1F1B", "Interleaved1F1B", "ZBVZeroBubble")


@functools.lru_cache(maxsize=None)
def gradient_results(world_size: int, cases: tuple) -> dict[tuple, list[dict]]:
    per_rank = run_world(workers.gradients_run, world_size, list(cases), timeout_s=300)
    return {case: [rank_results[i] for rank_results in per_rank] for i, case in enumerate(cases)}


@functools.lru_cache(maxsize=None)
def gpt2_results() -> dict[str, list[dict]]:
    per_rank = run_world(workers.gpt2_run, 2, list(GPT2_SCHEDULES), timeout_s=300)
    return {s: [rank_results[s] for rank_results in per_rank] for s in GPT2_SCHEDULES}


V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")


@functools.lru_cache(maxsize=None)
def v_boundary_results() -> dict[str, list[dict]]:
    per_rank = run_world(workers.v_boundaries_run, 2, list(V_SCHEDULES), timeout_s=300)
    return {case: [rank_results[case] for rank_results in per_rank] for case in per_rank[0]}


def assert_matches_unsplit(results: list[dict]) -> None:
    """Loss within TOL on every rank; every parameter covered once or more, within TOL."""
    assert set().union(*(r["grad_diff"] for r in results)) == set(results[0]["all_param_names"])
    for r in results:
        assert abs(r["loss"] - r["ref_loss"]) < TOL
        assert max(r["grad_diff"].values()) < TOL, r["grad_diff"]


@functools.lru_cache(maxsize=None)
def tied_and_state_results() -> list[dict]:
    return run_world(workers.tied_and_state_run, 2, timeout_s=240)


@functools.lru_cache(maxsize=None)
def checkpointing_results() -> list[dict]:
    return run_world(workers.checkpointing_and_modes_run, 2, timeout_s=240)


def _plan_with_stages(n_stages: int) -> Plan:
    stages = [StagePlan(index=i, fqns=[], first_segment=i, last_segment=i, fwd_s=0.0, bwd_s=0.0, comm_s=0.0,
                        param_bytes=0, act_bytes=0, peak_bytes=0, send_bytes=0, recv_bytes=0)
              for i in range(n_stages)]
    return Plan(num_stages=n_stages, split_points=workers.SPLITS[4][: n_stages - 1], stages=stages,
                schedule="1F1B", n_microbatches=4, bottleneck_s=0.0, predicted_step_s=0.0, lower_bound_s=0.0)


@functools.lru_cache(maxsize=None)
def error_results(plan_dir: str) -> list[dict]:
    path = f"{plan_dir}/three_stage_plan.json"
    _plan_with_stages(3).save(path)
    return run_world(workers.errors_run, 2, path, timeout_s=240)


@pytest.fixture(scope="module")
def errors(tmp_path_factory):
    return error_results(str(tmp_path_factory.mktemp("plans")))


# ---------------------------------------------------------------------- every schedule, 2 ranks
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_step_loss_equals_unsplit_model_loss(schedule):
    for r in schedule_results(schedule):
        assert abs(r["loss"] - r["ref_loss"]) < TOL


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_step_returns_the_same_loss_on_every_rank(schedule):
    losses = [r["loss"] for r in schedule_results(schedule)]
    assert losses[0] == losses[1]


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_every_gradient_equals_unsplit_model_gradient(schedule):
    results = schedule_results(schedule)
    covered = set().union(*(r["grad_diff"] for r in results))
    assert covered == set(results[0]["all_param_names"])
    for r in results:
        assert max(r["grad_diff"].values()) < TOL, r["grad_diff"]


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_forward_returns_merged_output_on_last_stage_rank_only(schedule):
    results = schedule_results(schedule)
    last = [r for r in results if r["has_last_stage"]]
    others = [r for r in results if not r["has_last_stage"]]
    assert [r["output_diff"] < TOL for r in last] == [True]
    assert [r["output_diff"] for r in others] == [None]


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_seed_tutorial_loss_goes_down_over_50_steps(schedule):
    losses = schedule_results(schedule)[0]["losses"]
    assert len(losses) == 50 and all(math.isfinite(v) for v in losses)
    assert sum(losses[-5:]) < 0.5 * sum(losses[:5])


def test_multi_stage_schedules_place_two_stages_per_rank_loop_or_v():
    assert schedule_results("Interleaved1F1B")[0]["stage_indices"] == [0, 2]
    assert schedule_results("ZBVZeroBubble")[0]["stage_indices"] == [0, 3]


def test_pipeline_leaves_the_users_model_unchanged():
    assert all(r["model_unchanged"] for r in schedule_results("1F1B"))


# ---------------------------------------------------------------------- 4 ranks
@pytest.mark.parametrize("case", FOUR_RANK_CASES, ids=lambda c: c[0])
def test_gradients_equal_unsplit_model_on_4_ranks(case):
    assert_matches_unsplit(gradient_results(4, FOUR_RANK_CASES)[case])


# ---------------------------------------------------------------------- awkward cuts
def test_cut_where_a_strided_tensor_crosses_trains_exactly():
    assert_matches_unsplit(gradient_results(2, TWO_RANK_CASES)[TWO_RANK_CASES[0]])


@pytest.mark.parametrize("schedule", GPT2_SCHEDULES)
def test_gpt2_with_tied_embeddings_and_a_mask_read_by_every_block_trains_exactly(schedule):
    pytest.importorskip("transformers")
    assert_matches_unsplit(gpt2_results()[schedule])


@pytest.mark.parametrize("schedule", V_SCHEDULES)
def test_v_schedule_cut_that_sends_integer_position_ids_trains_exactly(schedule):
    # torch infers a V stage's input shapes by running it on uninitialised tensors unless
    # told them; integer ids filled with garbage then index out of range.
    pytest.importorskip("transformers")
    assert_matches_unsplit(v_boundary_results()[f"gpt2-{schedule}"])


@pytest.mark.parametrize("schedule", V_SCHEDULES)
def test_split_backward_keeps_outputs_the_stage_saved_for_its_own_backward(schedule):
    # torch detaches stage outputs in place when the backward is split into I and W; the
    # residual stream a stage sends is also saved by its layer norm.
    pytest.importorskip("transformers")
    assert_matches_unsplit(v_boundary_results()[f"gpt2-residual-{schedule}"])


@pytest.mark.parametrize("schedule", V_SCHEDULES)
def test_v_schedule_gradients_through_skip_concatenations_are_sent_contiguous(schedule):
    # The gradient of a torch.cat input is a strided slice, which gloo refuses to send.
    assert_matches_unsplit(v_boundary_results()[f"unet-{schedule}"])


# ---------------------------------------------------------------------- tied weights, state dicts
def test_tied_parameter_appears_once_per_rank_under_its_original_name():
    assert [r["tied_names"] for r in tied_and_state_results()] == [["embedding.weight"]] * 2


def test_tied_parameter_gradient_is_summed_over_the_stages_that_use_it():
    assert all(r["tied_grad_diff"] < TOL for r in tied_and_state_results())


def test_tied_weights_stay_equal_after_optimizer_steps():
    assert all(r["tied_copies_equal"] for r in tied_and_state_results())


def test_tied_weights_on_one_rank_share_one_parameter_with_the_unsplit_gradient():
    r0 = tied_and_state_results()[0]  # ZBV: rank 0 runs stages 0 and 3, both use the tie
    assert r0["v_tied_count"] == 1
    assert max(r0["v_tied_grad_diff"].values()) < TOL


def test_full_state_dict_has_every_key_of_the_unsplit_model():
    assert all(r["full_keys_match"] for r in tied_and_state_results())


def test_full_state_dict_of_tied_model_keeps_both_aliases():
    keys = tied_and_state_results()[0]["tied_full_keys"]
    assert "embedding.weight" in keys and "out_linear.weight" in keys


def test_gathered_state_dict_loads_into_unsplit_model_with_the_same_output():
    last = tied_and_state_results()[1]
    assert last["round_trip_diff"] < TOL
    assert last["tied_reload_diff"] < TOL


def test_unsplit_state_dict_loads_into_pipeline_with_the_same_output():
    assert tied_and_state_results()[1]["load_diff"] < TOL


def test_per_rank_state_dict_restores_that_ranks_tensors():
    assert all(r["local_restored"] for r in tied_and_state_results())


# ---------------------------------------------------------------------- checkpointing, modes
@pytest.mark.parametrize("schedule", ["1F1B", "ZBVZeroBubble"])
def test_activation_checkpointing_keeps_loss_and_gradients(schedule):
    for r in checkpointing_results():
        run = r[f"checkpointed_{schedule}"]
        assert abs(run["loss"] - run["ref_loss"]) < TOL
        assert max(run["grad_diff"].values()) < TOL


def test_eval_mode_forward_matches_unsplit_model_in_eval_mode():
    assert checkpointing_results()[1]["eval_output_diff"] < TOL


def test_evaluate_returns_eval_mode_loss_on_every_rank():
    for r in checkpointing_results():
        assert abs(r["eval_loss"] - r["ref_eval_loss"]) < TOL


@pytest.mark.parametrize("schedule", ["1F1B", "ZBVZeroBubble"])
def test_a_rank_is_given_only_what_its_stages_read(schedule):
    for r in checkpointing_results():
        case = r[f"only_needed_{schedule}"]
        assert abs(case["loss"] - case["ref_loss"]) < 1e-5
        assert max(case["grad_diff"].values()) < 1e-5, case["grad_diff"]
        loss, ref = r[f"only_needed_eval_{schedule}"]
        assert abs(loss - ref) < 1e-5


@pytest.mark.parametrize("schedule, n_stages, held", workers.SHORT_BATCH_CASES)
def test_a_short_last_batch_of_whole_micro_batches_gives_the_unsplit_result(schedule, n_stages, held):
    # Built for 4 micro-batches of 2 rows; given 6 (or 2) rows, as a DataLoader's last batch.
    for r in checkpointing_results():
        case = r["short"][f"{schedule}-{held}"]
        assert abs(case["loss"] - case["ref_loss"]) < 1e-5
        assert max(case["grad_diff"].values()) < 1e-5, case["grad_diff"]
        assert abs(case["eval"][0] - case["eval"][1]) < 1e-5
        assert case["forward_diff"] is None or case["forward_diff"] < 1e-5
        assert abs(case["full_after"] - case["ref_full"]) < 1e-5  # the next whole batch counts every micro-batch
    assert any(r["short"][f"{schedule}-{held}"]["forward_diff"] is not None for r in checkpointing_results())


@pytest.mark.parametrize("schedule", [s for s, _ in workers.LENGTH_CASES])
def test_batches_of_other_sequence_lengths_give_the_unsplit_result(schedule):
    # Traced at length 12; called at 8, 16, 16 with 3 of 4 micro-batches, 12 and 8 again.
    for r in checkpointing_results():
        for call in range(len(workers.LENGTH_CALLS)):
            case = r["lengths"][f"{schedule}-{call}"]
            assert abs(case["loss"] - case["ref_loss"]) < 1e-5, (call, case)
            assert max(case["grad_diff"].values()) < 1e-5, (call, case["grad_diff"])
            assert abs(case["eval"][0] - case["eval"][1]) < 1e-5
            assert case["forward_diff"] is None or case["forward_diff"] < 1e-5
        assert r["lengths"][f"{schedule}-shapes"] == 2  # 8 and 16 traced once each, kept; 12 is the first trace
    assert any(r["lengths"][f"{schedule}-0"]["forward_diff"] is not None for r in checkpointing_results())


def test_tracing_again_for_new_lengths_frees_the_source_torch_fx_keeps():
    # Two cycles through one more length than a pipeline keeps: every call traces again and drops a shape.
    for r in checkpointing_results():
        first, second = r["lengths"]["linecache"]
        assert second == first, r["lengths"]["linecache"]


def test_step_in_eval_mode_asks_for_train():
    assert "pipe.train()" in checkpointing_results()[0]["step_in_eval_mode"]


def test_train_after_eval_steps_again():
    assert all(math.isfinite(r["train_mode_loss"]) for r in checkpointing_results())


# ---------------------------------------------------------------------- failures
def test_a_rank_that_raises_makes_every_rank_exit_with_an_error():
    results = run_world(workers.failing_rank_run, 2, timeout_s=120, pg_timeout_s=30, allow_errors=True)
    assert [status for status, _ in results] == ["error", "error"]
    assert "injected failure on rank 1" in results[1][1]
    assert "killed" not in results[0][1]  # rank 0 raised by itself, the harness did not kill it


def test_batch_not_divisible_into_microbatches_is_a_clear_error(errors):
    for r in errors:
        assert r["odd_batch"].startswith("ValueError") and "n_microbatches=4" in r["odd_batch"]


def test_target_not_divisible_into_microbatches_is_a_clear_error(errors):
    assert all("target" in r["odd_target"] and r["odd_target"].startswith("ValueError") for r in errors)


def test_pipeline_still_steps_after_a_rejected_batch(errors):
    assert all(math.isfinite(r["step_after_errors"]) for r in errors)


def test_a_hand_split_not_matching_world_size_is_a_clear_error(errors):
    for r in errors:
        assert r["ranks_mismatch"].startswith("ValueError") and "make 3 stages, but 2 ranks" in r["ranks_mismatch"]


def test_plan_not_matching_world_size_is_a_clear_error(errors):
    for r in errors:
        assert r["plan_world_mismatch"].startswith("ValueError") and "3 ranks" in r["plan_world_mismatch"]


def test_ranks_given_different_splits_all_raise(errors):
    assert all(r["ranks_disagree"].startswith("ValueError") for r in errors)


def test_plan_is_computed_once_on_rank_0(errors):
    assert [r["planner_calls"] for r in errors] == [1, 0]


def test_a_saved_plan_file_builds_the_same_pipeline(errors):
    assert all(r["plan_file_step"] == r["planned_step"] for r in errors)


def test_every_rank_builds_the_broadcast_plan(errors):
    assert errors[0]["planned_split"] == errors[1]["planned_split"]
    assert errors[0]["planned_step"] == errors[1]["planned_step"]


# ---------------------------------------------------------------------- errors before joining a job
@pytest.fixture
def model_and_args():
    return workers.tutorial_model(), workers.example_args()


def test_unknown_schedule_name_lists_the_schedules_that_exist(model_and_args):
    model, args = model_and_args
    with pytest.raises(ValueError, match="Interleaved1F1B") as info:
        Pipeline(model, example_args=args, schedule="ZeroBubbleX")
    assert "ZeroBubbleX" in str(info.value)


def test_example_args_must_be_a_tuple(model_and_args):
    model, args = model_and_args
    with pytest.raises(TypeError, match="example_args"):
        Pipeline(model, example_args=args[0])


def test_split_point_that_is_not_a_module_is_a_clear_error(model_and_args):
    model, args = model_and_args
    with pytest.raises(ValueError, match="layers.9"):
        Pipeline(model, example_args=args, split_points=["layers.9"])


def test_plan_and_split_points_together_are_refused(model_and_args):
    model, args = model_and_args
    with pytest.raises(ValueError, match="not both"):
        Pipeline(model, example_args=args, plan=_plan_with_stages(2), split_points=["layers.1"])


def test_missing_plan_file_is_a_clear_error(model_and_args, tmp_path):
    model, args = model_and_args
    with pytest.raises(FileNotFoundError, match="nope.json"):
        Pipeline(model, example_args=args, plan=tmp_path / "nope.json")


def test_bad_counts_and_planner_settings_are_named(model_and_args):
    model, args = model_and_args
    with pytest.raises(ValueError, match=r"stages_per_rank=0 must be an integer >= 1"):
        Pipeline(model, example_args=args, planner=PlannerOptions(stages_per_rank=0))
    with pytest.raises(TypeError, match=r"planner=\{'memory': '1GiB'\} must be an autopipe.PlannerOptions"):
        Pipeline(model, example_args=args, planner={"memory": "1GiB"})


def test_without_a_job_the_error_says_how_to_launch(model_and_args, monkeypatch):
    model, args = model_and_args
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(RuntimeError, match="autopipe run"):
        Pipeline(model, example_args=args, split_points=["layers.1"])


def test_stage_times_measured_inside_running_steps_feed_calibrate():
    first, second = checkpointing_results()
    measured = first["stage_times"]
    assert measured == second["stage_times"]  # every rank gets every stage's times
    assert len(measured["fwd_s"]) == len(measured["bwd_s"]) == 4
    assert all(t > 0 for t in measured["fwd_s"] + measured["bwd_s"])
    assert first["calibrated_fwd_s"] == pytest.approx(measured["fwd_s"])
    assert first["grads_left_alone"] and second["grads_left_alone"]
    assert "steps=0 must be an integer >= 1" in first["bad_steps"]
