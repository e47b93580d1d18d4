"""A step gives the unsplit model's numbers or raises on every rank: never a wrong number in silence.

Scenarios run in a few spawned gloo worlds of 2 CPU ranks (``_guard_workers.py``); each
test checks one behaviour of their results.
"""

from __future__ import annotations

import functools

import pytest

import _guard_workers as workers
from _dist_utils import run_world

TOL = 1e-5


@functools.lru_cache(maxsize=None)
def autocast_results() -> dict[str, list[dict]]:
    scenarios = [(kind, "autocast_run", (kind,)) for kind in ("mlp", "transformer")]
    per_rank = run_world(workers.scenarios_run, 2, scenarios, timeout_s=300)
    return {key: [r[key] for r in per_rank] for key, _, _ in scenarios}


@pytest.mark.distributed
@pytest.mark.parametrize("kind", ["mlp", "transformer"])
def test_a_bfloat16_tensor_crossing_a_cut_under_autocast_is_read_as_what_it_is(kind):
    # The cut is traced in float32; under autocast the sending stage computes it in bfloat16.
    for r in autocast_results()[kind]:
        assert abs(r["loss"] - r["ref_loss"]) < TOL, r
        # Micro-batches accumulate bfloat16 products in another order than the whole batch.
        assert r["grad_diff"] < 2e-2 * r["grad_scale"], r


def test_a_stage_output_in_another_dtype_than_traced_is_widened_or_refused():
    import torch
    import torch.nn as nn

    from autopipe.runtime.compat import guard_stage_boundaries

    class Cast(nn.Module):
        def __init__(self, dtype):
            super().__init__()
            self.dtype = dtype

        def forward(self, x):
            return x.to(self.dtype) * 3

    narrow = Cast(torch.bfloat16)
    narrow._autopipe_wire = {"inputs": {}, "outputs": {}, "traced": {0: torch.float32}}
    guard_stage_boundaries(narrow)
    assert narrow(torch.ones(2)).dtype == torch.float32
    wide = Cast(torch.float64)
    wide._autopipe_wire = {"inputs": {}, "outputs": {}, "traced": {0: torch.float32}}
    guard_stage_boundaries(wide)
    with pytest.raises(TypeError, match="stage output 0 is torch.float64 but was traced as torch.float32"):
        wide(torch.ones(2))


@functools.lru_cache(maxsize=None)
def eval_results() -> list[dict]:
    return run_world(workers.eval_mode_run, 2, timeout_s=300)


@pytest.mark.distributed
def test_eval_mode_runs_the_eval_graph_of_functional_dropout_and_training_branches():
    per_rank = eval_results()
    for r in per_rank:
        assert r["loss_diff"] < TOL, r
    assert per_rank[0]["out_diff"] is None and per_rank[1]["out_diff"] < TOL, per_rank


@functools.lru_cache(maxsize=None)
def rank_local_results() -> list[dict]:
    # Collectives time out after 30 s: an error case that left a rank waiting fails the world.
    return run_world(workers.rank_local_errors_run, 2, timeout_s=120, pg_timeout_s=30)


@pytest.mark.distributed
def test_a_call_one_rank_refuses_is_refused_on_every_rank_and_later_steps_stay_exact():
    rank0, rank1 = rank_local_results()
    assert rank1["outcomes"]["one_rank_bad_target"].startswith("ValueError: target holds a float")
    assert rank0["outcomes"]["one_rank_bad_target"].startswith("PipelineStepError: step() call 2 was refused on rank 1")
    assert rank0["outcomes"]["wrong_batch_on_rank_0"].startswith("ValueError: input args[0] of the batch has shape")
    assert rank1["outcomes"]["wrong_batch_on_rank_0"].startswith("PipelineStepError:")
    for r in (rank0, rank1):
        assert r["outcomes"]["different_counts"].startswith(
            "ValueError: the ranks' batches hold different numbers of micro-batches ([2, 4])"), r["outcomes"]
        assert r["outcomes"]["different_widths"].startswith(
            "ValueError: the ranks' batches have different sizes after the rows ([(3,), (8,)])"), r["outcomes"]
        assert r["outcomes"]["untraceable_width"].startswith(
            "ValueError: the batch's inputs have sizes [3] after the rows (traced at [8]), and the model cannot be "
            "traced at them"), r["outcomes"]
        assert r["outcomes"]["another_rank"].startswith(
            "ValueError: input args[0] of the batch has 3 dimensions (8, 8, 1), but the pipeline was traced with 2 "
            "(2, 8)"), r["outcomes"]
    for r in (rank0, rank1):
        assert r["outcomes"]["numpy_target"].startswith("ValueError: target holds a ndarray"), r["outcomes"]
        assert len(r["losses"]) == 3
        assert max(abs(a - b) for a, b in zip(r["losses"], r["ref_losses"])) < TOL, r


@pytest.mark.distributed
@pytest.mark.parametrize("kind, what", [("per_element", "a tensor of shape (2, 4)"), ("python_float", "a float")])
def test_a_loss_that_is_not_a_scalar_tensor_is_a_step_error_on_every_rank(kind, what):
    for r in rank_local_results():
        assert r["outcomes"][kind].startswith("PipelineStepError:"), r["outcomes"][kind]
        assert f"loss_fn returned {what}" in r["outcomes"][kind]


@pytest.mark.distributed
def test_ranks_making_different_calls_raise_on_every_rank_and_stop():
    for r in rank_local_results():
        assert r["outcomes"]["out_of_step"].startswith("RuntimeError: the ranks are out of step"), r["outcomes"]
        assert "rank 0 at its call" in r["outcomes"]["out_of_step"] and "(evaluate())" in r["outcomes"]["out_of_step"]
        assert r["outcomes"]["after_out_of_step"].startswith("RuntimeError: the ranks are out of step")


@pytest.mark.distributed
@pytest.mark.parametrize("schedule", ["ZBVZeroBubble", "DualPipeV"])
def test_inference_under_inference_mode_with_a_v_schedule_leaves_the_pipeline_usable(schedule):
    rank0, rank1 = run_world(workers.inference_mode_run, 2, schedule, timeout_s=120, pg_timeout_s=30)
    # V placement: the last stage is on rank 0.
    assert rank0["out_diff"] < TOL and rank1["out_diff"] is None, (rank0, rank1)
    assert rank0["step_diff"] < TOL and rank1["step_diff"] < TOL


def test_under_data_parallelism_a_wrongly_sized_batch_is_told_the_global_shape():
    import torch

    from autopipe.runtime.model_io import ModelIO, TracedBatch

    example = ((torch.ones(2, 3),), {})
    batch = TracedBatch(ModelIO.from_example(*example, None), example, 4)
    # 8 rows: one replica's share (DDP's convention), where the pipeline takes the global batch of 16.
    with pytest.raises(ValueError, match=r"shape \(8, 3\).*for each of dp=2 replicas.*pass a batch of shape \(16, 3\)"):
        batch.check((torch.ones(8, 3),), {}, torch.ones(8), need_target=True, replicas=2)
    batch.check((torch.ones(16, 3),), {}, torch.ones(16), need_target=True, replicas=2)


def test_device_cuda_without_a_gpu_is_named_before_the_job_starts():
    import torch
    import torch.nn as nn

    from autopipe.runtime import Pipeline

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    with pytest.raises(ValueError, match="device='cuda', but this machine has no CUDA device"):
        Pipeline(model, example_args=(torch.ones(1, 2),), split_points=["1"], device="cuda")
    assert not torch.distributed.is_initialized()
