"""How a call's batch reaches the stages: checked, sharded, placed, and agreed on by every rank.

Every ``step``, ``evaluate`` and ``forward`` of a :class:`~autopipe.runtime.pipeline.Pipeline`
opens here. The batch is checked as the caller gave it (the global batch under data
parallelism), this replica's rows are taken, and the first stage's inputs and the last
stage's target go to this rank's device. Then the ranks agree, in one all-reduce, that they
start the same call and that every rank's inputs passed
(:meth:`~autopipe.runtime.step_failures.StepFailures.agree_to_start`): a batch one rank
refuses is refused on every rank before any stage runs.

Example::

    inputs = CallInputs(built.batch, dp, n_microbatches=4, has_first_stage=True, has_last_stage=False,
                        device=torch.device("cpu"), placeholder_target=inference.placeholder_target)
    stage_args, stage_kwargs, stage_target = inputs.open("step", (x,), {}, y, failures, rank=0, world_size=2,
                                                         comm_device=torch.device("cpu"))
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.utils._pytree import tree_map

from .compat import to_stage_device
from .materialize import check_written
from .model_io import TracedBatch
from .step_failures import StepFailures

class CallInputs:
    """This rank's view of the batches it is given (see the module's docstring).

    Args:
        batch: the traced micro-batch batches are checked against.
        data_parallel: the :class:`~autopipe.runtime.data_parallel.DataParallel` layout, or None.
        n_microbatches: micro-batches per step.
        has_first_stage / has_last_stage: whether this rank feeds the inputs / the target.
        device: this rank's device.
        placeholder_target: what a call without a target passes (inference's stand-in).
        unwritten: tensors of a meta-device model still to be loaded before the first call.
    """

    def __init__(self, batch: TracedBatch, data_parallel: Any, *, n_microbatches: int, has_first_stage: bool,
                 has_last_stage: bool, device: torch.device, placeholder_target: Callable[[], Any],
                 unwritten: Mapping[str, torch.Tensor] | None = None) -> None:
        self.batch = batch
        self.data_parallel = data_parallel
        self.n_microbatches = n_microbatches
        self.has_first_stage = has_first_stage
        self.has_last_stage = has_last_stage
        self.device = device
        self.placeholder_target = placeholder_target
        self.unwritten = dict(unwritten or {})

    def open(self, call: str, args: tuple, kwargs: dict, target: Any, failures: StepFailures, *, rank: int,
             world_size: int, comm_device: torch.device) -> tuple[tuple, dict, Any]:
        """This rank's share of the batch, checked and placed, once every rank agreed to start ``call``.

        Collective. Raises on every rank when some rank's inputs failed a check: that rank
        its own error, the others :class:`~autopipe.errors.PipelineStepError`.
        """
        error: BaseException | None = None
        placed: tuple[tuple, dict, Any] = ((), {}, None)
        try:
            if self.unwritten:  # loaded since construction, or still an error
                check_written(self.unwritten)
                self.unwritten = {}
            # The global batch is checked, so a wrong size is named as the caller gave it.
            self.batch.check(args, kwargs, target, need_target=call != "forward",
                             replicas=self.data_parallel.dp_size if self.data_parallel else 1)
            args, kwargs, target = self.shard(args, kwargs, target)
            placed = self.place(args, kwargs, self.placeholder_target() if target is None else target)
        except Exception as e:  # noqa: BLE001 - raised by agree_to_start, after every rank has heard of it
            error = e
        failures.agree_to_start(call, error, rank=rank, world_size=world_size, device=comm_device)
        return placed

    def shard(self, args: tuple, kwargs: dict, target: Any) -> tuple[tuple, dict, Any]:
        """This replica's rows of the global batch (all of it without data parallelism)."""
        if not self.data_parallel:
            return args, kwargs, target
        return self.data_parallel.shard((tuple(args), dict(kwargs), target), self.n_microbatches)

    def place(self, args: tuple, kwargs: dict, target: Any) -> tuple[tuple, dict, Any]:
        """Inputs go to the first stage's rank, targets to the last's, on their device.

        The first stage takes the model's inputs flat and positional, in the traced order
        (:class:`~autopipe.runtime.model_io.ModelIO`): keyword inputs are matched by name,
        never by position.
        """
        stage_args: tuple = ()
        if self.has_first_stage:
            stage_args = tuple(to_stage_device(t, self.device) for t in self.batch.stage_inputs(args, kwargs))
        stage_target = None
        if self.has_last_stage and target is not None:
            stage_target = tree_map(lambda t: to_stage_device(t, self.device), target)
        return stage_args, {}, stage_target
