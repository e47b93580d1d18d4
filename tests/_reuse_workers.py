"""What each rank runs in the tests of modules and weights used several times (tests/test_reuse.py).

:class:`ReuseLM` reads one embedding matrix three times (two look-ups on the first stage,
the output layer on the last) and calls one block at two places of the forward, so that
the cuts fall between the uses. The unsplit model, run in the same process on the same
batches, is the reference.
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn

from _dist_utils import token_batch
from autopipe.runtime import Pipeline
from autopipe import PlannerOptions

VOCAB = 16
D_MODEL = 8
MICROBATCH = 2
N_MICROBATCHES = 4
SEQ = 5

# case -> (schedule, stages_per_rank, split points, ranks)
CASES = {
    # stage 0: both look-ups and the block's first call; stage 1: its second call and the head.
    "1F1B": ("1F1B", 1, ["l2"], 2),
    # three stages on three ranks: the block on stages 0 and 1, the embedding on 0 and 2.
    "1F1B-3-stages": ("1F1B", 1, ["l1", "l3"], 3),
    # stages 0 and 2 on rank 0 call the block; the head is on stage 3 (rank 1).
    "Interleaved1F1B": ("Interleaved1F1B", 2, ["l1", "l2", "l3"], 2),
    # V placement: the block on stages 0 (rank 0) and 2 (rank 1); look-ups and head on rank 0.
    "ZBVZeroBubble": ("ZBVZeroBubble", 2, ["l1", "l2", "l3"], 2),
}


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D_MODEL, D_MODEL)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


class ReuseLM(nn.Module):
    """An embedding looked up twice and tied to the head; ``shared`` called before ``l1`` and after ``l2``."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D_MODEL)
        self.l0, self.l1, self.l2, self.l3 = (Block() for _ in range(4))
        self.shared = Block()
        self.head = nn.Linear(D_MODEL, VOCAB, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids) + 0.5 * self.emb(ids.flip(-1))
        h = self.shared(self.l0(h))
        h = self.l2(self.l1(h))
        h = self.l3(self.shared(h))
        return self.head(h)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return token_batch(step, rows=MICROBATCH * N_MICROBATCHES, seq=SEQ, vocab=VOCAB)


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(output.reshape(-1, VOCAB), target.reshape(-1))


def reuse_run(rank: int, world_size: int, case: str) -> dict:
    """3 AdamW steps of the pipeline and the unsplit model; then evaluate both ways."""
    schedule, per_rank, split_points, _ = CASES[case]
    torch.manual_seed(0)
    model = ReuseLM()
    reference = copy.deepcopy(model)
    pipe = Pipeline(model, example_args=(batch(0)[0][:MICROBATCH],), loss_fn=loss_fn, schedule=schedule,
                    split_points=split_points, n_microbatches=N_MICROBATCHES,
                    planner=PlannerOptions(stages_per_rank=per_rank))
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    ref_params = dict(reference.named_parameters())
    out: dict = {"loss_diff": [], "held": sorted(n for n, _ in pipe.named_parameters())}
    for step in range(3):
        x, y = batch(step)
        opt.zero_grad()
        ref_opt.zero_grad()
        loss = pipe.step(x, target=y)
        ref_loss = loss_fn(reference(x), y)
        ref_loss.backward()
        out["loss_diff"].append(abs(loss.item() - ref_loss.item()))
        if step == 0:
            out["grad_diff"] = {n: float("inf") if p.grad is None else (p.grad - ref_params[n].grad).abs().max().item()
                                for n, p in pipe.named_parameters()}
        opt.step()
        ref_opt.step()
    out["param_diff"] = {n: (p.detach() - ref_params[n].detach()).abs().max().item()
                         for n, p in pipe.named_parameters()}
    full = pipe.state_dict(full=True)
    out["full_keys"] = list(full)
    out["model_keys"] = list(reference.state_dict())
    rebuilt = ReuseLM()
    rebuilt.load_state_dict(full)
    x, y = batch(7)
    out["evaluate_diff"] = abs(pipe.evaluate(x, target=y).item() - loss_fn(rebuilt(x), y).item())
    out["rebuilt_diff"] = max((rebuilt.state_dict()[k] - v).abs().max().item()
                              for k, v in reference.state_dict().items())
    pipe.close()
    return out
