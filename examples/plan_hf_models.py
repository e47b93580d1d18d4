"""Plan small Hugging Face models (GPT-2, tied and untied, and Llama) for 2 and 4 GPUs.

The models are built from a small config (nothing is downloaded) with Hugging Face's own
classes, whose forward returns the logits alone, so the plans cut at ``transformer.h.2``
or ``model.layers.3`` as a person would write them. For each plan the
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
import importlib.util
import sys
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from plan_seed_transformer import plan_and_check  # noqa: E402  (same check for every model)


def causal_lm(class_name: str, config_name: str, **config: Any) -> tuple[torch.nn.Module, tuple[torch.Tensor]]:
    """A randomly initialised transformers causal LM whose forward maps token ids to logits, and a micro-batch."""
    import transformers

    base = getattr(transformers, class_name)

    class LogitsOnly(base):  # type: ignore[misc, valid-type]
        def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
            return super().forward(input_ids=input_ids, use_cache=False).logits

    torch.manual_seed(0)
    model = LogitsOnly(getattr(transformers, config_name)(vocab_size=2000, **config))
    return model, (torch.randint(0, 2000, (2, 32)),)


GPT2 = dict(n_layer=4, n_embd=128, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
            eos_token_id=0)
MODELS = {
    "gpt2_tied": lambda: causal_lm("GPT2LMHeadModel", "GPT2Config", tie_word_embeddings=True, **GPT2),
    "gpt2_untied": lambda: causal_lm("GPT2LMHeadModel", "GPT2Config", tie_word_embeddings=False, **GPT2),
    "llama": lambda: causal_lm("LlamaForCausalLM", "LlamaConfig", num_hidden_layers=4, hidden_size=128,
                               intermediate_size=256, num_attention_heads=4, num_key_value_heads=4),
}

# torch 2.13's pipeline() trips a deprecation inside its own pytree code; not ours to fix.
warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=list(MODELS))
    parser.add_argument("--gpus", type=int, nargs="+", default=[2, 4], help="pipeline sizes to plan for")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per measured piece")
    opts = parser.parse_args(argv)
    if importlib.util.find_spec("transformers") is None:
        sys.exit("This example needs Hugging Face transformers: pip install transformers")

    for name in opts.models:
        model, args = MODELS[name]()
        params = sum(p.numel() for p in model.parameters())  # tied weights count once
        for n_gpus in opts.gpus:
            print(f"=== {name} ({params / 1e6:.2f} M parameters) on {n_gpus} GPUs ===")
            plan_and_check(model, args, n_gpus, repeats=opts.repeats)


if __name__ == "__main__":
    main()
