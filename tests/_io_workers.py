"""What each rank runs in the model-input/output tests (spawned by tests/_dist_utils.run_world).

The models here are small on purpose and built so that a wiring mistake cannot hide:
inputs of equal shapes used in another order than the signature's, a keyword input read
only by a later stage, an output computed by the first stage, and a dict output.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from autopipe.runtime import Pipeline

MICROBATCH = 2
N_MICROBATCHES = 2
WIDTH = 4


class SecondInputFirst(nn.Module):
    """``forward(sample, timestep)`` embeds ``timestep`` first (as diffusers' UNet2DModel does)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(WIDTH, WIDTH)
        self.block = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, WIDTH)

    def forward(self, sample: torch.Tensor, timestep: torch.Tensor) -> torch.Tensor:
        t = self.embed(timestep)
        return self.head(torch.tanh(self.block(sample * 2.0 + t)))


class LateKeywordDictOutput(nn.Module):
    """A keyword input read only after the cut, and a dict output half computed by stage 0."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Linear(WIDTH, WIDTH)
        self.decoder = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor, *, scale: torch.Tensor, decoder_input: torch.Tensor) -> dict:
        memory = torch.tanh(self.encoder(x))
        hidden = self.decoder(decoder_input * scale + memory)
        return {"logits": self.head(hidden), "memory": memory}


def _batch(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (MICROBATCH * N_MICROBATCHES, WIDTH)
    return {name: torch.randn(shape, generator=g) for name in ("a", "b", "c", "target")}


def _against_unsplit(pipe: Pipeline, model: nn.Module, loss: torch.Tensor, ref: torch.Tensor) -> dict:
    ref.backward()
    ref_grads = {n: p.grad for n, p in model.named_parameters()}
    return {
        "loss": loss.item(),
        "ref_loss": ref.item(),
        "grad_diff": {n: float("inf") if p.grad is None else (p.grad - ref_grads[n]).abs().max().item()
                      for n, p in pipe.named_parameters()},
    }


def swapped_inputs_run(rank: int, world_size: int, schedule: str, split: str) -> dict:
    """Inputs of equal shape used out of order: the pipeline must feed each by name."""
    torch.manual_seed(0)
    model = SecondInputFirst()
    b = _batch(1)

    def loss_fn(out, target):
        return ((out - target) ** 2).mean()

    example = (b["a"][:MICROBATCH], b["b"][:MICROBATCH])
    pipe = Pipeline(model, example_args=example, loss_fn=loss_fn, split_points=[split],
                    schedule=schedule, n_microbatches=N_MICROBATCHES)
    loss = pipe.step(b["a"], b["b"], target=b["target"])
    ref = torch.stack([loss_fn(model(b["a"][i:i + MICROBATCH], b["b"][i:i + MICROBATCH]), b["target"][i:i + MICROBATCH])
                       for i in range(0, MICROBATCH * N_MICROBATCHES, MICROBATCH)]).mean()
    result = _against_unsplit(pipe, model, loss, ref)
    swapped = torch.stack([loss_fn(model(b["b"][i:i + MICROBATCH], b["a"][i:i + MICROBATCH]), b["target"][i:i + MICROBATCH])
                           for i in range(0, MICROBATCH * N_MICROBATCHES, MICROBATCH)]).mean()
    result["swapped_loss"] = swapped.item()
    return result


def keyword_dict_run(rank: int, world_size: int, schedule: str, reorder: bool) -> dict:
    """Keywords given in another order than traced; one read only by stage 1; a dict reaches loss_fn."""
    torch.manual_seed(0)
    model = LateKeywordDictOutput()
    b = _batch(2)
    seen_types: list[str] = []

    def loss_fn(out, target):
        seen_types.append(type(out).__name__)
        return ((out["logits"] - target) ** 2).mean() + out["memory"].pow(2).mean()

    example_kwargs = {"scale": b["b"][:MICROBATCH], "decoder_input": b["c"][:MICROBATCH]}
    pipe = Pipeline(model, example_args=(b["a"][:MICROBATCH],), example_kwargs=example_kwargs, loss_fn=loss_fn,
                    split_points=["decoder"], schedule=schedule, n_microbatches=N_MICROBATCHES)
    kwargs = {"decoder_input": b["c"], "scale": b["b"]} if reorder else {"scale": b["b"], "decoder_input": b["c"]}
    loss = pipe.step(b["a"], target=b["target"], **kwargs)
    mb = [slice(i, i + MICROBATCH) for i in range(0, MICROBATCH * N_MICROBATCHES, MICROBATCH)]
    ref = torch.stack([loss_fn(model(b["a"][s], scale=b["b"][s], decoder_input=b["c"][s]), b["target"][s])
                       for s in mb]).mean()
    result = _against_unsplit(pipe, model, loss, ref)
    pipe.eval()
    output = pipe(b["a"], **kwargs)
    with torch.no_grad():
        expected = model(b["a"], scale=b["b"], decoder_input=b["c"])
    result["output_type"] = None if output is None else type(output).__name__
    result["output_diff"] = None if output is None else max(
        (output[k] - expected[k]).abs().max().item() for k in expected)
    result["loss_fn_saw"] = sorted(set(seen_types[:-N_MICROBATCHES]))  # the pipeline's calls, not the reference's
    return result


class WithFlag(nn.Module):
    """A non-tensor keyword that torch.export fixes at its traced value."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(WIDTH, WIDTH)
        self.b = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor, double: bool = False) -> torch.Tensor:
        h = self.a(x)
        return self.b(h * 2 if double else h)


