"""How a call's batch reaches the stages: checked, sharded, placed, and agreed on by every rank."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.utils._pytree import tree_map

from ..planning.data_parallel import example_batch_size

from .compat import to_stage_device
from .distributed import raise_on_every_rank
from .materialize import check_written
from .model_io import TracedBatch
from .step_failures import StepFailures

class CallInputs:
    """This rank's view of the batches it is given (see the module's docstring)."""

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
        #: The micro-batches of the last call's batch that are real (fewer in a short last batch).
        self.real_microbatches = n_microbatches
        #: The last call's inputs' dimensions after the rows (``TracedBatch.micro_dims``), agreed by every rank.
        self.dims: tuple[int, ...] = batch.traced_dims

    def check_written(self, before: str = "the first step") -> None:
        """Raise while a meta-device model's tensors are still placeholders no init or load wrote."""
        if self.unwritten:  # loaded since construction, or still an error
            check_written(self.unwritten, before)
            self.unwritten = {}

    def refuse_placeholders(self, what: str, *, rank: int, world_size: int) -> None:
        """Every rank raises before ``what`` while some rank still holds a placeholder (collective)."""
        error: Exception | None = None
        try:
            self.check_written(before=f"you {what}")
        except Exception as e:  # noqa: BLE001 - raised below, on every rank
            error = e
        raise_on_every_rank(error, rank=rank, world_size=world_size, what=what)

    def open(self, call: str, args: tuple, kwargs: dict, target: Any, failures: StepFailures, *, rank: int,
             world_size: int, comm_device: torch.device) -> tuple[tuple, dict, Any]:
        """This rank's share of the batch, checked and placed, once every rank agreed to start ``call``."""
        error: BaseException | None = None
        placed: tuple[tuple, dict, Any] = ((), {}, None)
        held, target_rows, dims = 0, 0, (0,) * len(self.batch.traced_dims)
        try:
            self.check_written()
            # The batch is checked as given (a global batch whole), so a wrong size is named as the caller gave it.
            # Only the first stage reads the inputs and only the last the target: a rank without
            # them may be given nothing (pipe.step() on a middle rank).
            need_inputs = self.has_first_stage or bool(args) or bool(kwargs)
            need_target = call != "forward" and (self.has_last_stage or target is not None)
            try:
                # Another sequence length retraces the stages (runtime.shapes).
                held = self.batch.check(args, kwargs, target, need_target=need_target, need_inputs=need_inputs,
                                        replicas=self.data_parallel.batch_replicas if self.data_parallel else 1,
                                        any_length=True)
                if need_inputs:
                    dims = self.batch.micro_dims(args, kwargs)
                    self._check_fsdp_length(dims)
            except ValueError as e:
                dp = self.data_parallel
                if dp is None or dp.batch == "global":
                    raise
                raise ValueError(f"{e} (each rank is given its own replica's rows, one of dp={dp.dp_size} "
                                 "shards as a DistributedSampler yields them; for the global batch on every rank, "
                                 "use DataParallelOptions(batch='global'))") from None
            args, kwargs, target = self.shard(args, kwargs, target)
            target_rows = (example_batch_size(target, None) or 0) if need_target else 0
            placed = self.place(args, kwargs, self.placeholder_target() if target is None else target)
        except Exception as e:  # noqa: BLE001 - raised by agree_to_start, after every rank has heard of it
            error = e
        agreed, self.dims = failures.agree_to_start(
            call, error, rank=rank, world_size=world_size, device=comm_device, microbatches=held,
            target_rows=target_rows, dims=dims, pipelines=self.data_parallel.replicas if self.data_parallel else None)
        self.real_microbatches = agreed or self.n_microbatches
        if self.real_microbatches < self.n_microbatches:  # a short last batch: filled up, the rest weighs nothing
            placed = (_fill(placed[0], self.real_microbatches, self.n_microbatches), placed[1],
                      _fill(placed[2], self.real_microbatches, self.n_microbatches) if target is not None
                      else placed[2])
        return placed

    def _check_fsdp_length(self, dims: tuple[int, ...]) -> None:
        """FSDP shards the traced stages only: under it another length is refused."""
        if self.data_parallel is not None and self.data_parallel.mode == "fsdp" and dims != self.batch.traced_dims:
            raise ValueError(f"the batch's inputs have sizes {list(dims)} after the rows, but the pipeline was "
                             f"traced at {list(self.batch.traced_dims)}: FSDP shards the traced stages only, so "
                             "under data_parallel mode 'fsdp' every batch keeps the traced sizes (pad to them, or "
                             "use mode='replicate')")

    def trim(self, output: Any) -> Any:
        """The last call's merged output without the rows that filled up a short last batch."""
        held, n = self.real_microbatches, self.n_microbatches
        if held >= n:
            return output
        return tree_map(lambda t: t[: t.shape[0] * held // n] if isinstance(t, torch.Tensor) and t.dim() else t,
                        output)

    def shard(self, args: tuple, kwargs: dict, target: Any) -> tuple[tuple, dict, Any]:
        """This replica's rows of the batch given (all of it unless it is the global batch)."""
        if not self.data_parallel:
            return args, kwargs, target
        return self.data_parallel.shard((tuple(args), dict(kwargs), target), self.n_microbatches)

    def place(self, args: tuple, kwargs: dict, target: Any) -> tuple[tuple, dict, Any]:
        """Inputs go to the first stage's rank, targets to the last's, on their device."""
        stage_args: tuple = ()
        if self.has_first_stage:
            stage_args = tuple(to_stage_device(t, self.device) for t in self.batch.stage_inputs(args, kwargs))
        stage_target = None
        if self.has_last_stage and target is not None:
            stage_target = tree_map(lambda t: to_stage_device(t, self.device), target)
        return stage_args, {}, stage_target


def _fill(value: Any, held: int, n_microbatches: int) -> Any:
    """``value``'s ``held`` micro-batches followed by copies of its first, up to ``n_microbatches``.

    Example:
        >>> _fill((torch.arange(4),), 2, 4)
        (tensor([0, 1, 2, 3, 0, 1, 0, 1]),)
    """
    def fill(t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or t.dim() == 0:
            return t
        first = t[: t.shape[0] // held]
        return torch.cat([t, *([first] * (n_microbatches - held))])

    return tree_map(fill, value)
