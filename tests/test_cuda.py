"""CUDA and NCCL: profiling, planning and pipelines on GPUs.

Skipped where CUDA is absent (CI has no GPU); run them on a GPU machine with
``python -m pytest tests/test_cuda.py``. The two-GPU pipeline test needs two GPUs: NCCL
refuses two ranks on one device.
"""

from __future__ import annotations

import pytest
import torch

import autopipe
from autopipe.machine.speed import measure_device_speed
from autopipe.models import seed_transformer
from autopipe.planning.profile import profile_segments
from autopipe.planning.rank_profile import profile_in_ranks
from autopipe.planning.tracing import trace
from _dist_utils import run_world
from _runtime_workers import SPLITS, build, loss_fn, tutorial_batch, tutorial_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _small_model():
    return seed_transformer(vocab_size=100, num_layers=2, seq_len=16, d_model=64, num_heads=4, batch=4)


def test_profile_copies_segments_to_the_gpu_and_leaves_the_model_alone() -> None:
    model, args = _small_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    traced = trace(model, args)
    on_cpu = profile_segments(traced, device="cpu", repeats=2, progress=False)
    on_gpu = profile_segments(traced, device="cuda", repeats=2, progress=False)
    # A copy of the whole model was timed on the GPU, beside its whole graph, and fitted to it.
    assert on_gpu.whole is not None and on_gpu.whole.fitted
    # The model stayed on the CPU, unchanged.
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert len(on_gpu) == len(on_cpu)
    for c, g in zip(on_cpu, on_gpu):
        # What a segment holds and sends does not depend on the device.
        assert (g.param_bytes, g.trainable_param_bytes, g.out_bytes) == (c.param_bytes, c.trainable_param_bytes, c.out_bytes)
        assert g.fwd_s > 0 and g.bwd_s > 0
        assert (g.accum_s > 0) == (g.trainable_param_bytes > 0)
    # Saved activations may differ by kernel (attention saves its own statistics on CUDA),
    # not by much in total.
    cpu_act, gpu_act = sum(c.act_bytes for c in on_cpu), sum(g.act_bytes for g in on_gpu)
    assert 0.5 < gpu_act / cpu_act < 2.0, (cpu_act, gpu_act)


def test_a_model_too_big_for_the_gpu_is_profiled_one_segment_at_a_time_with_a_warning(monkeypatch) -> None:
    import autopipe.planning.profile as profile

    model, args = _small_model()
    traced = trace(model, args)
    real_copy = profile.copy_to_device

    def copy_or_oom(module, device):
        if module is traced.graph_module:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
        return real_copy(module, device)

    monkeypatch.setattr(profile, "copy_to_device", copy_or_oom)
    # Segments timed one by one on a GPU add up to far more than the model: the user is told.
    with pytest.warns(UserWarning, match="does not fit on cuda:0 whole"):
        costs = profile_segments(traced, device="cuda", repeats=2, progress=False)
    assert costs.whole is None and all(c.fwd_s > 0 for c in costs)


def test_profile_in_rounds_on_the_gpu() -> None:
    """A model already on the GPU is timed in rounds, with the L2 flushed between them."""
    model, args = _small_model()
    model = model.cuda()
    args = tuple(a.cuda() for a in args)
    costs = profile_segments(trace(model, args), device="cuda", repeats=3, progress=False)
    assert all(c.fwd_s > 0 and c.bwd_s > 0 for c in costs)
    # "cuda" names the device the model is on (cuda:0), so the whole graph is timed beside the
    # segments, and on CUDA they are fitted to it by default.
    assert costs.whole is not None and costs.whole.fitted
    assert sum(c.fwd_s for c in costs) == pytest.approx(costs.whole.segments_fwd_s * costs.whole.scales[0])
    assert all((c.accum_s > 0) == (c.trainable_param_bytes > 0) for c in costs)
    # The profile accumulates gradients into buffers of its own, never into .grad.
    assert all(p.grad is None for p in model.parameters())


