"""A real 2-rank pipeline on third-party models: one 1F1B step equals the unsplit model's.

For the representative subset of :data:`zoo.thirdparty.REGISTRY` (one model
of each family at least: a decoder LM given ``attention_mask`` as a keyword, an MoE LM,
an encoder, an encoder-decoder given ``decoder_input_ids`` as a keyword, a vision
transformer, a CNN with in-place ops and batch norm, a diffusion UNet with two inputs),
two gloo processes build an :class:`autopipe.Pipeline` cut at the entry's
``pipeline_split`` and take one 1F1B step of 4 micro-batches; each rank compares the loss
and the gradients of the parameters it holds with the unsplit model's, computed in the
same process (:func:`zoo.thirdparty_checks.pipeline_step_vs_unsplit`).
"""

from __future__ import annotations

import functools

import pytest
from _dist_utils import run_world

from zoo.thirdparty import REGISTRY, get, package_missing
from zoo.thirdparty_checks import TOLERANCE, pipeline_steps_vs_unsplit, summarize_ranks

SUBSET = [name for name, entry in REGISTRY.items() if entry.pipeline_split and entry.unsupported is None]


@functools.lru_cache(maxsize=None)
def _subset_results() -> dict:
    """Every subset model's step in one 2-rank world (process start-up dominates a tiny model's step)."""
    names = [n for n in SUBSET if package_missing(get(n).package) is None]
    ranks = run_world(pipeline_steps_vs_unsplit, 2, names, timeout_s=120 + 60 * len(names))
    return {name: [r[name] for r in ranks] for name in names}


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("name", SUBSET)
def test_a_1f1b_step_gives_the_unsplit_models_loss_and_gradients(name):
    results = _subset_results()[name]
    errors = [r["error"] for r in results if "error" in r]
    assert not errors, f"{name}: {errors[0]}"
    summary = summarize_ranks(results)
    assert not summary["missing"], f"no rank holds {summary['missing']}"
    assert summary["max_loss_diff"] <= TOLERANCE
    assert summary["max_grad_diff"] <= TOLERANCE, f"worst gradient: {summary['worst_param']}"
