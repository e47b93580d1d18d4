"""What each rank runs in the tensor-parallel tests (spawned by tests/_dist_utils.run_world).

``autopipe.Pipeline`` with ``DataParallelOptions(tensor_parallel=2)`` steps, evaluates, saves and
resumes; the unsplit model, run in the same process on the same batch, is the reference.
"""

from __future__ import annotations

import contextlib
import copy

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from autopipe import DataParallelOptions, PlannerOptions
from autopipe.errors import PipelineStepError
from autopipe.models import seed_transformer
from autopipe.runtime.checkpointing import block_names
from autopipe.runtime.tensor_parallel import CollectiveCount


class _Logits(nn.Module):
    """A Hugging Face causal LM returning its logits alone."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, use_cache=False).logits


class _FusedBlock(nn.Module):
    """A pre-norm block whose q, k and v come from one ``nn.Linear``, split along its features."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads, self.norm1, self.norm2 = heads, nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.out = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.up, self.down = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, width = x.shape
        q, k, v = (p.view(b, t, self.heads, -1).transpose(1, 2)
                   for p in self.qkv(self.norm1(x)).split(width, dim=-1))
        a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(a.transpose(1, 2).reshape(b, t, width))
        return x + self.down(torch.relu(self.up(self.norm2(x))))


class _FusedLM(nn.Module):
    def __init__(self, layers: int, width: int = 64, heads: int = 4, vocab: int = 128) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(vocab, width), nn.Linear(width, vocab)
        self.blocks = nn.ModuleList(_FusedBlock(width, heads) for _ in range(layers))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _model(name: str, layers: int = 2) -> tuple[nn.Module, tuple]:
    if name == "seed_transformer":
        return seed_transformer(128, d_model=64, d_ff=128, num_layers=layers, batch=2, seq_len=16)
    if name == "qwen2":  # biases on the query, key and value projections
        import transformers

        config = transformers.Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                          num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                          max_position_embeddings=32)
        with torch.random.fork_rng(devices=[]):  # the rank's own RNG is left as it was
            torch.manual_seed(0)
            return _Logits(transformers.AutoModelForCausalLM.from_config(config)), (torch.randint(0, 128, (2, 16)),)
    if name == "fused":  # q, k and v in one nn.Linear
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            return _FusedLM(layers), (torch.randint(0, 128, (2, 16)),)
    if name == "gpt2":  # q, k and v fused in one Conv1D, a matrix stored (in, out); tied embedding and head
        from zoo.hf import gpt2_from_config

        return gpt2_from_config(n_layer=layers, n_embd=64, n_head=4, vocab_size=128, seq_len=16)
    from zoo.hf import llama_from_config  # grouped-query attention: 4 query heads, 2 key-value heads
    return llama_from_config(num_hidden_layers=layers, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                             vocab_size=128, seq_len=16)


def _loss(out) -> torch.Tensor:
    return (out[0] if isinstance(out, tuple) else out).float().pow(2).mean()


def _split_points(model: nn.Module, stages: int) -> list[str]:
    """Cut before blocks 1 .. stages - 1 of the model's blocks (``checkpointing.block_names``)."""
    return block_names(model)[1:stages]


def _short_step(pipe, model: nn.Module, batch: torch.Tensor, target: torch.Tensor, loss_of) -> dict:
    """A step at another sequence length: its loss and worst gradient against ``model``'s (unstepped)."""
    pipe.zero_grad()
    loss = pipe.step(batch, target=target).item()
    rows = len(batch) // pipe.n_microbatches
    expected = sum(loss_of(model(batch[i * rows:(i + 1) * rows]), target[i * rows:(i + 1) * rows])
                   for i in range(pipe.n_microbatches)) / pipe.n_microbatches
    expected.backward()
    whole = dict(model.named_parameters())
    return {"loss": loss, "expected": expected.item(), "worst_grad": max(
        (data_full(p.grad) - whole[n].grad).abs().max().item() for n, p in pipe.named_parameters())}


def pipe_cases(rank: int, world_size: int, cases: dict[str, tuple]) -> dict:
    """:func:`pipe_run` of each case, ``{key: (model, schedule, dp, recompute, autocast, short, vocab, sequence)}``."""
    return {key: pipe_run(rank, world_size, *case) for key, case in cases.items()}


