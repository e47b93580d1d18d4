"""What each rank runs in tests/test_checkpoint_files.py: a save over a good checkpoint that fails
or dies on one rank (spawned by tests/_dist_utils.run_world)."""

from __future__ import annotations

import os

import torch
import torch.distributed.checkpoint.filesystem as dcp_fs

from autopipe import Pipeline, PlannerOptions, ProfileOptions
from autopipe.models import seed_transformer

SPLITS = {2: ["layers.2"], 4: ["layers.1", "layers.2", "layers.3"]}


def _pipeline(world_size: int, seed: int) -> Pipeline:
    model, (x_mb,) = seed_transformer(vocab_size=30, d_model=8, num_heads=2, d_ff=16, num_layers=4, batch=2,
                                      seq_len=6)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(seed)
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    return Pipeline(model, example_args=(x_mb,), split_points=SPLITS[world_size], n_microbatches=world_size,
                    planner=PlannerOptions(profiling=ProfileOptions(progress=False)))


def _break_this_rank(how: str) -> None:
    """This rank's checkpoint writer writes part of its file, then raises or dies."""
    original = dcp_fs.FileSystemWriter.write_data

    def write_data(self, plan, planner):
        os.makedirs(self.path, exist_ok=True)
        with open(os.path.join(self.path, "__partial_rank_file.distcp"), "wb") as f:
            f.write(b"\0" * 100)
        if how == "die":
            os._exit(3)
        raise OSError(28, "No space left on device (injected)")

    dcp_fs.FileSystemWriter.write_data = write_data
    del original


def save_over(rank: int, world_size: int, folder: str, how: str, broken_rank: int) -> dict:
    """Save seed 1's weights, then try seed 2's with one rank broken; report what each rank saw."""
    with _pipeline(world_size, seed=1) as first:
        first.save_checkpoint(folder)
        good = {k: v.clone() for k, v in first.state_dict().items()}
    with _pipeline(world_size, seed=2) as second:
        if rank == broken_rank:
            _break_this_rank(how)
        try:
            second.save_checkpoint(folder)
            outcome = "saved"
        except Exception as e:  # noqa: BLE001 - the test reads it
            outcome = f"{type(e).__name__}: {e}"
    return {"outcome": outcome, "good": good}


def load_back(rank: int, world_size: int, folder: str) -> dict:
    """A pipeline of seed 3 loads ``folder``: its state afterwards, and the seed-1 and seed-2 states."""
    with _pipeline(world_size, seed=1) as one:
        seed1 = one.state_dict()
    with _pipeline(world_size, seed=2) as two:
        seed2 = two.state_dict()
    with _pipeline(world_size, seed=3) as three:
        three.load_checkpoint(folder)
        loaded = three.state_dict()
    return {"loaded": loaded, "seed1": seed1, "seed2": seed2}
