"""The drop-in pipeline: plan once, build this rank's stages with torch, step torch's schedule."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._pytree import tree_map

from .._checks import check_int
from ..machine.precision import mixed_precision_context
from ..planning.export_check import gradients_checked_later
from ..planning.options import BLOCK_RECOMPUTE, DataParallelOptions, PlannerOptions
from ..planning.plan import Plan
from ..planning.schedules import TRAINING_STEP_KWARGS, schedule_spec, stage_ranks
from .checkpointing import resolve_recompute
from .data_parallel import check_mesh_arguments, data_parallel_from_plan, full_tensor, prepare_replicas
from .call_inputs import CallInputs
from .distributed import DEFAULT_TIMEOUT_S, check_device, collective_device, default_device, init_distributed
from .inference import Inference
from .lifecycle import PipelineLifecycle
from .materialize import WeightSource, check_weight_arguments
from .pipeline_state import PipelineStateDicts
from .sharded_state import RankState
from .model_state import clip_grad_norm, grads_before, sum_shared_grads
from .placement import place_rank, rank_nodes, tensor_parallel_size
from .plan_setup import PlanRequest, check_model_and_inputs, check_ranks_agree_on_inputs, settle_plan
from .shapes import ShapeVariants
from .stage_timer import StageTimer, gather_stage_times
from .stage_schedule import MicrobatchMeanLoss, make_schedule
from .stages import build_rank_stages, compile_options
from .step_failures import agree_on_failures, share_loss
from .tensor_parallel import counts_once, sum_partial_gradients, tensor_parallel_context

class Pipeline(PipelineLifecycle, PipelineStateDicts):
    """A model split into pipeline stages across the ranks of a ``torch.distributed`` job.

    Every rank constructs the ``Pipeline`` with the same arguments; each builds only its
    own stage(s). The user's ``model`` is never modified: the pipeline traces and splits a
    private copy (so the host briefly holds the model twice).

    Args:
        model: the unsplit model (on the CPU, or on this rank's device).

    Keyword Args:
        example_args: positional inputs of ONE micro-batch, as a tuple (what
            ``pipeline()`` traces; a batch given to :meth:`step` is ``n_microbatches`` of
            these stacked along dimension 0). Default ``()`` when ``example_kwargs`` is
            given; both may be left out when the model carries its own example
            (``example_input_array``, or Hugging Face's ``dummy_inputs``).
        example_kwargs: keyword inputs of one micro-batch.
        example_target: one micro-batch's target, for the planner to cost ``loss_fn`` with;
            default: a target derived from the model's output
            (:func:`autopipe.planning.default_loss.pipeline_loss`; the plan's notes say when
            none can be).
        loss_fn: ``loss_fn(output, target) -> scalar`` for one micro-batch, averaging over
            it (as ``nn.CrossEntropyLoss()`` does). Needed by :meth:`step` and :meth:`evaluate`.
        plan: a :class:`~autopipe.planning.plan.Plan` or the path of a plan JSON file. Exclusive
            with ``split_points``.
        split_points: module names to cut before (``["layers.1"]``), to split by hand.
        schedule: ``"GPipe"``, ``"1F1B"``, ``"Interleaved1F1B"``, ``"LoopedBFS"``,
            ``"InterleavedZeroBubble"``, ``"ZBVZeroBubble"`` or ``"DualPipeV"`` (any case).
            Default: the plan's schedule, else ``"1F1B"``.
        n_microbatches: micro-batches per step. Default: the plan's, else
            ``2 * ranks`` for a hand split, else the planner's choice.
        planner: a :class:`~autopipe.planning.options.PlannerOptions`, the same value
            ``partition`` takes: the planner's settings when the pipeline plans (no ``plan``
            or ``split_points``; the profile runs on ``device`` unless
            ``profiling.device`` says otherwise, and in every rank at once when
            ``profiling.in_ranks`` allows), and for any split ``stages_per_rank`` (default:
            the plan's, else the schedule's) and ``recompute``: ``"auto"`` (default: the stages
            the plan recomputes, ``plan.recompute_stages``), False, True (every stage) or a
            list of stage indices; a checkpointed stage recomputes its forward in backward; or
            ``"full"`` / ``"selective"``: each block of the model's block lists instead.
        data_parallel: pipeline x data parallel: a replica count, or a
            :class:`~autopipe.planning.options.DataParallelOptions` with the count (``degree``:
            a ``(degree, world / degree)`` mesh is built, consecutive ranks forming a pipeline)
            or a 2-D ``DeviceMesh`` with dimensions ``"dp"`` and ``"pp"`` (``mesh``), and how
            the replicas reduce (``mode``: ``"fsdp"``, FSDP2 ``fully_shard`` per stage, or
            ``"replicate"``, whole parameters and gradients averaged by all-reduce). Each row
            along ``pp`` runs the whole pipeline on its replica's shard of the data, and every
            stage's gradients are reduced over ``dp`` (:mod:`~autopipe.runtime.data_parallel`).
            As in DDP, each rank is given its replica's rows (``batch="replica"``; a
            ``DistributedSampler(num_replicas=pipe.dp_size, rank=pipe.dp_rank)`` yields them),
            or with ``batch="global"`` every rank the whole global batch.
            Default: the plan's (a plan made with ``data_parallel=``), else none; a mode left
            None is the plan's, else ``"fsdp"``. ``DataParallelOptions(tensor_parallel=2)`` shards
            each stage over 2 ranks of a ``(pp, dp, tp)`` mesh (docs/training.md §15).
        weights: where the weights come from: a full state dict, ``.safetensors`` file or
            ``torch.distributed.checkpoint`` directory of the unsplit model (each rank reads
            only its own tensors), or, for a model built on the meta device, a function
            ``init(model)`` that initializes in place a private copy in which only this rank's
            tensors are real (the rest stay on meta). Default: the model's own values; on the
            meta device, each submodule's ``reset_parameters()`` (Hugging Face:
            ``_init_weights``) seeded by its name (:mod:`~autopipe.runtime.materialize`).
        device: where this rank runs; default CUDA ``LOCAL_RANK`` when present, else CPU.
        timeout_s: collective timeout when the pipeline creates the process group itself.

    Raises:
        TypeError / ValueError: for a bad argument (named in the message), a schedule name
            that does not exist (the message lists those that do), a world size that does
            not match the plan, or a plan whose split points the model lacks. Raised on
            every rank before any communication.
        ValueError: the ranks were given different models (parameter or buffer names,
            shapes, dtypes or tied weights; the message names the first difference). Raised
            on every rank before the model is traced. Values may differ: every copy of a
            parameter shared by several ranks is set to the copy of the rank using it first.
        RuntimeError: if no process group exists and torchrun's environment is missing.
        KeyError / ValueError: ``weights`` does not hold exactly the model's tensors (names
            it lacks or the model does not have, other shapes; named, on every rank,
            :mod:`~autopipe.runtime.materialize`). Tensors of a meta-device model left without
            a value are an ``UnwrittenTensorsError`` at the first step, unless loaded before.

    Example:
        >>> pipe = Pipeline(model, example_args=(x_mb,), loss_fn=loss_fn,  # doctest: +SKIP
        ...                 schedule="1F1B", n_microbatches=8)
        >>> loss = pipe.step(x, target=y)  # doctest: +SKIP
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        example_args: tuple[Any, ...] | None = None,
        example_kwargs: dict[str, Any] | None = None,
        example_target: Any = None,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
        plan: Plan | str | os.PathLike | None = None,
        split_points: Sequence[str] | None = None,
        schedule: str | None = None,
        n_microbatches: int | None = None,
        planner: PlannerOptions | None = None,
        data_parallel: int | DataParallelOptions | None = None,
        weights: WeightSource | Callable[[nn.Module], Any] | None = None,
        device: torch.device | str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        # ---- 1. everything that can be checked alone, before joining the job
        example_args, example_kwargs = check_model_and_inputs(model, example_args, example_kwargs, loss_fn)
        # A function initializes a meta-device model; anything else is read for its values.
        init_weights, weights = (weights, None) if callable(weights) else (None, weights)
        check_weight_arguments(model, init_weights, weights)
        request = PlanRequest.checked(model, plan=plan, split_points=split_points, schedule=schedule,
                                      n_microbatches=n_microbatches, planner=planner, example_target=example_target)
        replicas = DataParallelOptions.of(data_parallel)
        mesh = replicas.mesh
        dp_degree, dp_mode = data_parallel_from_plan(request.plan, mesh, replicas.degree, replicas.mode)
        check_mesh_arguments(mesh, dp_degree, dp_mode)
        for option in ("loss_parallel", "sequence_parallel"):
            if getattr(replicas, option) and tensor_parallel_size(mesh, replicas.tensor_parallel) < 2:
                raise ValueError(f"data_parallel=DataParallelOptions({option}=True) shards over the tensor-parallel "
                                 "ranks: give tensor_parallel= of 2 or more (or a mesh with a 'tp' dimension)")

        if device is not None:
            check_device(device)
        # ---- 2. the job: rank, world size, device
        self.rank, self.world_size = init_distributed(timeout_s=timeout_s)
        self._start_lifecycle()
        if device is not None:
            self.device = torch.device(device)
        else:  # gloo cannot send CUDA tensors point to point: a gloo job runs on the CPU
            self.device = default_device() if dist.get_backend() == "nccl" else torch.device("cpu")
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # NCCL collectives use the current device
        check_ranks_agree_on_inputs(example_args, example_kwargs, self.world_size)

        place = place_rank(mesh, dp_degree, dp_mode, replicas.tensor_parallel, world_size=self.world_size, rank=self.rank,
                           device_type=self._comm_device().type, batch=replicas.batch)
        #: The data-parallel layout (:class:`~autopipe.runtime.data_parallel.DataParallel`), None for a pure pipeline.
        self.data_parallel = dp = place.dp
        #: This rank's place in its pipeline (its rank when there is no data or tensor parallelism).
        self.pp_rank: int = place.pp_rank
        #: This rank's replica and the replica count (0 and 1 without data parallelism): what a
        #: ``DistributedSampler(dataset, num_replicas=pipe.dp_size, rank=pipe.dp_rank)`` needs.
        self.dp_rank: int = dp.dp_rank if dp else 0
        self.dp_size: int = dp.dp_size if dp else 1
        #: This rank's place in its tensor-parallel group, and the group's size (0 and 1 without one).
        self.tp_rank, self.tp_size = place.tp_rank, place.tp_size
        #: Whether the output layer is sharded along the vocabulary, its logits given to ``loss_fn`` so.
        self.loss_parallel: bool = replicas.loss_parallel
        #: Whether norms and residual adds run on sequence shards (Megatron-LM's sequence parallelism).
        self.sequence_parallel: bool = replicas.sequence_parallel
        #: Every rank's node and mesh coordinates under tensor parallelism (``placement.rank_nodes``), else None.
        self.rank_nodes = rank_nodes(place.mesh) if place.tp_mesh is not None else None

        # ---- 3. one plan and schedule for all ranks (the traced gradients are checked in step 4, on every rank)
        with gradients_checked_later():
            layout = settle_plan(request, model, example_args, example_kwargs, loss_fn, rank=self.rank,
                                 world_size=self.world_size, device=self.device, comm_device=self._comm_device(),
                                 pp_size=None if place.pipelines is None else place.pp_size,
                                 mesh_given=mesh is not None)
        self.plan: Plan = layout.plan
        self.schedule: str = layout.schedule
        self.n_microbatches: int = layout.n_microbatches
        self.stages_per_rank: int = layout.stages_per_rank
        self.num_stages: int = layout.plan.num_stages
        #: ``stage_ranks[s]`` is the (pp) rank that runs stage ``s``.
        self.stage_ranks: list[int] = stage_ranks(self.schedule, layout.n_ranks, self.stages_per_rank)
        #: The stages this rank runs, in pipeline order.
        self.stage_indices: list[int] = [s for s, r in enumerate(self.stage_ranks) if r == self.pp_rank]
        self.has_first_stage: bool = 0 in self.stage_indices
        self.has_last_stage: bool = self.num_stages - 1 in self.stage_indices
        self.training: bool = model.training
        self._loss_fn = loss_fn
        #: ``"bf16"`` or ``"fp16"``: every step, evaluation and forward runs under ``torch.autocast``.
        self.mixed_precision: str | None = request.planner.mixed_precision or self.plan.mixed_precision or None

        compiled = compile_options(request.planner.compile)
        if compiled is not None and schedule_spec(self.schedule).split_backward:  # the same on every rank
            raise ValueError(f"planner.compile with schedule={self.schedule!r}: torch's split backward (input "
                             "gradients, then weight gradients) cannot split a compiled stage's backward; compile "
                             "with GPipe, 1F1B, Interleaved1F1B or LoopedBFS")

        recompute = request.planner.recompute
        if recompute == "selective" and schedule_spec(self.schedule).split_backward:  # the same on every rank
            raise ValueError(f"planner.recompute='selective' with schedule={self.schedule!r}: torch's selective "
                             "checkpointing allows one backward per region, and this schedule splits it (input "
                             "gradients, then weight gradients); use 'full', or GPipe, 1F1B, Interleaved1F1B or "
                             "LoopedBFS")
        # ---- 4. build this rank's stages from a private copy of the model
        built = build_rank_stages(
            model, self.plan, schedule=self.schedule, n_microbatches=self.n_microbatches,
            stage_ranks=self.stage_ranks, rank=self.rank, world_size=self.world_size, device=self.device,
            example=(tuple(example_args), dict(example_kwargs or {})), training=self.training,
            checkpointed=resolve_recompute(recompute, self.num_stages, self.plan.recompute_stages),
            block_mode=recompute if recompute in BLOCK_RECOMPUTE else "none",
            init_weights=init_weights, weights=weights, pp_rank=self.pp_rank,
            replicas=place.pipelines, pp_group=place.pp_group, mixed_precision=self.mixed_precision,
            compile_options=compiled, tp_mesh=place.tp_mesh, loss_parallel=replicas.loss_parallel,
            sequence_parallel=replicas.sequence_parallel)
        if dp:
            prepare_replicas(dp, built, self.schedule, self.mixed_precision)
        self._batch = built.batch
        self._names = built.names
        self._train_modules = built.train_modules
        self._eval = built.eval
        self._train_stages = built.train_stages
        self._state = built.state
        self._use_leaves = built.use_leaves
        self._shared = built.shared
        self._grad_norm_rank = built.grad_norm_rank
        self._unheld_state = built.unheld_state
        # What state dicts and checkpoints read and write (runtime/sharded_state.py).
        self._local = RankState(built.names, built.state, built.unheld_state, self.rank, self.world_size)
        self._train_schedule = None
        self._train_loss = MicrobatchMeanLoss(loss_fn, self.n_microbatches, built.batch.io)
        if loss_fn is not None:
            self._train_schedule = make_schedule(self.schedule, self._train_stages, self.n_microbatches,
                                                 self._train_loss, self._failures, self.device)
        self._inference = Inference(built, num_stages=self.num_stages, schedule=self.schedule,
                                    n_microbatches=self.n_microbatches, loss_fn=loss_fn, failures=self._failures,
                                    device=self.device)
        self._shapes = ShapeVariants(built, schedule=self.schedule, num_stages=self.num_stages,
                                     n_microbatches=self.n_microbatches, train_loss=self._train_loss, loss_fn=loss_fn,
                                     failures=self._failures, device=self.device, rank=self.pp_rank,
                                     world_size=place.pp_size, group=place.pp_group)
        self._inputs = CallInputs(built.batch, dp, n_microbatches=self.n_microbatches,
                                  has_first_stage=self.has_first_stage, has_last_stage=self.has_last_stage,
                                  device=self.device, placeholder_target=self._inference.placeholder_target,
                                  unwritten=built.unwritten)

    def _autocast(self) -> Any:
        """The pipeline's mixed precision and tensor parallelism around a schedule's run (nothing without them)."""
        stack = contextlib.ExitStack()
        if self.tp_size > 1:
            stack.enter_context(tensor_parallel_context(self.device, loss_parallel=self.loss_parallel))
        stack.enter_context(mixed_precision_context(self.mixed_precision, self.device))
        return stack

    def _comm_device(self) -> torch.device:
        return collective_device(self.device)

    # ------------------------------------------------------------------ running
    def step(self, *args: Any, target: Any = None, **kwargs: Any) -> torch.Tensor:
        """Run one training step (forward and backward of every micro-batch); return the mean loss.

        Every rank calls it. Only the rank that runs the first stage reads the inputs and
        only the one that runs the last stage reads the target, so the others may be given
        nothing (a rank that is given them checks them). Gradients accumulate into the local
        stages' parameters as with ``loss.backward()``; call the optimizer afterwards.

        Args:
            *args: the model's positional inputs for the whole batch
                (``n_microbatches`` micro-batches stacked along dimension 0).
            target: what ``loss_fn`` compares the output with, for the whole batch.
            **kwargs: the model's keyword inputs for the whole batch.

        Returns:
            The mean of the micro-batches' losses, a detached scalar tensor, on every rank.

        Raises:
            ValueError: if the batch does not split into ``n_microbatches`` micro-batches
                shaped like ``example_args``, or ``target`` is missing or not a tensor (before
                any stage runs; the other ranks then raise PipelineStepError).
            RuntimeError: if the pipeline has no ``loss_fn``, is in eval mode, is closed, or
                cannot run again after an error that could not be played through, or the
                ranks are out of step (they called different methods).
            PipelineStepError: on every rank, when a stage's forward or ``loss_fn`` raised
                on some rank in this step, or some rank refused its inputs
                (:mod:`~autopipe.runtime.step_failures`); the next step runs normally.

        Example:
            >>> opt.zero_grad(); loss = pipe.step(x, target=y); opt.step()  # doctest: +SKIP
        """
        self._check_usable()
        if self._train_schedule is None:
            raise RuntimeError("step() trains and needs a loss; construct the Pipeline with loss_fn=...")
        if not self.training:
            raise RuntimeError("step() trains, but the pipeline is in eval mode; call pipe.train() first")
        stage_args, stage_kwargs, stage_target = self._open("step", args, kwargs, target)
        before = grads_before(self._shared, self._state)
        for _, leaf in self._use_leaves:  # a failed step's per-use gradients belong to no step
            leaf.grad = None
        losses: list[torch.Tensor] = []
        self._train_loss.start(self._inputs.real_microbatches)
        schedule, _ = self._at_shape()
        with self._failures.guard("step", self.rank), self._autocast():
            schedule.step(*stage_args, target=stage_target, losses=losses, **TRAINING_STEP_KWARGS, **stage_kwargs)
            loss = self._share_loss(losses)  # also tells every rank whether any rank failed
        if self.sequence_parallel:  # a norm's weight read sequence shards: each rank holds a part
            sum_partial_gradients(self.parameters())
        # Every copy of a parameter shared by stages or ranks gets the sum of their gradients.
        sum_shared_grads(self._shared, self._state, self._use_leaves, before)
        if self.data_parallel and self.data_parallel.mode == "replicate":
            self.data_parallel.average_grads(self.parameters())
        return loss

    def measure_stage_times(self, *args: Any, target: Any, steps: int = 3, **kwargs: Any) -> dict[str, list[float]]:
        """Time every stage's forward and backward inside running training steps, for ``Plan.calibrate``.

        A profile times each piece of the model alone in one process; inside a running
        pipeline the same stage can take longer (the other ranks compute, the communication
        threads and the kernel take their share of the cores; docs/costs-and-measurement.md).
        This runs ``steps`` training steps on the batch, times the calls torch's schedule
        makes on each stage (forward, backward, and the weight-gradient part where the
        schedule splits it; :mod:`~autopipe.runtime.stage_timer`), and returns the mean per
        micro-batch. Every rank must call it with the same batch (it is collective), and
        every rank gets every stage's times. The parameters' gradients are left as they were.

        Args:
            *args, **kwargs: the model's inputs for the whole batch, as for :meth:`step`.
            target: what ``loss_fn`` compares the output with.
            steps: training steps to time, >= 1 (one more runs first, untimed).

        Returns:
            ``{"fwd_s": [...], "bwd_s": [...]}``, one value per stage, in seconds: the
            input :meth:`autopipe.Plan.calibrate` takes.

        Raises:
            ValueError: ``steps`` is not a positive integer, or the batch does not split
                into the micro-batches (before any communication).

        Example:
            >>> measured = pipe.measure_stage_times(x, target=y)  # doctest: +SKIP
            >>> print(pipe.plan.calibrate(measured).predicted_step_s)  # doctest: +SKIP
        """
        check_int("steps", steps, what="training steps to time")
        if self._train_schedule is None:
            raise RuntimeError("measure_stage_times() trains and needs a loss; construct the Pipeline with loss_fn=...")
        self._batch.check(*self._inputs.shard(args, kwargs, target), need_target=True)
        saved = [(p, p.grad) for p in self.parameters()]
        try:
            with StageTimer(self._train_stages, self.device) as timer:
                self.zero_grad()
                self.step(*args, target=target, **kwargs)  # the first step sets up buffers: untimed
                timer.clear()
                for _ in range(steps):
                    # As a training loop does: the first micro-batch's backward then creates each
                    # .grad and the others add into it, as the plan charges (SegmentCost.step_bwd_s).
                    self.zero_grad()
                    self.step(*args, target=target, **kwargs)
        finally:
            for p, grad in saved:
                p.grad = grad
        return gather_stage_times(timer.means(), self.world_size)

    def evaluate(self, *args: Any, target: Any = None, **kwargs: Any) -> torch.Tensor:
        """Forward only, in the current mode; return the mean loss on every rank.

        Args:
            *args, **kwargs: the model's inputs for the whole batch (needed only on the rank
                that runs the first stage).
            target: what ``loss_fn`` compares the output with (needed only on the rank that
                runs the last stage).

        Returns:
            The mean micro-batch loss, a scalar tensor, on every rank.

        Raises:
            ValueError: for a batch that does not split into the micro-batches.
            RuntimeError: if the pipeline has no ``loss_fn``.

        Example:
            >>> pipe.eval(); val_loss = pipe.evaluate(x, target=y)  # doctest: +SKIP
        """
        self._check_usable()
        if self._loss_fn is None:
            raise RuntimeError("evaluate() needs a loss; construct the Pipeline with loss_fn=...")
        placed = self._open("evaluate", args, kwargs, target)
        with self._failures.guard("evaluate", self.rank), self._autocast():
            _, losses = self._at_shape()[1].run(*placed, training=self.training, with_loss=True,
                                            held=self._inputs.real_microbatches)
            return self._share_loss(losses)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Inference in the current mode: the merged output on the last stage's rank.

        With ZBVZeroBubble and DualPipeV, which torch cannot run forward-only, this costs a
        backward pass too (gradients are left as they were; :mod:`~autopipe.runtime.inference`).

        Args:
            *args, **kwargs: the model's inputs for the whole batch.

        Returns:
            The model's output for the whole batch (detached) on the rank that runs the
            last stage, None on the other ranks.

        Raises:
            ValueError: for a batch that does not split into the micro-batches.

        Example:
            >>> pipe.eval(); logits = pipe(x)  # doctest: +SKIP
        """
        self._check_usable()
        placed = self._open("forward", args, kwargs, None)
        with self._failures.guard("forward", self.rank), self._autocast():
            output, _ = self._at_shape()[1].run(*placed, training=self.training, with_loss=False)
            agree_on_failures(self._failures, rank=self.rank, world_size=self.world_size, device=self._comm_device())
        if not self.has_last_stage:
            return None
        return self._batch.io.unflatten_output(tree_map(full_tensor, self._inputs.trim(output)))

    __call__ = forward

    def _at_shape(self) -> tuple[Any, Inference]:
        """The training schedule and inference for the shape the call opened with (runtime.shapes)."""
        found = self._shapes.at(self._inputs.dims, self.training)
        return (self._train_schedule, self._inference) if found is None else (found.train_schedule, found.inference)

    def _share_loss(self, losses: list[torch.Tensor]) -> torch.Tensor:
        """The mean loss on every rank; every rank raises if a rank failed (step_failures.share_loss)."""
        losses = [full_tensor(loss) for loss in losses]  # a loss of sharded logits is a DTensor
        if self.dp_size * self.tp_size > 1:  # each replica's last stage (every tp rank of it) adds its mean
            losses = [loss / (self.dp_size * self.tp_size) for loss in losses]
        return share_loss(losses, self._failures, rank=self.rank, world_size=self.world_size,
                          has_last_stage=self.has_last_stage, device=self._comm_device())

    def _open(self, call: str, args: tuple, kwargs: dict, target: Any) -> tuple[tuple, dict, Any]:
        """This rank's share of the batch, placed, once every rank agreed to start ``call`` (collective)."""
        return self._inputs.open(call, args, kwargs, target, self._failures, rank=self.rank,
                                 world_size=self.world_size, comm_device=self._comm_device())

    # ------------------------------------------------------------------ nn.Module-like surface
    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """This rank's parameters under the original model's names (one entry per tensor).

        Returns:
            ``[(name, parameter), ...]`` in pipeline order.

        Example:
            >>> dict(pipe.named_parameters())["layers.1.ffn.fc1.weight"]  # doctest: +SKIP
        """
        return [(n, t) for n, t in self._state.items() if n in self._names.parameter_names]

    def parameters(self) -> list[nn.Parameter]:
        """This rank's parameters, each once: hand them to the optimizer.

        Example:
            >>> opt = torch.optim.AdamW(pipe.parameters())  # doctest: +SKIP
        """
        return [p for _, p in self.named_parameters()]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients of this rank's parameters, as ``nn.Module.zero_grad``."""
        for _, leaf in self._use_leaves:  # normally empty already (model_state.sum_shared_grads)
            leaf.grad = None
        for p in self.parameters():
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, *,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """Clip the gradients of the whole pipeline by their global norm, as ``torch.nn.utils.clip_grad_norm_``.

        ``clip_grad_norm_(pipe.parameters(), ...)`` would see only this rank's parameters:
        its norm is per rank, and every rank would clip by a different factor. This computes
        the norm over every rank's gradients at once (one all-reduce), counting a parameter
        shared by several stages or ranks (a tied embedding) once, and scales every local
        gradient by the same factor ``min(1, max_norm / (norm + 1e-6))``. Collective: every
        rank calls it, after :meth:`step` and before the optimizer step.

        Args:
            max_norm: the largest global norm the gradients may have, > 0.
            norm_type: the p of the p-norm, > 0, or ``float("inf")`` for the largest
                absolute value.

        Keyword Args:
            error_if_nonfinite: raise (on every rank) when the global norm is nan or inf.

        Returns:
            The global norm of the gradients before clipping, a scalar tensor, the same on
            every rank.

        Raises:
            ValueError: ``max_norm`` or ``norm_type`` out of range (before communication).
            RuntimeError: ``error_if_nonfinite`` and the norm is not finite.

        Example:
            >>> loss = pipe.step(x, target=y)  # doctest: +SKIP
            >>> norm = pipe.clip_grad_norm_(1.0); opt.step()  # doctest: +SKIP
        """
        # A gradient held whole by several replicas or tp ranks counts once; shards count all.
        coords = {"dp": self.dp_rank, "tp": self.tp_rank}
        return clip_grad_norm(self.named_parameters(), self._grad_norm_rank, rank=self.pp_rank, max_norm=max_norm,
                              norm_type=norm_type, error_if_nonfinite=error_if_nonfinite, device=self._comm_device(),
                              counts=lambda p: counts_once(p, coords))

    def train(self, mode: bool = True) -> "Pipeline":
        """Switch to training (``mode=True``) or evaluation behaviour; returns the pipeline.

        Example:
            >>> pipe.train()  # doctest: +SKIP
        """
        if not isinstance(mode, bool):
            raise TypeError(f"mode must be a bool, got {mode!r}")
        self.training = mode
        for module in self._train_modules.values():
            module.train(mode)
        return self

    def eval(self) -> "Pipeline":
        """Switch to evaluation behaviour (no dropout, frozen batch-norm statistics).

        Example:
            >>> pipe.eval(); logits = pipe(x)  # doctest: +SKIP
        """
        return self.train(False)

    @property
    def stage_modules(self) -> dict[int, nn.Module]:
        """This rank's stage modules (training trace), by stage index."""
        return dict(self._train_modules)

    def __repr__(self) -> str:
        place = ""
        if self.rank_nodes is not None:  # where tensor parallelism placed this rank
            mine = self.rank_nodes[self.rank]
            place = f", pp {mine['pp']} dp {mine['dp']} tp {mine['tp']} of tp={self.tp_size} on {mine['node']}"
        return (f"Pipeline(rank {self.rank}/{self.world_size}{place}, stages {self.stage_indices} of "
                f"{self.num_stages}, split at {self.plan.split_points}, {self.schedule} x"
                f"{self.n_microbatches} micro-batches, device {self.device})")