def test_partition_on_the_gpu() -> None:
    model, args = _small_model()
    plan = autopipe.partition(model, 2, args, n_microbatches=4,
                              planner=autopipe.PlannerOptions(profiling=autopipe.ProfileOptions(device="cuda", progress=False)))
    assert plan.num_stages == 2
    # The CPU-resident model was profiled as a whole copy on the GPU, fitted to its whole graph.
    assert plan.whole_pass.fitted and "segments scaled x" in plan.report()
    assert plan.predicted_step_s > 0
    assert all(st.fwd_s > 0 and st.peak_bytes > 0 for st in plan.stages)
    assert "stage" in plan.report()
    assert measure_device_speed("cuda", reference="cpu") > 0


def _profile_in_ranks_on_the_gpu(rank: int, world_size: int) -> dict:
    model, args = _small_model()
    costs = profile_in_ranks(model, args, device="cuda", warmup=0, repeats=2)
    return {"n": len(costs), "positive": all(c.fwd_s > 0 and c.bwd_s > 0 for c in costs),
            "fitted": costs.whole is not None and costs.whole.fitted,
            "model_on": sorted({p.device.type for p in model.parameters()})}


@pytest.mark.distributed
def test_profile_in_ranks_with_nccl() -> None:
    """The collective profile on a GPU (one rank per GPU: a world of one on a one-GPU machine)."""
    (result,) = run_world(_profile_in_ranks_on_the_gpu, 1, backend="nccl", timeout_s=180, pg_timeout_s=60)
    assert result["n"] > 2 and result["positive"] and result["fitted"]
    assert result["model_on"] == ["cpu"]  # profiled as a copy on the GPU; the model stays where it was


# ------------------------------------------------------------------ pipelines on GPUs
def _gpu_gradients_run(rank: int, world_size: int, schedule: str, stages_per_rank: int) -> dict:
    """One pipeline step on ``cuda:rank`` against the unsplit model on the same GPU."""
    device = torch.device("cuda", rank)
    model = tutorial_model()
    n_stages = world_size * stages_per_rank
    pipe = build(model, schedule, n_stages, stages_per_rank=stages_per_rank, split_points=SPLITS.get(n_stages, []))
    x, y = tutorial_batch(0)
    loss = pipe.step(x, target=y)
    reference = tutorial_model().to(device)
    ref = loss_fn(reference(x.to(device)), y.to(device))
    ref.backward()
    ref_grads = dict(reference.named_parameters())
    return {
        "backend": torch.distributed.get_backend(),
        "param_devices": sorted({str(p.device) for p in pipe.parameters()}),
        "loss": None if loss is None else float(loss),
        "ref_loss": float(ref),
        "grad_diff": {n: float((p.grad - ref_grads[n].grad).abs().max()) for n, p in pipe.named_parameters()},
    }


@pytest.mark.distributed
@pytest.mark.parametrize(("schedule", "stages_per_rank"), [("1F1B", 1), ("GPipe", 1), ("Interleaved1F1B", 2)])
def test_pipeline_on_one_gpu_with_nccl(schedule: str, stages_per_rank: int) -> None:
    (r,) = run_world(_gpu_gradients_run, 1, schedule, stages_per_rank, backend="nccl", timeout_s=180)
    assert r["backend"] == "nccl" and r["param_devices"] == ["cuda:0"]
    assert abs(r["loss"] - r["ref_loss"]) < 1e-4
    assert all(d < 1e-4 for d in r["grad_diff"].values()), r["grad_diff"]


@pytest.mark.distributed
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (NCCL allows one rank per GPU)")
@pytest.mark.parametrize(("schedule", "stages_per_rank"), [("1F1B", 1), ("Interleaved1F1B", 2)])
def test_pipeline_on_two_gpus_with_nccl(schedule: str, stages_per_rank: int) -> None:
    results = run_world(_gpu_gradients_run, 2, schedule, stages_per_rank, backend="nccl", timeout_s=300)
    for rank, r in enumerate(results):
        assert r["backend"] == "nccl"
        assert r["param_devices"] == [f"cuda:{rank}"]
        assert all(d < 1e-4 for d in r["grad_diff"].values()), r["grad_diff"]
    losses = [r["loss"] for r in results if r["loss"] is not None]  # the rank holding the last stage
    assert losses and all(abs(x - results[0]["ref_loss"]) < 1e-4 for x in losses), losses