def _cross_entropy(out, target: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy over the vocabulary: under ``loss_parallel`` it reads sharded logits."""
    logits = out[0] if isinstance(out, tuple) else out
    return nn.functional.cross_entropy(logits.flatten(0, 1).float(), target.flatten())


def pipe_run(rank: int, world_size: int, name: str, schedule: str, dp: int = 1, checkpoint: str = "none",
             autocast: bool = False, short: bool = False, vocab: bool = False, sequence: bool = False) -> dict:
    """One step of a ``tensor_parallel=2`` ``autopipe.Pipeline`` on pp x dp x tp ranks (FSDP over dp) against
    the unsplit model on the same batch: the loss, every gradient (gathered), the clipped norm. Under
    ``autocast`` both run in bf16, and each is also compared with the unsplit model in fp32. With
    ``short``, a second step at half the sequence length (the stages traced again, sharded over the
    same parameters), against the unsplit model too. With ``vocab``, the output layer is sharded along
    the vocabulary too (``loss_parallel``) and the loss is a cross-entropy of the next tokens; with
    ``sequence``, sequence parallel."""
    import autopipe
    from autopipe.runtime import Pipeline

    model, args = _model(name, layers=4)
    reference, exact = copy.deepcopy(model), copy.deepcopy(model)
    stages_per_rank = 1 if schedule in ("GPipe", "1F1B") else 2
    pp = world_size // (2 * dp)
    n_micro = 2 * pp
    g = torch.Generator().manual_seed(7)
    batch = torch.randint(0, 128, (n_micro * dp * args[0].shape[0], args[0].shape[1]), generator=g)
    target = torch.roll(batch, -1, dims=1) if vocab else torch.zeros(len(batch))
    loss_of = _cross_entropy if vocab else (lambda out, y: _loss(out))
    with Pipeline(model, example_args=args, loss_fn=loss_of, schedule=schedule,
                  split_points=_split_points(model, pp * stages_per_rank), n_microbatches=n_micro,
                  data_parallel=DataParallelOptions(degree=dp if dp > 1 else None, batch="global", tensor_parallel=2,
                                                    loss_parallel=vocab, sequence_parallel=sequence),
                  planner=autopipe.PlannerOptions(recompute=checkpoint if checkpoint != "none" else "auto",
                                                  mixed_precision="bf16" if autocast else None)) as pipe:
        failed = None
        if vocab:  # a loss_fn that raises on sharded logits is played through to an error on every rank
            try:
                pipe.step(batch, target=target[:, :1])
            except PipelineStepError as e:
                failed = str(e)
            pipe.zero_grad()
        with CollectiveCount() as collectives:
            loss = pipe.step(batch, target=target)
        norm = pipe.clip_grad_norm_(1e9)
        grads = {n: data_full(p.grad) for n, p in pipe.named_parameters() if p.grad is not None}
        found = {"without_grad": [n for n, p in pipe.named_parameters() if p.grad is None],
                 "sharded": sorted(n for n, p in pipe.named_parameters() if isinstance(p, DTensor)),
                 "checkpointed": sorted(n for m in pipe.stage_modules.values() for n, sub in m.named_modules()
                                        if getattr(sub.forward, "__name__", "") == "checkpointed_forward"),
                 "nodes": pipe.rank_nodes, "place": (pipe.pp_rank, pipe.dp_rank, pipe.tp_rank),
                 "collectives": collectives.counts, "blocks": len(set(block_names(model)).intersection(
                     n for m in pipe.stage_modules.values() for n, _ in m.named_modules())),
                 "n_microbatches": pipe.n_microbatches,
                 "local_shapes": {n: (tuple(p.to_local().shape), tuple(p.shape)) for n, p in pipe.named_parameters()
                                  if isinstance(p, DTensor)},
                 "replicated_whole": sorted(n for n, p in pipe.named_parameters() if isinstance(p, DTensor)
                                            and all(q.is_replicate() for q in p.placements[-1:]) and "norm" in n),
                 "strided": sorted(n for n, p in pipe.named_parameters() if isinstance(p, DTensor)
                                   and any(type(q).__name__ == "_StridedShard" for q in p.placements))}
        found["failed_step"] = failed
        if vocab:  # the whole logits, gathered from the shards, on the last stage's ranks
            pipe.eval()
            logits = pipe(batch)
            pipe.train()
            found["forward_worst"] = None if logits is None else (logits - exact(batch)).abs().max().item()
        if short:
            half = batch.shape[1] // 2
            found["short"] = _short_step(pipe, copy.deepcopy(exact), batch[:, :half],
                                         target[:, :half] if vocab else target, loss_of)
    rows = len(batch) // (n_micro * dp)
    precision = torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast)
    for copy_, context in ((reference, precision), (exact, contextlib.nullcontext())):
        with context:
            expected = sum(loss_of(copy_(batch[i * rows:(i + 1) * rows]), target[i * rows:(i + 1) * rows])
                           for i in range(n_micro * dp)) / (n_micro * dp)
        expected.backward()
        if copy_ is reference:
            expected_loss = expected.item()
    ref = dict(reference.named_parameters())
    scale = max(p.grad.abs().max().item() for p in exact.parameters())
    exact_grads = dict(exact.named_parameters())
    return {"loss": loss.item(), "expected_loss": expected_loss, "grads": sorted(grads), "model_params": sorted(ref),
            "worst_grad": max((g - ref[n].grad).abs().max().item() for n, g in grads.items()),
            "sharded_from_fp32": max((g - exact_grads[n].grad).abs().max().item() for n, g in grads.items()) / scale,
            "unsplit_from_fp32": max((p.grad - exact_grads[n].grad).abs().max().item() for n, p in ref.items()) / scale,
            "norm": float(norm), "expected_norm": torch.linalg.vector_norm(
                torch.stack([p.grad.norm() for p in reference.parameters()])).item(), **found}


class _Normed(nn.Module):
    """Blocks of a linear then a layer norm: the norm needs every feature, so no linear can be sharded."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8)) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def refusals(rank: int, world_size: int) -> dict:
    """What a ``tensor_parallel`` Pipeline says, on every rank, to a degree that does not divide the world,
    a model with nothing to shard, and heads that do not divide."""
    from autopipe.runtime import Pipeline

    def error(model: nn.Module, args: tuple, tp: int, schedule: str = "1F1B", recompute: str = "auto",
              loss_parallel: bool = False) -> str:
        stages = 2 if schedule == "1F1B" else 4
        try:
            Pipeline(model, example_args=args, loss_fn=lambda out, y: _loss(out),
                     data_parallel=DataParallelOptions(tensor_parallel=tp, loss_parallel=loss_parallel),
                     planner=PlannerOptions(recompute=recompute),
                     split_points=_split_points(model, stages), schedule=schedule, n_microbatches=4).close()
        except ValueError as e:
            return str(e)
        return "built"

    found = {}
    if name_imports("transformers"):  # GPT-2's output layer is its input embedding
        found["tied_head"] = error(*_model("gpt2"), 2, loss_parallel=True)
    return {**found, "degree": error(*_model("seed_transformer"), 3),
            "selective_split_backward": error(*_model("seed_transformer", layers=4), 2, "ZBVZeroBubble", "selective"),
            "nothing": error(_Normed(), (torch.randn(2, 8),), 2),
            "heads": error(*seed_transformer(128, d_model=48, num_heads=3, d_ff=96, num_layers=2, seq_len=8), 2)}


def name_imports(module: str) -> bool:
    try:
        __import__(module)
    except ImportError:
        return False
    return True


def data_full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def resume_run(rank: int, world_size: int, name: str, checkpoint_dir: str, sequence: bool = False) -> dict:
    """AdamW steps of a pp 2 x tp 2 pipeline (``sequence``: sequence parallel), saved after the first; a
    pp 4 pipeline (no tensor parallelism) resumes from the checkpoint, model and optimizer, and takes
    the second step too."""
    from autopipe.runtime import Pipeline

    model, args = _model(name, layers=4)
    g = torch.Generator().manual_seed(11)
    batches = [(torch.randint(0, 128, (4 * args[0].shape[0], args[0].shape[1]), generator=g),) for _ in range(2)]
    target = torch.zeros(batches[0][0].shape[0])

    def build(stages: int, tp: int | None) -> tuple[Pipeline, torch.optim.Optimizer]:
        pipe = Pipeline(copy.deepcopy(model), example_args=args, loss_fn=lambda out, y: _loss(out),
                        split_points=_split_points(model, stages), schedule="1F1B", n_microbatches=4,
                        data_parallel=DataParallelOptions(tensor_parallel=tp, sequence_parallel=sequence and tp is not None))
        return pipe, torch.optim.AdamW(pipe.parameters(), lr=1e-3)

    def step(pipe: Pipeline, optimizer: torch.optim.Optimizer, batch: tuple) -> float:
        optimizer.zero_grad()
        loss = pipe.step(*batch, target=target)
        optimizer.step()
        return loss.item()

    sharded, sharded_opt = build(2, 2)
    first = step(sharded, sharded_opt, batches[0])
    saved = sharded.state_dict(full=True)
    sharded.save_checkpoint(checkpoint_dir, sharded_opt)
    second = step(sharded, sharded_opt, batches[1])
    after = sharded.state_dict(full=True)
    sharded.close()
    resumed, resumed_opt = build(4, None)
    resumed.load_checkpoint(checkpoint_dir, resumed_opt)
    resumed_second = step(resumed, resumed_opt, batches[1])
    resumed_after = resumed.state_dict(full=True)
    resumed.close()
    return {"first": first, "second": second, "resumed_second": resumed_second, "saved": saved if rank == 0 else None,
            "worst_after": max((after[k] - resumed_after[k]).abs().max().item() for k in after)}


def eval_run(rank: int, world_size: int) -> dict:
    """A pp 2 x tp 2 pipeline of a model with dropout in eval mode: its eval-mode trace (another one)
    is sharded too; forwards at the traced length and at half of it against the unsplit model."""
    from autopipe.runtime import Pipeline

    model, args = seed_transformer(128, d_model=64, d_ff=128, num_layers=2, batch=2, seq_len=16, dropout=0.1)
    g = torch.Generator().manual_seed(5)
    out = {}
    with Pipeline(copy.deepcopy(model), example_args=args, loss_fn=lambda out, y: _loss(out),
                  split_points=["layers.1"], schedule="1F1B", n_microbatches=2,
                  data_parallel=DataParallelOptions(tensor_parallel=2)) as pipe:
        pipe.eval()
        model.eval()
        for key, length in (("traced", 16), ("short", 8)):
            tokens = torch.randint(0, 128, (4, length), generator=g)
            got = pipe(tokens)
            if got is not None:  # the last stage's ranks
                out[f"{key}_worst"] = (got - model(tokens)).abs().max().item()
    return out
