"""A save that fails or dies on one rank leaves the previous checkpoint loadable; nothing loads a mixture.

(autopipe.runtime.checkpoint_files)
"""

from __future__ import annotations

import os

import pytest
import torch

from autopipe.errors import CheckpointError
from autopipe.runtime.checkpoint_files import (COMPLETE_MARK, PARTIAL_SUFFIX, PREVIOUS_SUFFIX, check_complete,
                                               checkpoint_to_read, load_into,
                                               save_replacing)

from _dist_utils import run_world
import _save_failure_workers as workers


def _saved(folder: str, value: float) -> None:
    save_replacing(lambda: {"w": torch.full((4,), value)}, folder, rank=0, world_size=1)


def _read(folder: str) -> torch.Tensor:
    state = {"w": torch.zeros(4)}
    load_into(state, checkpoint_to_read(folder)[0])
    return state["w"]


def test_a_save_replaces_the_previous_checkpoint_and_leaves_nothing_beside_it(tmp_path):
    folder = str(tmp_path / "ckpt")
    _saved(folder, 1.0)
    _saved(folder, 2.0)
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    assert torch.equal(_read(folder), torch.full((4,), 2.0))


def test_a_truncated_shard_is_refused_naming_the_file(tmp_path):
    folder = str(tmp_path / "ckpt")
    _saved(folder, 1.0)
    shard = next(f for f in os.listdir(folder) if f.endswith(".distcp"))
    with open(os.path.join(folder, shard), "r+b") as f:
        f.truncate(10)
    with pytest.raises(CheckpointError, match=rf"is incomplete: {shard} has 10 bytes where its index needs"):
        check_complete(folder)
    os.remove(os.path.join(folder, shard))
    with pytest.raises(CheckpointError, match=rf"{shard} is missing"):
        checkpoint_to_read(folder)


def test_a_save_cut_between_its_two_moves_reads_the_complete_folder(tmp_path):
    folder = str(tmp_path / "ckpt")
    _saved(folder, 1.0)
    os.replace(folder, folder + PREVIOUS_SUFFIX)  # the old one moved aside; the new one unfinished
    assert torch.equal(_read(folder), torch.full((4,), 1.0))
    _saved(folder + "-new", 2.0)
    os.replace(folder + "-new", folder + PARTIAL_SUFFIX)
    open(os.path.join(folder + PARTIAL_SUFFIX, COMPLETE_MARK), "w").close()  # every rank had written it
    assert torch.equal(_read(folder), torch.full((4,), 2.0))
    with pytest.raises(CheckpointError, match="does not exist"):
        checkpoint_to_read(str(tmp_path / "nothing"))


CASES = [(2, "raise"), (4, "raise"), (2, "die"), (4, "die")]


@pytest.mark.parametrize("world_size,how", CASES)
def test_a_save_broken_on_one_rank_leaves_the_old_checkpoint_loading_exactly(tmp_path, world_size, how):
    folder = str(tmp_path / "ckpt")
    broken = world_size - 1
    saved = run_world(workers.save_over, world_size, folder, how, broken, timeout_s=180, pg_timeout_s=15,
                      allow_errors=True)
    if how == "raise":  # every rank ends with autopipe's error, torch's cause named
        for status, result in saved:
            assert status == "ok" and result["outcome"].startswith("CheckpointError"), result
            assert "No space left on device (injected)" in result["outcome"]
    else:  # the dead rank is gone; the others end on the collective's timeout, not by hanging
        assert saved[broken][0] == "error"
    assert not os.path.exists(folder + PREVIOUS_SUFFIX)
    loaded = run_world(workers.load_back, world_size, folder, timeout_s=180)
    for result in loaded:
        for key, value in result["loaded"].items():
            assert torch.equal(value, result["seed1"][key]), key
        assert any(not torch.equal(v, result["seed2"][k]) for k, v in result["loaded"].items())
