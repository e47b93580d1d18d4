"""The checks run on :mod:`zoo.thirdparty`'s models: does a split match the unsplit model?

What ``tests/thirdparty`` asserts and ``benchmarks/models`` records, in one place:

- :func:`check_split` builds a split's stages with autopipe's runtime builder and runs them
  one after another in one process; the output must match the unsplit model's;
- :func:`pipeline_step_vs_unsplit` is one rank of a real 2-rank ``Pipeline.step``, whose
  loss and gradients must match the unsplit model's (:func:`summarize_ranks` gives the
  verdict over the ranks);
- :func:`first_line` writes a failure in one line for the reports.

Example:
    >>> output_difference((torch.ones(2),), [torch.ones(2) * 1.5]) <= TOLERANCE
    False
"""

from __future__ import annotations

from typing import Any

import torch

from .thirdparty import Built, get, microbatch

__all__ = [
    "TOLERANCE",
    "first_line",
    "output_difference",
    "check_split",
    "pipeline_step_vs_unsplit",
    "pipeline_steps_vs_unsplit",
    "summarize_ranks",
]

#: Largest |difference| from the unsplit model accepted by the checks.
TOLERANCE = 1e-5


def _one_line(text: str, limit: int = 160) -> str:
    """The first line of ``text``, cut after its first sentence when that line runs past ``limit``."""
    line = text.strip().splitlines()[0] if text.strip() else ""
    if len(line) > limit:
        end = line.find(". ")
        line = line[: end + 1] if 0 < end < limit else line[: limit - 1] + "\u2026"
    return line


def first_line(error: BaseException | str) -> str:
    """A failure in one line: ``"Type: first line"``, and the root cause when the error wraps one.

    torch's ``pipeline()`` wraps every export failure in the same generic message; the
    exception it chains to says what actually failed.

    Example:
        >>> first_line(ValueError("bad split\\nmore detail"))
        'ValueError: bad split'
        >>> try:
        ...     try:
        ...         raise KeyError("inner")
        ...     except KeyError as e:
        ...         raise RuntimeError("outer") from e
        ... except RuntimeError as e:
        ...     first_line(e)
        "RuntimeError: outer [cause: KeyError: 'inner']"
    """
    if isinstance(error, str):
        return _one_line(error)
    text = f"{type(error).__name__}: {_one_line(str(error))}".rstrip(": ")
    root, seen = error, {id(error)}
    while (nxt := root.__cause__ or root.__context__) is not None and id(nxt) not in seen:
        seen.add(id(nxt))
        root = nxt
    if root is not error:
        text += f" [cause: {type(root).__name__}: {_one_line(str(root))}]"
    return text


def output_difference(reference: Any, output: Any) -> float:
    """Largest |difference| between the tensors of two outputs, taken leaf by leaf in pytree order.

    A Hugging Face ``ModelOutput`` flattens to its tensors, so the unsplit model's output
    compares with the tuple torch's ``Pipe`` returns for it.

    Raises:
        ValueError: the two hold different numbers or shapes of tensors.

    Example:
        >>> output_difference((torch.ones(2),), [torch.ones(2) * 1.5])
        0.5
    """
    from torch.utils._pytree import tree_flatten

    ref = [t for t in tree_flatten(reference)[0] if isinstance(t, torch.Tensor)]
    out = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor)]
    if len(ref) != len(out):
        raise ValueError(f"the unsplit model returns {len(ref)} tensors, the stages {len(out)}")
    worst = 0.0
    for i, (r, o) in enumerate(zip(ref, out)):
        if r.shape != o.shape:
            raise ValueError(f"output tensor {i} has shape {tuple(o.shape)}, the unsplit model's {tuple(r.shape)}")
        if r.numel():
            worst = max(worst, (r.detach().double() - o.detach().double()).abs().max().item())
    return worst


def check_split(built: Built, split_points: list[str] | tuple[str, ...]) -> float:
    """Build a split's stages with autopipe's runtime builder in one process and run them in order.

    The stages are the ones :class:`autopipe.Pipeline` builds (its training trace, from a
    private copy of the model with a Hugging Face KV cache turned off, as the pipeline
    does); torch's ``Pipe`` runs them one after another, fed and unpacked the way the
    pipeline feeds its first stage and rebuilds the model's output. Both runs start from
    the same RNG seed, so a model with dropout draws the same masks in both. Returns the
    largest |difference| between the stages' output and the unsplit model's.

    Raises:
        whatever building or running the stages raises (that is the finding).

    Example:
        >>> built = get("bert").build()  # doctest: +SKIP
        >>> check_split(built, ["bert.encoder.layer.1"]) <= TOLERANCE  # doctest: +SKIP
        True
    """
    import copy

    from torch.distributed.pipelining import SplitPoint

    from autopipe.planning import hf_compat
    from autopipe.runtime import split_model

    args = built.example_args
    model = copy.deepcopy(built.model)
    hf_compat.turn_off_cache(model)
    kwargs = hf_compat.training_kwargs(model, built.example_kwargs)[0]
    # A model drawing with NumPy or Python (SpecAugment) draws at tracing time; the reference
    # then draws the same numbers, so both runs compute with one mask.
    host_state = _seed_host_random(0)
    pipe = split_model(model, {name: SplitPoint.BEGINNING for name in split_points}, (args, kwargs),
                       training=True, expected=len(split_points) + 1)
    io = pipe.autopipe_io
    with torch.random.fork_rng(devices=[]), hf_compat.training_config(built.model):
        torch.manual_seed(0)
        _seed_host_random(0)
        reference = built.model(*args, **kwargs)
        _restore_host_random(host_state)
        torch.manual_seed(0)
        output = io.unflatten_output(pipe(*io.stage_inputs(args, kwargs)))
    return output_difference(reference, output)


