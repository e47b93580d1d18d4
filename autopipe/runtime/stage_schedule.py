"""torch's schedule over this rank's stages, each micro-batch's loss a share of the step's mean."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

from ..planning.schedules import schedule_class, schedule_spec
from .model_io import ModelIO
from .step_failures import PlayThroughLoss, StepFailures, play_through_forward


class MicrobatchMeanLoss:
    """The user's per-micro-batch loss divided by the number of micro-batches a call holds.

    A short last batch holds fewer micro-batches than the schedule runs: the runtime fills
    it up with copies (``call_inputs``), and :meth:`start` makes the copies weigh nothing.
    torch's last stage computes the losses in micro-batch order.

    Example:
        >>> loss = MicrobatchMeanLoss(lambda out, y: (out - y).abs().sum(), 4)
        >>> loss(torch.ones(2), torch.zeros(2))
        tensor(0.5000)
    """

    def __init__(self, loss_fn: Callable, n_microbatches: int, io: ModelIO | None = None) -> None:
        self.loss_fn = loss_fn
        self.n_microbatches = n_microbatches
        self.io = io
        self.held, self._calls = n_microbatches, 0

    def start(self, held: int) -> None:
        """A new call whose first ``held`` micro-batches are real (the rest fill a short batch)."""
        self.held, self._calls = held, 0

    def __call__(self, output: Any, target: Any, **kwargs: Any) -> torch.Tensor:
        if self.io is not None:
            output = self.io.unflatten_output(output)
        index, self._calls = self._calls, self._calls + 1
        loss = self.loss_fn(output, target, **kwargs)
        return loss / self.held if index < self.held else loss * 0.0


def make_schedule(schedule: str, stages: list, n_microbatches: int, loss_fn: Callable | None,
                  failures: StepFailures, device: torch.device) -> Any:
    """torch's schedule ``schedule`` over ``stages``, with failures played through."""
    cls = schedule_class(schedule)
    for stage in stages:
        play_through_forward(stage.submod, failures, stage.stage_index, device)
    if loss_fn is not None:
        loss_fn = PlayThroughLoss(loss_fn, failures)
    kwargs: dict[str, Any] = {"loss_fn": loss_fn}
    # The loss is already divided by n_microbatches (MicrobatchMeanLoss), so torch must not
    # divide the gradients again - its division would also hit gradients accumulated over
    # earlier steps.
    if "scale_grads" in inspect.signature(cls.__init__).parameters:
        kwargs["scale_grads"] = False
    first = stages[0] if schedule_spec(schedule).placement == "single" else stages
    return cls(first, n_microbatches, **kwargs)
