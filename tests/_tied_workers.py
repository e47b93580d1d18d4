"""What each rank runs in the tied-parameter tests (spawned by tests/_dist_utils.run_world).

The models tie one matrix several ways, as T5 does: ``shared.weight`` *is*
``encoder.embed_tokens.weight``, ``decoder.embed_tokens.weight`` and ``lm_head.weight``,
so a split can put two of its uses on one stage (the decoder's embedding and the head)
and its other use on another stage, rank or both. The unsplit model, run in the same
process on the same batch, is the reference every result is compared with.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from _dist_utils import token_batch
from autopipe.runtime import Pipeline
from autopipe import PlannerOptions

VOCAB = 32
D_MODEL = 16
MICROBATCH = 2
N_MICROBATCHES = 4
SEQ = 6

# (schedule, stages_per_rank, split points): where the tied matrix's uses land.
CASES = {
    # stage 0 (rank 0): the encoder's embedding; stage 1 (rank 1): the decoder's and the head.
    "1F1B": ("1F1B", 1, ["decoder"]),
    # ZBV puts stages 0 and 3 on rank 0: the encoder's embedding on one, the decoder's
    # embedding and the head on the other; rank 1's stages hold no use.
    "ZBV-one-rank": ("ZBVZeroBubble", 2, ["encoder.layers.1", "encoder.layers.2", "decoder"]),
    # stage 0 (rank 0): the encoder's embedding; stage 2 (rank 1): the decoder's and the head.
    "ZBV-two-ranks": ("ZBVZeroBubble", 2, ["encoder.layers.1", "decoder", "logit_scale"]),
}


class Stack(nn.Module):
    """A token embedding and a few tanh layers; with ``memory`` (the encoder's output) added first."""

    def __init__(self, vocab: int, d_model: int, n_layers: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, d_model)
        self.layers = nn.ModuleList(nn.Linear(d_model, d_model) for _ in range(n_layers))
        self.dropout = nn.Dropout(dropout)

    def forward(self, ids: torch.Tensor, memory: torch.Tensor | None = None) -> torch.Tensor:
        h = self.embed_tokens(ids)
        if memory is not None:
            h = h + memory
        for layer in self.layers:
            h = torch.tanh(layer(self.dropout(h)))
        return h


class LogitScale(nn.Module):
    """Logits times a learned temperature ``exp(s)`` (CLIP's logit scale)."""

    def __init__(self) -> None:
        super().__init__()
        self.log_scale = nn.Parameter(torch.zeros(()))

    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        return logits * self.log_scale.exp()


class TiedEncoderDecoder(nn.Module):
    """T5's weight tying in miniature: one matrix is the encoder's and the decoder's
    token embedding and the output layer.

    The decoder reads the input shifted right by one (T5 shifts its labels so), made on
    the first stage, so no later stage reads a model input.
    """

    def __init__(self, vocab: int = VOCAB, d_model: int = D_MODEL, encoder_layers: int = 3,
                 decoder_layers: int = 2, dropout: float = 0.0) -> None:
        super().__init__()
        self.shared = nn.Embedding(vocab, d_model)
        self.encoder = Stack(vocab, d_model, encoder_layers, dropout)
        self.decoder = Stack(vocab, d_model, decoder_layers, dropout)
        self.lm_head = nn.Linear(d_model, vocab, bias=False)
        self.logit_scale = LogitScale()
        self.encoder.embed_tokens.weight = self.shared.weight
        self.decoder.embed_tokens.weight = self.shared.weight
        self.lm_head.weight = self.shared.weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        decoder_input_ids = input_ids.roll(1, dims=1)
        memory = self.encoder(input_ids)
        return self.logit_scale(self.lm_head(self.decoder(decoder_input_ids, memory)))


class SharedWeightsLM(nn.Module):
    """An embedding, four tanh layers and an output layer, with one of two ties.

    ``share="layers"``: ALBERT's cross-layer sharing in miniature, ``layers.1`` to
    ``layers.3`` are one weight; split before each of them under ZBV, its first use is on
    stage 1 (rank 1), its others on stages 2 (rank 1) and 3 (rank 0).
    ``share="embedding"``: GPT-2's tied embedding and output layer.
    """

    def __init__(self, share: str, vocab: int = VOCAB, d_model: int = D_MODEL) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.layers = nn.ModuleList(nn.Linear(d_model, d_model) for _ in range(4))
        self.head = nn.Linear(d_model, vocab, bias=False)
        if share == "layers":
            for layer in self.layers[2:]:
                layer.weight = self.layers[1].weight
        else:
            self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return self.head(h)


# kind -> (schedule, stages_per_rank, split points, the shared parameter, the rank of its first use)
SEEDED_CASES = {
    "embedding": ("1F1B", 1, ["layers.2"], "embed.weight", 0),
    "layers": ("ZBVZeroBubble", 2, ["layers.1", "layers.2", "layers.3"], "layers.1.weight", 1),
}



def tied_model(seed: int = 0, **options) -> TiedEncoderDecoder:
    torch.manual_seed(seed)
    return TiedEncoderDecoder(**options)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch ``step``: token ids and targets, (MICROBATCH * N_MICROBATCHES, SEQ) each."""
    return token_batch(step, rows=MICROBATCH * N_MICROBATCHES, seq=SEQ, vocab=VOCAB)


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(output.reshape(-1, VOCAB), target.reshape(-1))


def build(model: nn.Module, schedule: str, stages_per_rank: int, split_points: list[str],
          recompute: bool | str = "auto") -> Pipeline:
    return Pipeline(model, example_args=(batch(0)[0][:MICROBATCH],), loss_fn=loss_fn, schedule=schedule,
                    split_points=split_points, n_microbatches=N_MICROBATCHES,
                    planner=PlannerOptions(stages_per_rank=stages_per_rank, recompute=recompute))


def _gather(t: torch.Tensor) -> list[torch.Tensor]:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return parts


def _grad_diffs(pipe: Pipeline, model: nn.Module) -> dict[str, float]:
    """Largest |pipeline gradient - unsplit gradient| of each parameter this rank holds."""
    ref = dict(model.named_parameters())
    return {n: float("inf") if p.grad is None else (p.grad - ref[n].grad).abs().max().item()
            for n, p in pipe.named_parameters()}


def _train_against_unsplit(pipe: Pipeline, model: nn.Module, steps: int = 3) -> dict:
    """``steps`` AdamW steps of the pipeline and of the unsplit model on the same batches.

    Returns the first step's loss and gradient differences, both models' losses, and
    the largest difference of each held parameter from the unsplit model's afterwards.
    """
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    result: dict = {"losses": [], "ref_losses": []}
    for step in range(steps):
        x, y = batch(step)
        opt.zero_grad()
        ref_opt.zero_grad()
        result["losses"].append(pipe.step(x, target=y).item())
        ref = loss_fn(model(x), y)
        ref.backward()
        result["ref_losses"].append(ref.item())
        if step == 0:
            result["grad_diff"] = _grad_diffs(pipe, model)
        opt.step()
        ref_opt.step()
    ref_params = dict(model.named_parameters())
    result["param_diff"] = {n: (p.detach() - ref_params[n].detach()).abs().max().item()
                            for n, p in pipe.named_parameters()}
    result["all_param_names"] = sorted(ref_params)
    return result


def _alias_report(pipe: Pipeline, canonical: str, aliases: list[str]) -> dict:
    """How the aliases of ``canonical`` live in this rank's stage modules.

    ``objects`` / ``storages``: distinct tensor objects / memory addresses behind every
    alias in every local stage module (training and eval traces) and the pipeline's own;
    ``listed``: how often each training stage module's ``named_parameters()`` lists one.
    """
    tensors = [dict(pipe.named_parameters())[canonical]] if canonical in dict(pipe.named_parameters()) else []
    modules = {id(m): m for m in (*pipe._train_modules.values(), *pipe._eval.traced().values())}
    for module in modules.values():
        tensors += [p for name, p in module.named_parameters(remove_duplicate=False) if name in aliases]
    listed = {s: sum(n in aliases for n, _ in m.named_parameters()) for s, m in pipe.stage_modules.items()}
    return {"objects": len({id(t) for t in tensors}), "storages": len({t.data_ptr() for t in tensors}),
            "listed": listed, "held": bool(tensors)}


def three_way_run(rank: int, world_size: int, case: str) -> dict:
    """The T5-style three-way tie split as ``CASES[case]`` (``"+checkpoint"``: every stage
    checkpointed): one step's gradients, then 3 AdamW steps, against the unsplit model."""
    name, _, option = case.partition("+")
    schedule, per_rank, split = CASES[name]
    model = tied_model()
    pipe = build(model, schedule, per_rank, split, recompute=option == "checkpoint")
    aliases = ["shared.weight", "encoder.embed_tokens.weight", "decoder.embed_tokens.weight", "lm_head.weight"]
    result = {"stage_indices": pipe.stage_indices, "alias": _alias_report(pipe, "shared.weight", aliases)}
    result.update(_train_against_unsplit(pipe, model))
    held = dict(pipe.named_parameters()).get("shared.weight")
    # Every rank takes part in the gather; ranks without a copy send NaNs, left out below.
    copies = _gather(held.detach() if held is not None else torch.full((VOCAB, D_MODEL), float("nan")))
    kept = [c for c in copies if not c.isnan().any()]
    result["copies_equal"] = len(kept) >= 1 and all(torch.equal(kept[0], c) for c in kept)
    result["copies"] = len(kept)
    return result


def eval_trace_run(rank: int, world_size: int) -> dict:
    """A model with dropout (traced again for eval) reads the pipeline's tied tensor in eval mode."""
    schedule, per_rank, split = CASES["1F1B"]
    pipe = build(tied_model(dropout=0.1), schedule, per_rank, split)
    aliases = ["shared.weight", "encoder.embed_tokens.weight", "decoder.embed_tokens.weight", "lm_head.weight"]
    result = {"traced_before_eval": bool(pipe._eval.traced())}
    # New values for every tensor: the eval trace, taken at the first eval-mode call, must see them through every alias.
    other = tied_model(seed=5, dropout=0.1).eval()
    pipe.load_state_dict(other.state_dict())
    pipe.eval()
    x, _ = batch(0)
    out = pipe(x)
    result["eval_output_diff"] = None if out is None else (out - other(x)).abs().max().item()
    result["alias"] = _alias_report(pipe, "shared.weight", aliases)
    result["separate_eval_trace"] = any(m is not pipe._train_modules[s] for s, m in pipe._eval.traced().items())
    return result


def seeded_run(rank: int, world_size: int, kind: str) -> dict:
    """Each rank builds its model after ``torch.manual_seed(10 + rank)``: the shared copies start
    equal to the copy of the rank of first use, and the pipeline trains like the unsplit model
    holding what each rank holds.

    ``kind``: a key of :data:`SEEDED_CASES`.
    """
    schedule, per_rank, split, shared, source = SEEDED_CASES[kind]

    def make(seed: int) -> SharedWeightsLM:
        torch.manual_seed(seed)
        return SharedWeightsLM(kind)

    models = [make(10 + r) for r in range(world_size)]  # every rank's model, for the reference
    pipe = build(make(10 + rank), schedule, per_rank, split)
    held = {n: p.detach().clone() for n, p in pipe.named_parameters()}
    source_value = models[source].get_parameter(shared).detach()
    result: dict = {"shared_held": shared in held,
                    "shared_equals_source": shared in held and torch.equal(held[shared], source_value),
                    "ranks_differ_before": not torch.equal(models[0].get_parameter(shared), models[1].get_parameter(shared))}
    # The unsplit reference: each parameter from the model of the rank holding it, the
    # shared one from the rank of first use.
    owners: list = [None] * world_size
    dist.all_gather_object(owners, sorted(held))
    reference = make(0)
    with torch.no_grad():
        for name, p in reference.named_parameters():
            r = source if name == shared else next(r for r, names in enumerate(owners) if name in names)
            p.copy_(models[r].get_parameter(name))
    result.update(_train_against_unsplit(pipe, reference))
    copy = dict(pipe.named_parameters()).get(shared)
    copies = _gather(copy.detach() if copy is not None else torch.full_like(source_value, float("nan")))
    kept = [c for c in copies if not c.isnan().any()]
    result["copies_equal"] = len(kept) == world_size and all(torch.equal(kept[0], c) for c in kept)
    return result


def scenarios_run(rank: int, world_size: int, scenarios: list[tuple[str, str, tuple]]) -> dict:
    """Several scenarios in one world (spawning one costs seconds): ``{key: worker(rank, world_size, *args)}``
    for each ``(key, worker name, args)``."""
    return {key: globals()[worker](rank, world_size, *args) for key, worker, args in scenarios}


def _error(fn) -> str:
    try:
        fn()
    except ValueError as e:
        return f"ValueError: {e}"
    return "no error"


def mismatch_run(rank: int, world_size: int) -> dict:
    """Ranks given different models raise a ValueError each, naming the first difference."""
    schedule, per_rank, split = CASES["1F1B"]
    result: dict = {}
    # Rank 1's decoder layers are D_MODEL + 1 wide in between: other shapes, the same names.
    model = tied_model()
    if rank == 1:
        model.decoder.layers[0] = nn.Linear(D_MODEL, D_MODEL + 1)
        model.decoder.layers[1] = nn.Linear(D_MODEL + 1, D_MODEL)
    result["shape"] = _error(lambda: build(model, schedule, per_rank, split))
    # Rank 1 left the head untied: the same names and shapes, other ties.
    model = tied_model()
    if rank == 1:
        model.lm_head.weight = nn.Parameter(model.shared.weight.detach().clone())
    result["tie"] = _error(lambda: build(model, schedule, per_rank, split))
    # The job goes on: the same model on every rank builds and steps.
    pipe = build(tied_model(), schedule, per_rank, split)
    result["step_after"] = pipe.step(*batch(0)[:1], target=batch(0)[1]).item()
    return result


class T5Logits(nn.Module):
    """A tiny ``transformers`` T5 whose forward returns the logits tensor alone."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import T5Config, T5ForConditionalGeneration

        config = T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
                          num_heads=4, use_cache=False, dropout_rate=0.0)
        self.t5 = T5ForConditionalGeneration(config)

    def forward(self, input_ids: torch.Tensor, decoder_input_ids: torch.Tensor) -> torch.Tensor:
        return self.t5(input_ids=input_ids, decoder_input_ids=decoder_input_ids).logits


# schedule -> (stages_per_rank, split points): the decoder's embedding and the head on one stage.
T5_CASES = {"1F1B": (1, ["t5.decoder"]), "ZBVZeroBubble": (2, ["t5.encoder.block.1", "t5.decoder", "t5.decoder.block.1"])}


def t5_run(rank: int, world_size: int, schedule: str) -> dict:
    """T5's three-way tie (``shared``, both ``embed_tokens``, ``lm_head``): one step against the unsplit model."""
    torch.manual_seed(0)
    model = T5Logits()
    per_rank, split = T5_CASES[schedule]
    x, y = batch(0)
    decoder_ids = y.roll(1, dims=1)
    pipe = Pipeline(model, example_args=(x[:MICROBATCH], decoder_ids[:MICROBATCH]), loss_fn=loss_fn,
                    schedule=schedule, split_points=split, n_microbatches=N_MICROBATCHES,
                    planner=PlannerOptions(stages_per_rank=per_rank))
    loss = pipe.step(x, decoder_ids, target=y).item()
    ref = loss_fn(model(x, decoder_ids), y)
    ref.backward()
    return {"loss": loss, "ref_loss": ref.item(), "grad_diff": _grad_diffs(pipe, model),
            "all_param_names": sorted(n for n, _ in model.named_parameters())}
