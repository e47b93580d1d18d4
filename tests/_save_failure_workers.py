"""What each rank runs in tests/test_checkpoint_files.py: a save over a good checkpoint that fails
or dies on one rank (spawned by tests/_dist_utils.run_world)."""

from __future__ import annotations

import os

import torch
import torch.distributed.checkpoint.filesystem as dcp_fs

from autopipe import Pipeline, PlannerOptions, ProfileOptions
from autopipe.models import seed_transformer

SPLITS = {2: ["layers.2"], 4: ["layers.1", "layers.2", "layers.3"]}


def _model(seed: int) -> tuple[torch.nn.Module, torch.Tensor]:
    """The seed Transformer with every parameter drawn from ``seed``, and one micro-batch."""
    model, (x_mb,) = seed_transformer(vocab_size=30, d_model=8, num_heads=2, d_ff=16, num_layers=4, batch=2,
                                      seq_len=6)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(seed)
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    return model, x_mb


def _pipeline(world_size: int, seed: int) -> Pipeline:
    model, x_mb = _model(seed)
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
    with _pipeline(world_size, seed=1) as pipe:
        pipe.save_checkpoint(folder)
        good = {k: v.clone() for k, v in pipe.state_dict().items()}
        pipe.load_state_dict(_model(seed=2)[0].state_dict())
        if rank == broken_rank:
            _break_this_rank(how)
        try:
            pipe.save_checkpoint(folder)
            outcome = "saved"
        except Exception as e:  # noqa: BLE001 - the test reads it
            outcome = f"{type(e).__name__}: {e}"
    return {"outcome": outcome, "good": good}


def load_back(rank: int, world_size: int, folder: str) -> dict:
    """A pipeline of seed 3 loads ``folder``: its state afterwards, and seed 1's and seed 2's of the same tensors."""
    with _pipeline(world_size, seed=3) as three:
        three.load_checkpoint(folder)
        loaded = three.state_dict()
    seeds = {f"seed{k}": {name: v for name, v in _model(k)[0].state_dict().items() if name in loaded} for k in (1, 2)}
    return {"loaded": loaded, **seeds}
