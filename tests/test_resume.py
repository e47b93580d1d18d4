"""The resume recipe of docs/training.md on a Hugging Face Llama, and checkpoints that do not fit
(CPU, gloo, 2 ranks; ``_resume_workers.py``)."""

from __future__ import annotations

import pytest

import _resume_workers as workers
from _dist_utils import run_world

pytest.importorskip("transformers")

TOL = 1e-5
PARAM_TOL = 1e-4  # after AdamW steps (see tests/test_tied.py)


@pytest.mark.distributed
@pytest.mark.parametrize("first, then", [("pp=2", "pp=4"), ("pp=4", "pp=2")])
def test_llama_resumed_from_a_checkpoint_trains_as_if_never_interrupted(tmp_path, first, then):
    for r in run_world(workers.resume_run, 2, first, then, str(tmp_path / "ckpt"), timeout_s=300):
        assert r["loss_diff"] < TOL and r["param_diff"] < PARAM_TOL, r


@pytest.mark.distributed
def test_checkpoints_and_weights_that_do_not_fit_are_refused_on_every_rank(tmp_path):
    rank0, rank1 = run_world(workers.misfit_run, 2, str(tmp_path / "ckpt"), timeout_s=300, pg_timeout_s=30)
    for r in (rank0, rank1):
        assert r["other_model"].startswith("KeyError") and "model.layers.3" in r["other_model"], r
        assert "another model's checkpoint" in r["other_model"]
        assert r["unchanged"]
        assert r["truncated"].startswith("CheckpointError") and "damaged or its save was cut short" in r["truncated"], r
        assert r["weights_unknown_name"].startswith("KeyError") and "model.layers.9" in r["weights_unknown_name"]
        assert r["weights_missing_name"].startswith("KeyError") and "model.norm.weight" in r["weights_missing_name"]
    assert rank1["one_rank_bad_shape"].startswith("ValueError: 'lm_head.weight' has shape (3, 3)"), rank1
    assert rank0["one_rank_bad_shape"].startswith("RuntimeError: rank 1 could not load the state dict"), rank0


@pytest.mark.distributed
def test_weights_holding_nan_are_loaded_as_given():
    results = run_world(workers.nan_weights_run, 2, timeout_s=300)
    assert [r["norm_is_nan"] for r in results] == [None, True]