def _seed_host_random(seed: int) -> tuple:
    """Seed NumPy's and Python's generators; return their states before."""
    import random

    import numpy as np

    state = (random.getstate(), np.random.get_state())
    random.seed(seed)
    np.random.seed(seed)
    return state


def _restore_host_random(state: tuple) -> None:
    import random

    import numpy as np

    random.setstate(state[0])
    np.random.set_state(state[1])


def pipeline_step_vs_unsplit(rank: int, world_size: int, name: str, n_microbatches: int = 4) -> dict[str, Any]:
    """One rank of the 2-rank check: a 1F1B ``Pipeline.step`` against the unsplit model.

    Each rank builds the model without dropout (two processes cannot draw the unsplit
    model's masks) with a batch of ``n_microbatches`` micro-batches of 2, steps an
    :class:`autopipe.Pipeline` cut at the entry's ``pipeline_split``, and computes the
    reference itself: the unsplit model's loss averaged over the same micro-batches (batch
    norm normalises each micro-batch on its own in a pipeline), then its backward.

    Returns:
        ``{"loss", "ref_loss", "grad_diff": {name: max |difference|}, "held": [names],
        "with_grad": [names]}``: the pipeline's mean loss, the reference's, for each
        parameter this rank holds the largest gradient difference (a missing gradient
        counts as zeros), and the parameters whose reference gradient exists.

    Example:
        >>> run_world(pipeline_step_vs_unsplit, 2, "bert")  # doctest: +SKIP
    """
    from autopipe import Pipeline

    entry = get(name)
    built = entry.build(batch=2 * n_microbatches, dropout=False)
    mb_args, mb_kwargs, _ = microbatch(built, 0, 2)
    pipe = Pipeline(built.model, example_args=mb_args, example_kwargs=mb_kwargs, loss_fn=built.loss_fn,
                    split_points=[entry.pipeline_split], schedule="1F1B", n_microbatches=n_microbatches)
    with pipe:
        loss = pipe.step(*built.example_args, target=built.target, **built.example_kwargs)

    model = built.model
    model.zero_grad()
    ref = 0.0
    for i in range(n_microbatches):
        args, kwargs, target = microbatch(built, i, 2)
        ref = ref + built.loss_fn(model(*args, **kwargs), target) / n_microbatches
    ref.backward()
    ref_grads = {n: p.grad for n, p in model.named_parameters()}
    grad_diff = {}
    for n, p in pipe.named_parameters():
        mine = p.grad if p.grad is not None else torch.zeros_like(p)
        theirs = ref_grads.get(n)
        theirs = theirs if theirs is not None else torch.zeros_like(p)
        grad_diff[n] = (mine - theirs).abs().max().item() if p.numel() else 0.0
    return {"loss": loss.item(), "ref_loss": ref.item(), "grad_diff": grad_diff,
            "held": sorted(grad_diff), "with_grad": sorted(n for n, g in ref_grads.items() if g is not None)}


def pipeline_steps_vs_unsplit(rank: int, world_size: int, names: list[str],
                              n_microbatches: int = 4) -> dict[str, dict[str, Any]]:
    """:func:`pipeline_step_vs_unsplit` for several models in one 2-rank world, one after another.

    Starting the processes and importing the packages costs more than a tiny model's step,
    so the test suite checks its subset in one world. Each pipeline is closed before the
    next is built; an error is kept as ``{"error": "Type: first line"}`` for that model.

    Example:
        >>> run_world(pipeline_steps_vs_unsplit, 2, ["bert", "vit"])  # doctest: +SKIP
    """
    results: dict[str, dict[str, Any]] = {}
    for name in names:
        try:
            results[name] = pipeline_step_vs_unsplit(rank, world_size, name, n_microbatches)
        except Exception as e:  # noqa: BLE001 - reported per model; every rank raises alike
            results[name] = {"error": first_line(e)}
    return results


def summarize_ranks(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The 2-rank check's verdict from every rank's :func:`pipeline_step_vs_unsplit` result.

    Returns ``{"max_loss_diff", "max_grad_diff", "worst_param", "missing"}``: ``missing``
    lists parameters with a reference gradient that no rank holds.

    Example:
        >>> r0 = {"loss": 1.0, "ref_loss": 1.0, "grad_diff": {"a": 0.0}, "held": ["a"], "with_grad": ["a", "b"]}
        >>> r1 = {"loss": 1.0, "ref_loss": 1.0, "grad_diff": {"b": 2e-7}, "held": ["b"], "with_grad": ["a", "b"]}
        >>> summarize_ranks([r0, r1])
        {'max_loss_diff': 0.0, 'max_grad_diff': 2e-07, 'worst_param': 'b', 'missing': []}
    """
    diffs = {n: d for r in results for n, d in r["grad_diff"].items()}
    worst = max(diffs, key=lambda n: diffs[n], default=None)
    held = {n for r in results for n in r["held"]}
    return {"max_loss_diff": max(abs(r["loss"] - r["ref_loss"]) for r in results),
            "max_grad_diff": diffs[worst] if worst is not None else 0.0, "worst_param": worst,
            "missing": sorted(set(results[0]["with_grad"]) - held)}
