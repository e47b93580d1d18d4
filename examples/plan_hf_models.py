"""Plan small Hugging Face models (GPT-2, tied and untied, and Llama) for 2 and 4 GPUs.

The models are built from a small config (nothing is downloaded) by
:mod:`autopipe.models.hf`, which keeps Hugging Face's module names, so the plans cut at
``transformer.h.2`` or ``model.layers.3`` as a person would write them. For each plan the
script prints the report, then builds the stages with
``torch.distributed.pipelining.pipeline`` using the plan's ``split_spec`` and checks that
they compute what the whole model computes.

Things to look for in the reports: GPT-2's embedding and head share one weight when tied,
so a plan that separates them holds that weight twice; the vocabulary projection
``lm_head`` is the heaviest single piece; a cut between blocks carries the hidden states
and the causal mask (and, for Llama, the rotary cos/sin tables) to the next stage.

Run (needs ``pip install transformers``; CPU is fine)::

    python examples/plan_hf_models.py
    python examples/plan_hf_models.py --models llama --gpus 2 4 8
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

from autopipe.models import hf

sys.path.insert(0, str(Path(__file__).parent))
from plan_seed_transformer import plan_and_check  # noqa: E402  (same check for every model)

MODELS = {
    "gpt2_tied": lambda: hf.gpt2_from_config(tie_word_embeddings=True),
    "gpt2_untied": lambda: hf.gpt2_from_config(tie_word_embeddings=False),
    "llama": lambda: hf.llama_from_config(),
}

# torch 2.13's pipeline() trips a deprecation inside its own pytree code; not ours to fix.
warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=list(MODELS))
    parser.add_argument("--gpus", type=int, nargs="+", default=[2, 4], help="pipeline sizes to plan for")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per measured piece")
    opts = parser.parse_args(argv)
    if not hf.HF_AVAILABLE:
        sys.exit("This example needs Hugging Face transformers: pip install transformers")

    for name in opts.models:
        model, args = MODELS[name]()
        params = sum(p.numel() for p in model.parameters())  # tied weights count once
        for n_gpus in opts.gpus:
            print(f"=== {name} ({params / 1e6:.2f} M parameters) on {n_gpus} GPUs ===")
            plan_and_check(model, args, n_gpus, repeats=opts.repeats)


if __name__ == "__main__":
    main()
