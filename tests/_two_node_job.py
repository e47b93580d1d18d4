"""The training script each rank of the two-node test runs (under ``torchrun``, tests/test_two_nodes.py).

A pp 2 x tp 2 ``autopipe.Pipeline`` of the seed Transformer takes one step; each rank writes its
host name, its place, the step's loss and gradients against the unsplit model's to ``OUT/rank<r>.json``.
Then it keeps stepping until its job is ended (the test kills the other node's agent).
"""

from __future__ import annotations

import copy
import json
import os
import socket
import sys

import torch

from autopipe import DataParallelOptions
from autopipe.models import seed_transformer
from autopipe.runtime import Pipeline


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return out.float().pow(2).mean()


def main(out_dir: str) -> None:
    torch.manual_seed(0)
    model, args = seed_transformer(128, d_model=64, d_ff=128, num_layers=2, batch=2, seq_len=16)
    reference = copy.deepcopy(model)
    batch = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(3))
    target = torch.zeros(len(batch))
    pipe = Pipeline(model, example_args=args, loss_fn=_loss, split_points=["layers.1"], schedule="1F1B",
                    n_microbatches=2, data_parallel=DataParallelOptions(tensor_parallel=2), timeout_s=60)
    loss = pipe.step(batch, target=target)
    grads = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad) for n, p in pipe.named_parameters()}
    expected = (_loss(reference(batch[:2]), None) + _loss(reference(batch[2:]), None)) / 2
    expected.backward()
    whole = dict(reference.named_parameters())
    report = {"rank": pipe.rank, "host": socket.gethostname(), "nodes": pipe.rank_nodes, "repr": repr(pipe),
              "local_world_size": int(os.environ["LOCAL_WORLD_SIZE"]), "loss": loss.item(),
              "expected_loss": expected.item(),
              "worst_grad": max((g - whole[n].grad).abs().max().item() for n, g in grads.items())}
    with open(os.path.join(out_dir, f"rank{pipe.rank}.json"), "w") as f:
        json.dump(report, f)
    while True:  # until the job ends: the other node goes away mid-step
        pipe.zero_grad()
        pipe.step(batch, target=target)


if __name__ == "__main__":
    main(sys.argv[1])
