"""What each rank runs in tests/test_agreement.py: ranks given different arguments, and a weight file one
rank finds corrupt. Each must end on every rank with a clear error, not wait for the collective timeout."""

from __future__ import annotations

import torch

import autopipe
from autopipe.runtime import Pipeline

from _materialize_workers import seed_model
from _runtime_workers import N_MICROBATCHES, SPLITS, example_args, loss_fn
from _tuning_workers import _model, mse


def _outcome(call) -> str:
    try:
        with call():
            pass
        return "built"
    except Exception as e:  # noqa: BLE001 - the error each rank raises is the result
        return f"{type(e).__name__}: {e}"


def tune_with_other_counts(rank: int, world_size: int, what: str) -> str:
    """Rank 1 asks tune() for one more candidate (or round) than rank 0."""
    model = _model()
    x, y = torch.randn(8, 16, generator=torch.Generator().manual_seed(1)), torch.randn(8, 4)
    plan = autopipe.partition(model, world_size, (x[:2],), n_microbatches=N_MICROBATCHES,
                              planner=autopipe.PlannerOptions(cost="flops"))
    counts = {"candidates": 2, "rounds": 1}
    counts[what] += rank
    return _outcome(lambda: autopipe.tune(model, x, target=y, plan=plan, loss_fn=mse, example_args=(x[:2],),
                                          **counts))


def pipeline_with_other_examples(rank: int, world_size: int) -> str:
    """Rank 1's example micro-batch has one row more than rank 0's."""
    x = example_args()[0]
    x = torch.cat([x, x[:1]]) if rank == 1 else x
    return _outcome(lambda: Pipeline(seed_model(meta=False), example_args=(x,), loss_fn=loss_fn,
                                     split_points=SPLITS[2], n_microbatches=N_MICROBATCHES))


def weights_one_rank_finds_corrupt(rank: int, world_size: int, folder: str) -> str:
    """A meta-device model read from a DCP folder whose only damaged tensor is one rank 1's stage reads."""
    return _outcome(lambda: Pipeline(seed_model(meta=True), example_args=example_args(), loss_fn=loss_fn,
                                     split_points=SPLITS[2], n_microbatches=N_MICROBATCHES, weights=folder))




def too_few_ranks_per_pipeline(rank: int, world_size: int) -> str:
    """data_parallel=2 on 2 ranks leaves one rank per pipeline, and the plan has two stages."""
    model = seed_model(meta=False)
    plan = autopipe.partition(model, 2, example_args(), n_microbatches=N_MICROBATCHES,
                              planner=autopipe.PlannerOptions(cost="flops"))
    return _outcome(lambda: Pipeline(model, example_args=example_args(), loss_fn=loss_fn, plan=plan,
                                     data_parallel=2))
