"""Train the seed tutorial's Transformer with autopipe, under every pipeline schedule.

The tutorial autopipe grew from splits this model by hand (``split_spec={"layers.1":
SplitPoint.BEGINNING}``) and trains it with ``ScheduleGPipe``. Here the split comes from
autopipe's planner and the training loop is the tutorial's, changed in two lines::

    autopipe run examples/train_seed_transformer.py --nproc 2
    autopipe run examples/train_seed_transformer.py --nproc 2 --schedule 1F1B --steps 200

Without GPUs the two processes run on the CPU with gloo; with GPUs, one GPU each (NCCL).
Rank 0 prints each schedule's plan and its loss every 10 steps.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset

from autopipe.models.transformer import SeedTransformer
from autopipe.planning.options import PlannerOptions, ProfileOptions
from autopipe.runtime import Pipeline
from autopipe.planning.schedules import SCHEDULES

# The tutorial's sizes.
VOCAB_SIZE, D_MODEL, NUM_HEADS, D_FF, NUM_LAYERS, MAX_LEN = 100, 12, 4, 24, 2, 100
DATASET_SIZE, DATASET_LENGTH = 16, 10


class NLPDataset(Dataset):
    """The tutorial's data: sequence i is DATASET_LENGTH copies of token i."""

    def __init__(self, size: int, length: int) -> None:
        self.data = [torch.full((length,), i) for i in range(size)]

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, idx: int) -> torch.Tensor:
        return self.data[idx]


def compute_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(output.reshape(-1, VOCAB_SIZE), target.reshape(-1))


def train(schedule: str, args: argparse.Namespace) -> list[float]:
    torch.manual_seed(0)
    model = SeedTransformer(VOCAB_SIZE, d_model=D_MODEL, num_heads=NUM_HEADS, d_ff=D_FF,
                            num_layers=NUM_LAYERS, max_len=MAX_LEN, dropout=args.dropout)
    batch_size = args.microbatch_size * args.microbatches
    loader = DataLoader(NLPDataset(DATASET_SIZE, DATASET_LENGTH), batch_size=batch_size, drop_last=True)
    x_mb = torch.zeros((args.microbatch_size, DATASET_LENGTH - 1), dtype=torch.long)  # one micro-batch

    # Change 1 of 2: the pipeline replaces the hand split and the schedule object.
    pipe = Pipeline(model, example_args=(x_mb,), loss_fn=compute_loss, schedule=schedule,
                    n_microbatches=args.microbatches,
                    planner=PlannerOptions(profiling=ProfileOptions(progress=False), recompute=args.checkpoint))
    if pipe.rank == 0:
        print(f"\n== {schedule}: split at {pipe.plan.split_points}, "
              f"{pipe.num_stages} stages on {pipe.world_size} ranks", flush=True)
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=args.lr)

    losses: list[float] = []
    step = 0
    while step < args.steps:
        for data in loader:
            x, label = data[:, :-1], data[:, 1:]
            optimizer.zero_grad()
            # Change 2 of 2: every rank calls step() and gets the batch's mean loss.
            loss = pipe.step(x, target=label)
            optimizer.step()
            losses.append(loss.item())
            if pipe.rank == 0 and (step % 10 == 0 or step == args.steps - 1):
                print(f"{schedule:>22} step {step:3d}  loss {loss.item():.4f}", flush=True)
            step += 1
            if step == args.steps:
                break
    pipe.close()  # its process groups go now, not at interpreter exit
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--schedule", default="all", help=f"one of {list(SCHEDULES)} or 'all'")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--microbatch-size", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--checkpoint", action="store_true", help="activation checkpointing on every stage")
    args = parser.parse_args()

    schedules = list(SCHEDULES) if args.schedule == "all" else [args.schedule]
    # One process group for every pipeline below: the script creates it, so each pipeline's
    # close() leaves it alone, and the script destroys it at the end.
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    summary = {s: train(s, args) for s in schedules}
    if dist.get_rank() == 0:
        print("\nschedule                first loss  last loss")
        for s, losses in summary.items():
            print(f"{s:<22} {losses[0]:10.4f} {losses[-1]:10.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
