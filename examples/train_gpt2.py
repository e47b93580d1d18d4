"""Train a small GPT-2, built from a config (nothing downloaded), on 2 pipeline ranks.

GPT-2 ties its output head to its token embedding, so the first and last stage each hold a
copy of that matrix; autopipe sums their gradients every step so the copies stay equal.
The causal mask is computed once and read by every block; autopipe relays it from stage
to stage. The split comes from autopipe's planner, measured on rank 0 and broadcast::

    autopipe run examples/train_gpt2.py --nproc 2
    autopipe run examples/train_gpt2.py --nproc 2 --schedule Interleaved1F1B --steps 100
    autopipe run examples/train_gpt2.py --nproc 2 --save gpt2.pt   # full checkpoint on rank 0

The data is synthetic and learnable: each sequence counts up from a random token
(modulo the vocabulary), so the loss falls quickly towards zero.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn as nn

from transformers import GPT2Config, GPT2LMHeadModel

from autopipe import Pipeline, PlannerOptions, ProfileOptions


class GPT2Logits(GPT2LMHeadModel):
    """GPT-2 whose forward takes token ids and returns the logits (no KV cache): one tensor out."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return super().forward(input_ids=input_ids, use_cache=False).logits


def counting_batch(batch: int, seq_len: int, vocab: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences start, start+1, ... (mod vocab); the target is the next token."""
    start = torch.randint(0, vocab, (batch, 1), generator=generator)
    tokens = (start + torch.arange(seq_len + 1)) % vocab
    return tokens[:, :-1], tokens[:, 1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--schedule", default="1F1B")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--microbatch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--checkpoint", action="store_true", help="activation checkpointing on every stage")
    parser.add_argument("--save", default=None, help="write the full state_dict here (rank 0)")
    args = parser.parse_args()

    torch.manual_seed(0)  # the same initial weights on every rank
    model = GPT2Logits(GPT2Config(n_layer=args.layers, n_embd=args.width, n_head=4, vocab_size=args.vocab,
                                  n_positions=max(64, args.seq_len), resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    x_mb = torch.randint(0, args.vocab, (args.microbatch_size, args.seq_len))

    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(logits.reshape(-1, args.vocab), target.reshape(-1))

    pipe = Pipeline(model, example_args=(x_mb,), loss_fn=loss_fn, schedule=args.schedule,
                    n_microbatches=args.microbatches,
                    planner=PlannerOptions(profiling=ProfileOptions(progress=False), recompute=args.checkpoint))
    if pipe.rank == 0:
        print(pipe, flush=True)
        tied = [n for n, _ in pipe.named_parameters() if n == "transformer.wte.weight"]
        print(f"rank 0 holds {sum(p.numel() for p in pipe.parameters()):,} parameters; tied embedding: {tied}")
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=args.lr)

    generator = torch.Generator().manual_seed(0)  # same data on every rank
    for step in range(args.steps):
        x, y = counting_batch(args.microbatch_size * args.microbatches, args.seq_len, args.vocab, generator)
        optimizer.zero_grad()
        loss = pipe.step(x, target=y)
        optimizer.step()
        if pipe.rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            print(f"step {step:4d}  loss {loss.item():.4f}", flush=True)

    pipe.eval()
    x, y = counting_batch(args.microbatch_size * args.microbatches, args.seq_len, args.vocab, generator)
    val_loss = pipe.evaluate(x, target=y)
    full = pipe.state_dict(full=True)  # collective: every rank calls it
    if pipe.rank == 0:
        print(f"eval loss {val_loss.item():.4f}")
        if args.save:
            torch.save(full, args.save)
            print(f"saved {len(full)} tensors to {args.save}; load with model.load_state_dict(torch.load(...))")
    # Releases the pipeline's process groups, and the default one it created, before the
    # interpreter shuts down (gloo's threads must not outlive it).
    pipe.close()


if __name__ == "__main__":
    main()
