"""What each rank runs in tests/test_materialize.py (spawned by tests/_dist_utils.run_world).

A model built on the meta device becomes a Pipeline whose ranks each materialize their own
stages; the reference is the same model built for real in the same process, holding the
values the pipeline loads (or, for the default init, the values the pipeline gathers).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from autopipe.models.transformer import SeedTransformer
from autopipe.planning.options import PlannerOptions, ProfileOptions
from autopipe.runtime import Pipeline

from _runtime_workers import N_MICROBATCHES, SPLITS, against_reference, example_args, loss_fn, tutorial_batch

FLOPS = PlannerOptions(cost="flops", profiling=ProfileOptions(progress=False))
LLAMA = dict(num_hidden_layers=3, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
             batch=2, seq_len=8)


def seed_model(meta: bool, seed: int = 0, dropout: float = 0.0) -> SeedTransformer:
    torch.manual_seed(seed)
    with torch.device("meta" if meta else "cpu"):
        return SeedTransformer(100, d_model=12, num_heads=4, d_ff=24, num_layers=2, max_len=100, dropout=dropout)


def seed_init(model: nn.Module) -> None:
    """An init function (weights=): every reset_parameters, and the positional table computed again."""
    from autopipe.models.transformer import PositionalEncoding

    torch.manual_seed(7)
    for module in model.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    if not model.pos_encoding.pe.is_meta:
        model.pos_encoding.pe.copy_(PositionalEncoding(12, 100).pe)


def llama(meta: bool) -> tuple[nn.Module, tuple[torch.Tensor]]:
    from zoo.hf import llama_from_config

    with torch.device("meta" if meta else "cpu"):
        model, (x_mb,) = llama_from_config(**LLAMA)
    return model, (torch.zeros(x_mb.shape, dtype=x_mb.dtype),)


def llama_loss(out, y):
    logits = getattr(out, "logits", out)  # llama_from_config returns the logits themselves
    return nn.functional.cross_entropy(logits.reshape(-1, LLAMA["vocab_size"]), y.reshape(-1))


def _seed_case(weights, schedule: str, *, meta: bool = True, **options) -> dict:
    reference = seed_model(meta=False)
    pipe = Pipeline(seed_model(meta=meta, seed=5), example_args=example_args(), loss_fn=loss_fn, schedule=schedule,
                    n_microbatches=N_MICROBATCHES, weights=weights, **options)
    try:
        if weights is None or callable(weights):  # the values the init gave: the reference takes them
            reference.load_state_dict(pipe.state_dict(full=True))
        x, y = tutorial_batch(0)
        loss = pipe.step(x, target=y)
        return against_reference(pipe, reference, loss, loss_fn(reference(x), y))
    finally:
        pipe.close()


def _dropout_eval_case(weights) -> dict:
    """A model whose train and eval traces differ: the eval stages read the materialized tensors too."""
    reference = seed_model(meta=False, dropout=0.1)
    reference.load_state_dict(weights)
    reference.eval()
    with Pipeline(seed_model(meta=True, dropout=0.1), example_args=example_args(), loss_fn=loss_fn,
                  schedule="1F1B", split_points=SPLITS[2], n_microbatches=N_MICROBATCHES, weights=weights) as pipe:
        pipe.eval()
        x, y = tutorial_batch(0)
        return {"loss": pipe.evaluate(x, target=y).item(), "ref_loss": loss_fn(reference(x), y).item()}


def seed_run(rank: int, world_size: int, safetensors_path: str, dcp_dir: str) -> dict:
    """The seed Transformer from meta, loaded three ways, under a planned 1F1B and a hand-split V."""
    state = seed_model(meta=False).state_dict()
    return {
        "dict-1F1B-planned": _seed_case(state, "1F1B", planner=FLOPS),
        "dict-ZBV": _seed_case(state, "ZBVZeroBubble", split_points=SPLITS[4]),
        "safetensors-Interleaved": _seed_case(safetensors_path, "Interleaved1F1B", split_points=SPLITS[4]),
        "dcp-1F1B": _seed_case(dcp_dir, "1F1B", split_points=SPLITS[2]),
        "hook-1F1B": _seed_case(seed_init, "1F1B", split_points=SPLITS[2]),
        "real-model-dict": _seed_case(state, "1F1B", meta=False, split_points=SPLITS[2]),
        "dropout-eval": _dropout_eval_case(state),
    }


def unwritten_run(rank: int, world_size: int, folder: str) -> dict:
    """The default init leaves the positional table (computed in __init__, no reset_parameters) unwritten.

    The pipeline is built anyway; the first step, a full state dict and a checkpoint into
    ``folder`` refuse on every rank, and once the
    state dict is loaded (PyTorch's usual order: build, then load) it steps as the unsplit model.
    """
    reference = seed_model(meta=False)
    out: dict = {}
    with Pipeline(seed_model(meta=True), example_args=example_args(), loss_fn=loss_fn, schedule="1F1B",
                  n_microbatches=N_MICROBATCHES, split_points=SPLITS[2]) as pipe:
        x, y = tutorial_batch(0)
        try:
            pipe.step(x, target=y)
            out["first_step"] = "no error"
        except Exception as e:  # noqa: BLE001 - the error each rank raises is the result
            out["first_step"] = f"{type(e).__name__}: {e}"
        for what, save in (("full_state_dict", lambda: pipe.state_dict(full=True)),
                           ("save_checkpoint", lambda: pipe.save_checkpoint(folder))):
            try:
                save()
                out[what] = "no error"
            except Exception as e:  # noqa: BLE001 - the error each rank raises is the result
                out[what] = f"{type(e).__name__}: {e}"
        pipe.load_state_dict(reference.state_dict())
        pipe.zero_grad()
        out["after_load"] = against_reference(pipe, reference, pipe.step(x, target=y), loss_fn(reference(x), y))
    return out


def _llama_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    shape = (LLAMA["batch"] * N_MICROBATCHES, LLAMA["seq_len"])
    return torch.randint(0, LLAMA["vocab_size"], shape, generator=g), torch.randint(0, LLAMA["vocab_size"], shape,
                                                                                     generator=g)


def llama_run(rank: int, world_size: int) -> dict:
    """Hugging Face Llama from meta: loaded from a state dict (1F1B, ZBV), and the default init under two splits."""
    reference, _ = llama(meta=False)
    x, y = _llama_batch()
    results = {}
    for schedule, splits in (("1F1B", ["model.layers.1"]),
                             ("ZBVZeroBubble", ["model.layers.0", "model.layers.1", "model.layers.2"])):
        meta, example = llama(meta=True)
        with Pipeline(meta, example_args=example, loss_fn=llama_loss, schedule=schedule, split_points=splits,
                      n_microbatches=N_MICROBATCHES, weights=reference.state_dict()) as pipe:
            loss = pipe.step(x, target=y)
            reference.zero_grad()
            results[f"weights-{schedule}"] = against_reference(pipe, reference, loss, llama_loss(reference(x), y))
    states, losses = [], []
    for splits in (["model.layers.1"], ["model.layers.2.mlp"]):
        meta, example = llama(meta=True)
        with Pipeline(meta, example_args=example, loss_fn=llama_loss, schedule="1F1B", split_points=splits,
                      n_microbatches=N_MICROBATCHES) as pipe:
            states.append(pipe.state_dict(full=True))
            losses.append(pipe.step(x, target=y).item())
    # The unsplit model holding the gathered values (its rotary inv_freq computed by itself)
    # gives the same loss: the pipeline's non-persistent buffers were computed right.
    reference.load_state_dict(states[0])
    results["default"] = {
        "keys_equal": list(states[0]) == list(states[1]) == list(reference.state_dict()),
        "max_diff": max((states[0][k] - states[1][k]).abs().max().item() for k in states[0]),
        "losses": losses,
        "ref_loss": llama_loss(reference(x), y).item(),
        "finite": all(bool(torch.isfinite(t).all()) for t in states[0].values()),
    }
    return results
