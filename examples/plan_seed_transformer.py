"""Plan the seed tutorial's Transformer for 2 and 4 GPUs, and check torch splits it there.

The tutorial autopipe grew from cut this model by hand with
``split_spec={"layers.1": SplitPoint.BEGINNING}``. Here ``autopipe.partition`` measures every
piece and chooses the cuts; with a 10,000-token vocabulary the output layer ``out_linear``
is the heaviest piece, which an equal-layer split ignores. For each plan the script prints
the report, then builds the stages with ``torch.distributed.pipelining.pipeline`` using the
plan's ``split_spec`` and checks that they compute what the whole model computes.

Run (CPU is fine; takes a few seconds)::

    python examples/plan_seed_transformer.py
    python examples/plan_seed_transformer.py --gpus 2 4 8 --vocab-size 30000
"""

from __future__ import annotations

import argparse
import copy
import warnings

import torch
from torch.distributed.pipelining import pipeline

import autopipe
from autopipe.models import seed_transformer

# torch 2.13's pipeline() trips a deprecation inside its own pytree code; not ours to fix.
warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)


def plan_and_check(model: torch.nn.Module, args: tuple, n_gpus: int, *, repeats: int = 5) -> autopipe.Plan:
    """Plans ``model`` for ``n_gpus``, prints the report, checks torch builds those stages."""
    plan = autopipe.partition(model, n_gpus=n_gpus, example_args=args,
                              planner=autopipe.PlannerOptions(profiling=autopipe.ProfileOptions(repeats=repeats, progress=False)))
    print(plan.report())
    pipe = pipeline(copy.deepcopy(model), args, split_spec=plan.split_spec)
    if pipe.num_stages != plan.num_stages:
        raise RuntimeError(f"plan has {plan.num_stages} stages but pipeline() built {pipe.num_stages}")
    with torch.no_grad():
        (staged,) = pipe(*args)  # the stages run one after another on this process
        torch.testing.assert_close(staged, model(*args), atol=1e-5, rtol=1e-5)
    print(f"pipeline() built {pipe.num_stages} stages at {plan.split_points}; their output matches.\n")
    return plan


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, nargs="+", default=[2, 4], help="pipeline sizes to plan for")
    parser.add_argument("--vocab-size", type=int, default=10000, help="tokens; sets the output layer's weight")
    parser.add_argument("--layers", type=int, default=4, help="Transformer blocks")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per measured piece")
    opts = parser.parse_args(argv)

    model, args = seed_transformer(opts.vocab_size, num_layers=opts.layers)
    for n_gpus in opts.gpus:
        print(f"=== seed Transformer (vocab {opts.vocab_size}, {opts.layers} blocks) on {n_gpus} GPUs ===")
        plan_and_check(model, args, n_gpus, repeats=opts.repeats)


if __name__ == "__main__":
    main()
