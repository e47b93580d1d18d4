"""Another input shape than the traced one (a sequence length): this rank's stages traced again at it.

torch.export traces the stages for the example's shape, and torch's stages receive into
buffers of that shape, so a batch of another length needs stages traced at its length. They
are traced from a meta-device twin of the model and read the very tensors the first stages
hold (:func:`~autopipe.runtime.stages.retrace_rank_stages`): gradients, the optimizer, state
dicts and checkpoints see one set of parameters whatever lengths the calls bring. Each
shape's stages and schedules are kept for the calls that come back to it.

Example::

    pipe = Pipeline(model, example_args=(x[:2, :12],), loss_fn=loss_fn, n_microbatches=4)
    pipe.step(x[:, :8], target=y[:, :8])    # traced again at length 8, once
    pipe.step(x[:, :16], target=y[:, :16])  # and at 16
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .compat import forget_generated_source
from .distributed import raise_on_every_rank
from .inference import Inference
from .stage_schedule import MicrobatchMeanLoss, make_schedule
from .stages import RankStages, retrace_rank_stages
from .step_failures import StepFailures

#: How many shapes' stages a pipeline keeps besides the traced one; beyond it the least
#: recently used is dropped (and traced again if it comes back).
KEPT_SHAPES = 8


@dataclass
class ShapeStages:
    """One input shape's stages: the training schedule and inference over them."""

    built: RankStages
    train_schedule: Any
    inference: Inference


class ShapeVariants:
    """This rank's stages for each input shape the calls bring, traced on first use."""

    def __init__(self, built: RankStages, *, schedule: str, num_stages: int, n_microbatches: int,
                 train_loss: MicrobatchMeanLoss, loss_fn: Callable | None, failures: StepFailures,
                 device: torch.device, rank: int, world_size: int, group: Any = None) -> None:
        self._base = built
        self._schedule = schedule
        self._num_stages = num_stages
        self._n_microbatches = n_microbatches
        self._train_loss = train_loss
        self._loss_fn = loss_fn
        self._failures = failures
        self._device = device
        # The ranks of this pipeline (a replica's pp group under pp x dp): they trace a new shape together.
        self._rank, self._world_size, self._group = rank, world_size, group
        self._kept: OrderedDict[tuple[int, ...], ShapeStages] = OrderedDict()
        self._warned = False

    def at(self, dims: tuple[int, ...], training: bool) -> ShapeStages | None:
        """The stages for inputs whose dimensions after the rows are ``dims``; None at the traced shape.

        Collective over the pipeline's ranks the first time a shape comes (each traces, and
        a rank that cannot raises on every rank); they call it with the same ``dims``
        (agreed as the call opened).
        """
        if tuple(dims) == self._base.batch.traced_dims:
            return None
        found = self._kept.get(tuple(dims))
        if found is None:
            found = self._trace(tuple(dims))
        self._kept.move_to_end(tuple(dims))
        for module in found.built.train_modules.values():  # the pipeline's mode, as train()/eval() set it
            module.train(training)
        return found

    def _trace(self, dims: tuple[int, ...]) -> ShapeStages:
        """Trace and build the stages at ``dims`` (collective: every rank does so)."""
        built, error = None, None
        shapes = f"sizes {list(dims)} after the rows (traced at {list(self._base.batch.traced_dims)})"
        try:
            if self._base.retrace is None:
                raise RuntimeError("this pipeline's stages cannot be traced again")
            built = retrace_rank_stages(self._base.retrace, self._base.batch, dims)
        except Exception as e:  # noqa: BLE001 - raised below, on every rank
            error = ValueError(f"the batch's inputs have {shapes}, and the model cannot be traced at them: "
                               f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}")
            error.__cause__ = e
        raise_on_every_rank(error, rank=self._rank, world_size=self._world_size, group=self._group,
                            what=f"trace its stages for inputs of {shapes}")
        assert built is not None
        # Per-use parameters of a split backward are folded into the pipeline's gradients with the first ones.
        self._base.use_leaves.extend(built.use_leaves)
        train_schedule = None
        if self._loss_fn is not None:
            train_schedule = make_schedule(self._schedule, built.train_stages, self._n_microbatches,
                                           self._train_loss, self._failures, self._device)
        found = self._kept[dims] = ShapeStages(built, train_schedule, Inference(
            built, num_stages=self._num_stages, schedule=self._schedule, n_microbatches=self._n_microbatches,
            loss_fn=self._loss_fn, failures=self._failures, device=self._device))
        if len(self._kept) > KEPT_SHAPES:
            _, dropped = self._kept.popitem(last=False)
            dropped.inference.close()
            forget_generated_source(dropped.built.generated_source_keys())
            gone = {id(leaf) for _, leaf in dropped.built.use_leaves}
            self._base.use_leaves[:] = [(c, leaf) for c, leaf in self._base.use_leaves if id(leaf) not in gone]
            if not self._warned:
                self._warned = True
                warnings.warn(f"the pipeline has been called with more than {KEPT_SHAPES} input shapes; each new "
                              "one traces the stages again (seconds per shape): pad the batches to a few lengths",
                              stacklevel=4)
        return found

    def close(self) -> None:
        """Drop every other shape's stages and schedules, and the source torch.fx kept for all of them."""
        for found in self._kept.values():
            found.inference.close()
            forget_generated_source(found.built.generated_source_keys())
        self._kept.clear()
        forget_generated_source(self._base.generated_source_keys())
