"""Inference on a pipeline's stages: forward only where torch can, else through a training step."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

from ..planning.schedules import schedule_class, schedule_spec
from .stage_schedule import MicrobatchMeanLoss, make_schedule
from .stages import RankStages, manual_stage, rewrap_stage
from .step_failures import StepFailures

def zero_loss(output: Any, target: Any) -> torch.Tensor:
    """A loss of exactly zero that still depends on the output (so a backward can run).

    Example:
        >>> x = torch.ones(2, requires_grad=True)
        >>> loss = zero_loss((x * 3, "text"), None); loss.backward()
        >>> loss.item(), x.grad
        (0.0, tensor([0., 0.]))
    """
    floats = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.is_floating_point()]
    return sum(t.sum() for t in floats) * 0.0


class Inference:
    """Runs this rank's stages without training, in train or eval mode, with or without the loss."""

    def __init__(self, built: RankStages, *, num_stages: int, schedule: str, n_microbatches: int,
                 loss_fn: Callable | None, failures: StepFailures, device: torch.device) -> None:
        self._train_modules = built.train_modules
        self._eval = built.eval  # traced at the first eval-mode call
        self._train_stages = built.train_stages
        self._batch = built.batch
        self._num_stages = num_stages
        self._schedule = schedule
        self._n_microbatches = n_microbatches
        self._loss_fn = loss_fn
        self._failures = failures
        self._device = device
        #: Whether torch can run this schedule forward-only (``schedule.eval``).
        self.forward_only: bool = schedule_spec(schedule).placement != "v" and hasattr(schedule_class(schedule), "eval")
        self._schedules: dict[tuple[bool, bool], Any] = {}  # (training, with_loss) -> schedule
        self._losses: dict[tuple[bool, bool], MicrobatchMeanLoss] = {}  # the losses of those with one

    def placeholder_target(self) -> torch.Tensor | None:
        """What to pass as the target of a call without one: what :func:`zero_loss` ignores, one
        per micro-batch, where inference runs a training step; None where it runs forward only."""
        return None if self.forward_only else torch.zeros(self._n_microbatches)

    def _schedule_for(self, *, training: bool, with_loss: bool) -> Any:
        """The schedule that runs inference in this mode, built on first use."""
        key = (training, with_loss)
        if key not in self._schedules:
            modules = self._train_modules if training else self._eval.get()
            if schedule_spec(self._schedule).placement == "v":
                # The training stages' group: the pipeline's own ranks under pp x dp or pp x tp.
                group = self._train_stages[0].group
                stages = [manual_stage(modules[s], s, self._num_stages, self._device, self._batch, group)
                          for s in modules]
            else:
                # Fresh stage objects: a schedule keeps per-stage communication state that
                # a forward-only run would overwrite for the training schedule.
                stages = [rewrap_stage(st, modules[st.stage_index]) for st in self._train_stages]
            if with_loss:
                loss = self._losses[key] = MicrobatchMeanLoss(self._loss_fn, self._n_microbatches, self._batch.io)
            else:  # without forward-only support a backward runs too: it needs a loss
                loss = None if self.forward_only else zero_loss
            self._schedules[key] = make_schedule(self._schedule, stages, self._n_microbatches, loss,
                                                 self._failures, self._device)
        return self._schedules[key]

    def run(self, stage_args: tuple, stage_kwargs: dict, stage_target: Any, *, training: bool,
            with_loss: bool, held: int | None = None) -> tuple[Any, list[torch.Tensor]]:
        """Forward every micro-batch without training; return the merged output and the losses.

        ``held``: the real micro-batches of a short last batch (the rest weigh nothing).
        """
        schedule = self._schedule_for(training=training, with_loss=with_loss)
        if with_loss:
            self._losses[(training, with_loss)].start(held or self._n_microbatches)
        losses: list[torch.Tensor] = []
        if self.forward_only:
            with torch.no_grad():
                # torch insists on a full list of losses whenever one is asked for.
                output = schedule.eval(*stage_args, target=stage_target, losses=losses if with_loss else None,
                                       **stage_kwargs)
            return output, losses
        params = {id(p): p for m in (*self._train_modules.values(), *self._eval.traced().values())
                  for p in m.parameters()}
        saved = [(p, p.grad) for p in params.values()]
        for p, _ in saved:
            p.grad = None
        try:
            # The backward needs autograd, also when the caller is inside torch.inference_mode():
            # its inputs are then inference tensors, which autograd may not save, hence copies.
            with torch.inference_mode(False), torch.enable_grad():
                stage_args, stage_kwargs, stage_target = tree_map(
                    _normal_tensor, (stage_args, stage_kwargs, stage_target))
                output = schedule.step(*stage_args, target=stage_target, losses=losses, **stage_kwargs)
        finally:
            for p, grad in saved:
                p.grad = grad
        return (output.detach() if isinstance(output, torch.Tensor) else output), losses

    def close(self) -> None:
        """Drop the schedules and stages: they hold the process group and the calls' buffers."""
        self._schedules = {}
        self._train_stages = []


def _normal_tensor(value: Any) -> Any:
    """An inference tensor copied outside inference mode (autograd can save it); anything else as it is."""
    return value.clone() if isinstance(value, torch.Tensor) and value.is_inference() else value