def bad_batches_run(rank: int, world_size: int) -> dict:
    """The error each rank raises for batches that differ from the traced inputs, before communicating."""
    torch.manual_seed(0)
    x = torch.randn(MICROBATCH, WIDTH)
    pipe = Pipeline(WithFlag(), example_args=(x,), example_kwargs={"double": True},
                    loss_fn=lambda out, t: out.sum(), split_points=["b"], schedule="1F1B",
                    n_microbatches=N_MICROBATCHES)
    batch = torch.randn(MICROBATCH * N_MICROBATCHES, WIDTH)
    errors = {}
    for case, (args, kwargs) in {"flag": ((batch,), {"double": False}),
                                 "dtype": ((batch.double(),), {"double": True})}.items():
        try:
            pipe.step(*args, target=batch, **kwargs)
            errors[case] = None
        except ValueError as e:
            errors[case] = str(e)
    errors["still_steps"] = pipe.step(batch, target=batch, double=True).item()
    return errors


def float64_run(rank: int, world_size: int) -> dict:
    """A float64 model: the loss comes back as float64, equal to the unsplit model's."""
    torch.manual_seed(0)
    model = SecondInputFirst().double()
    b = {k: v.double() for k, v in _batch(3).items()}

    def loss_fn(out, target):
        return ((out - target) ** 2).mean()

    pipe = Pipeline(model, example_args=(b["a"][:MICROBATCH], b["b"][:MICROBATCH]), loss_fn=loss_fn,
                    split_points=["block"], schedule="1F1B", n_microbatches=N_MICROBATCHES)
    loss = pipe.step(b["a"], b["b"], target=b["target"])
    ref = torch.stack([loss_fn(model(b["a"][i:i + MICROBATCH], b["b"][i:i + MICROBATCH]), b["target"][i:i + MICROBATCH])
                       for i in range(0, MICROBATCH * N_MICROBATCHES, MICROBATCH)]).mean()
    return {"dtype": str(loss.dtype), "diff": abs(loss.item() - ref.item())}


class BatchNormNet(nn.Module):
    """Batch statistics on both sides of the cut."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.head = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(64, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.bn(self.conv(x))))


def batchnorm_run(rank: int, world_size: int) -> dict:
    """A BatchNorm model equals the unsplit model run micro-batch by micro-batch, statistics included."""
    torch.manual_seed(0)
    model = BatchNormNet()
    g = torch.Generator().manual_seed(5)
    x = torch.randn(MICROBATCH * N_MICROBATCHES, 2, 4, 4, generator=g) * 3 + 1
    y = torch.randint(0, 3, (MICROBATCH * N_MICROBATCHES,), generator=g)
    loss_fn = nn.CrossEntropyLoss()
    pipe = Pipeline(model, example_args=(x[:MICROBATCH],), loss_fn=loss_fn, split_points=["head"],
                    schedule="1F1B", n_microbatches=N_MICROBATCHES)
    loss = pipe.step(x, target=y)
    whole = loss_fn(model(x), y).item()  # one pass over the whole batch: other statistics
    model.zero_grad()
    # Reset the running statistics the whole-batch pass just moved, then run micro-batch by micro-batch.
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.reset_running_stats()
    ref = torch.stack([loss_fn(model(x[i:i + MICROBATCH]), y[i:i + MICROBATCH])
                       for i in range(0, len(x), MICROBATCH)]).mean()
    result = _against_unsplit(pipe, model, loss, ref)
    result["whole_batch_loss"] = whole
    state = pipe.state_dict()
    result["stats_diff"] = max(((state[k] - v).abs().max().item() for k, v in model.state_dict().items()
                                if "running" in k and k in state), default=None)
    return result
