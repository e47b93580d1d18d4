"""The training loop of docs/training.md section 1 with the pipeline left open: no close(), no teardown.

Started by ``benchmarks/clean_exit/main.py`` through ``autopipe run loop.py --nproc 2``; a
run counts as clean when every rank exits with code 0. A hand split (``split_points``)
stands in for the planner to keep each run short; what happens at exit does not depend on
how the split was chosen.

``--without-exit-hooks`` takes autopipe's interpreter-exit hooks away again (the pipeline's
``close()`` and the destruction of the process group autopipe created), which is how every
run ended before they existed: for comparison.
"""

from __future__ import annotations

import argparse
import atexit

import torch
import torch.nn as nn

from autopipe.runtime import Pipeline
from autopipe.runtime import distributed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--without-exit-hooks", action="store_true")
    args = ap.parse_args()

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    x_mb = torch.zeros(2, 16)  # ONE micro-batch
    pipe = Pipeline(model, example_args=(x_mb,), loss_fn=nn.functional.mse_loss, split_points=["2"],
                    schedule="1F1B", n_microbatches=4)
    opt = torch.optim.AdamW(pipe.parameters())
    gen = torch.Generator().manual_seed(1)
    loader = [(torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)) for _ in range(args.steps)]
    for x, y in loader:
        opt.zero_grad()
        loss = pipe.step(x, target=y)
        opt.step()
    if pipe.rank == 0:
        print(f"last loss {loss.item():.4f}", flush=True)
    if args.without_exit_hooks:
        atexit.unregister(pipe._close_at_exit)
        atexit.unregister(distributed._destroy_created_group_at_exit)


if __name__ == "__main__":
    main()
