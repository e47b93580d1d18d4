"""The drop-in pipeline: plan once, build this rank's stages with torch, step torch's schedule.

A training loop changes in two lines and runs under ``torchrun`` (or ``autopipe run``)::

    with autopipe.Pipeline(model, example_args=(x_mb,), loss_fn=loss_fn,
                           schedule="1F1B", n_microbatches=8) as pipe:
        opt = torch.optim.AdamW(pipe.parameters())
        for x, y in loader:
            opt.zero_grad(); loss = pipe.step(x, target=y); opt.step()

What happens, on every rank:

1. **Plan.** The split comes from a :class:`~autopipe.planning.plan.Plan` (an object or a JSON
   file), from ``split_points`` given by hand, or from :func:`autopipe.planning.planner.partition`
   run once on rank 0 and broadcast - so timings measured differently on each rank can
   never give two ranks different splits.
2. **Build.** ``torch.distributed.pipelining.pipeline()`` cuts a private copy of the model
   at the plan's split points; this rank keeps its stage(s): one for GPipe and 1F1B,
   ``stages_per_rank`` looped (stage ``s`` on rank ``s % ranks``) for Interleaved1F1B,
   LoopedBFS and InterleavedZeroBubble, two in a V for ZBVZeroBubble and DualPipeV.
3. **Step.** torch's schedule class runs the micro-batches; autopipe only adds what a
   drop-in needs: the mean loss on every rank, gradients of parameters shared by stages
   on several ranks (tied embeddings) summed across them, original parameter names, and
   clear errors before any communication.
"""

from __future__ import annotations

import atexit
import copy
import hashlib
import inspect
import math
import os
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage, SplitPoint, pipeline
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from ..planning import hf_compat
from ..errors import PipelineStepError
from ..planning.inplace import clone_inputs_written_in_place
from ..planning.plan import Plan, StagePlan
from ..planning.schedules import (SPLIT_BACKWARD_SCHEDULES, canonical_schedule_name, schedule_class, stage_ranks,
                         validate_schedule)
from ..planning.trace import resolve_example_inputs
from .checkpointing import checkpoint_stage, resolve_checkpoint_stages
from .distributed import (DEFAULT_TIMEOUT_S, broadcast_object, default_device, hold_process_group, init_distributed,
                          release_process_group)
from .step_failures import PlayThroughLoss, StepFailures, one_line, play_through_forward
from .model_io import ModelIO, capture_export
from .relay import relay_skip_connections
from .torch_compat import rename_nodes_shadowing_self, safe_submodule_outlining
from .params import (StateNames, first_model_difference, first_use_ranks, model_signature, model_state_names,
                     shared_parameters, stage_aliases, stage_state, used_attribute_names)

__all__ = ["Pipeline"]

# Schedules that run exactly one stage per rank (torch's PipelineScheduleSingle).
_SINGLE_STAGE_SCHEDULES = ("GPipe", "1F1B")
# Schedules that place a rank's two stages in a V (rank r: stages r and 2 * ranks - 1 - r).
# torch's Pipe.build_stage wires each stage's peers for the looped placement, so these get
# a manual PipelineStage, which learns its peers from the schedule.
_V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")


class Pipeline:
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
        loss_fn: ``loss_fn(output, target) -> scalar`` for one micro-batch, averaging over
            it (as ``nn.CrossEntropyLoss()`` does). Needed by :meth:`step` and :meth:`evaluate`.
        plan: a :class:`~autopipe.planning.plan.Plan` or the path of a plan JSON file. Exclusive
            with ``split_points``.
        split_points: module names to cut before (``["layers.1"]``), to split by hand.
        n_stages: number of pipeline ranks; must equal the world size (the default).
        schedule: ``"GPipe"``, ``"1F1B"``, ``"Interleaved1F1B"``, ``"LoopedBFS"``,
            ``"InterleavedZeroBubble"``, ``"ZBVZeroBubble"`` or ``"DualPipeV"`` (any case).
            Default: the plan's schedule, else ``"1F1B"``.
        n_microbatches: micro-batches per step. Default: the plan's, else
            ``2 * n_stages`` for a hand split, else the planner's choice.
        stages_per_rank: stages held by each rank. Default: the plan's, else 1 for GPipe
            and 1F1B and 2 for the multi-stage schedules.
        checkpoint_stages: activation checkpointing: False, True (every stage) or a list of
            stage indices; a checkpointed stage recomputes its forward during backward.
        device: where this rank runs; default CUDA ``LOCAL_RANK`` when present, else CPU.
        timeout_s: collective timeout when the pipeline creates the process group itself.
        planner_options: extra keyword arguments for :func:`autopipe.planning.planner.partition`;
            with ``example_target`` (one micro-batch's target) the planner also charges
            ``loss_fn``'s time and saved bytes to the last stage.
        profile_in_ranks: when the pipeline plans (no ``plan`` or ``split_points``): True has
            every rank profile the model at once (:func:`autopipe.profile_in_ranks`) and rank
            0 plan from the mean of their profiles; False has rank 0 profile alone while the
            others wait. The default (None) profiles in the ranks when the world has more
            than one rank and ``planner_options`` bring no costs of their own (``costs``,
            ``scaling``, ``devices`` with their speeds, or an estimated ``cost``). Ranks
            sharing a host compete for memory bandwidth and caches, which a profile taken
            alone does not see (docs/training.md section 3). ``warmup`` / ``repeats`` /
            ``flush_cache`` / ``fit_to_whole`` in ``planner_options`` go to that profile
            (default: the planner's, as many rounds as rank 0 alone would profile).

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
        loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
        plan: Plan | str | os.PathLike | None = None,
        split_points: Sequence[str] | None = None,
        n_stages: int | None = None,
        schedule: str | None = None,
        n_microbatches: int | None = None,
        stages_per_rank: int | None = None,
        checkpoint_stages: bool | Sequence[int] = False,
        device: torch.device | str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        planner_options: Mapping[str, Any] | None = None,
        profile_in_ranks: bool | None = None,
    ) -> None:
        # ---- 1. everything that can be checked alone, before joining the job
        example_args, example_kwargs = _check_model_and_inputs(model, example_args, example_kwargs, loss_fn)
        plan = _load_plan(plan, split_points)
        split_points = _check_split_points(model, split_points if plan is None else plan.split_points,
                                           "split_points" if plan is None else "plan.split_points")
        for arg, value in (("n_stages", n_stages), ("n_microbatches", n_microbatches),
                           ("stages_per_rank", stages_per_rank)):
            if value is not None:
                _check_count(arg, value)
        if schedule is not None:
            schedule = canonical_schedule_name(schedule)  # lists the valid names when unknown
        if planner_options is not None and not isinstance(planner_options, Mapping):
            raise TypeError(f"planner_options must be a dict of keyword arguments, got {planner_options!r}")
        if profile_in_ranks is not None and not isinstance(profile_in_ranks, bool):
            raise ValueError(f"profile_in_ranks={profile_in_ranks!r} must be True, False or None (profile in the "
                             f"ranks when the pipeline plans for several ranks)")
        if profile_in_ranks and (plan is not None or split_points is not None):
            raise ValueError("profile_in_ranks=True profiles for the planner, but a plan or split_points was "
                             "given: there is nothing to plan; drop one of them")
        if profile_in_ranks and planner_options and "costs" in planner_options:
            raise ValueError("profile_in_ranks=True measures the costs; planner_options has costs= already: "
                             "drop one of them")

        # ---- 2. the job: rank, world size, device
        self.rank, self.world_size = init_distributed(timeout_s=timeout_s)
        self._start_lifecycle()
        if device is not None:
            self.device = torch.device(device)
        else:  # gloo cannot send CUDA tensors point to point: a gloo job runs on the CPU
            self.device = default_device() if dist.get_backend() == "nccl" else torch.device("cpu")
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # NCCL collectives use the current device

        # ---- 3. settings every rank derives from its own arguments (no communication)
        if plan is not None:
            schedule = schedule or canonical_schedule_name(plan.schedule)
            n_microbatches = n_microbatches or plan.n_microbatches
            stages_per_rank = stages_per_rank or plan.stages_per_rank
            if plan.num_stages % stages_per_rank:
                raise ValueError(
                    f"the plan has {plan.num_stages} stages, which is not a multiple of "
                    f"stages_per_rank={stages_per_rank}"
                )
            n_ranks = plan.num_stages // stages_per_rank
            if n_stages is not None and n_stages != n_ranks:
                raise ValueError(
                    f"n_stages={n_stages} but the plan runs {plan.num_stages} stages at "
                    f"{stages_per_rank} per rank, i.e. on {n_ranks} ranks"
                )
        else:
            schedule = schedule or "1F1B"
            n_ranks = n_stages if n_stages is not None else self.world_size
            stages_per_rank = stages_per_rank or (1 if schedule in _SINGLE_STAGE_SCHEDULES else 2)
            if split_points is not None:
                n_microbatches = n_microbatches or 2 * n_ranks
                if len(split_points) + 1 != n_ranks * stages_per_rank:
                    raise ValueError(
                        f"split_points={list(split_points)} make {len(split_points) + 1} stages, but "
                        f"{n_ranks} ranks x stages_per_rank={stages_per_rank} need "
                        f"{n_ranks * stages_per_rank} (give {n_ranks * stages_per_rank - 1} split points)"
                    )
        if n_ranks != self.world_size:
            raise ValueError(
                f"the pipeline needs {n_ranks} ranks ({'the plan' if plan is not None else 'n_stages'}: "
                f"{n_ranks * stages_per_rank} stages, {stages_per_rank} per rank) but the world "
                f"has {self.world_size} processes; launch with --nproc {n_ranks}"
            )
        if n_microbatches is not None:
            validate_schedule(schedule, n_ranks, n_microbatches, stages_per_rank)
        if plan is None and split_points is not None:
            plan = _plan_from_split_points(split_points, schedule, n_microbatches, stages_per_rank)

        # ---- 4. one plan for all ranks
        if plan is None:
            options = dict(planner_options or {})
            if "example_target" in options and loss_fn is not None:  # the loss is charged to the last stage
                options.setdefault("loss_fn", loss_fn)
            if profile_in_ranks is None:
                profile_in_ranks = _profile_in_ranks_by_default(self.world_size, options)
            if profile_in_ranks:  # every rank at once, before rank 0 plans from their mean
                from ..planning.rank_profile import profile_in_ranks as profile_together

                options["costs"] = profile_together(model, example_args, example_kwargs,
                                                    device=options.get("device", self.device),
                                                    **_rank_profile_settings(options))
            plan = self._plan_on_rank0(model, example_args, example_kwargs, n_ranks, schedule,
                                       n_microbatches, stages_per_rank, options)
            n_microbatches = n_microbatches or plan.n_microbatches
            validate_schedule(schedule, n_ranks, n_microbatches, plan.stages_per_rank)
            if plan.num_stages != n_ranks * stages_per_rank:
                raise ValueError(
                    f"the planner returned {plan.num_stages} stages; {n_ranks} ranks x "
                    f"stages_per_rank={stages_per_rank} need {n_ranks * stages_per_rank}"
                )
        else:
            self._check_ranks_agree(plan, schedule, n_microbatches, stages_per_rank)

        self.plan: Plan = plan
        self.schedule: str = schedule
        self.n_microbatches: int = n_microbatches
        self.stages_per_rank: int = stages_per_rank
        self.num_stages: int = plan.num_stages
        #: ``stage_ranks[s]`` is the rank that runs stage ``s``.
        self.stage_ranks: list[int] = stage_ranks(schedule, n_ranks, stages_per_rank)
        #: The stages this rank runs, in pipeline order.
        self.stage_indices: list[int] = [s for s, r in enumerate(self.stage_ranks) if r == self.rank]
        self.has_first_stage: bool = 0 in self.stage_indices
        self.has_last_stage: bool = self.num_stages - 1 in self.stage_indices
        self.training: bool = model.training
        self._loss_fn = loss_fn
        self._example = (tuple(example_args), dict(example_kwargs or {}))
        checkpointed = resolve_checkpoint_stages(checkpoint_stages, self.num_stages)

        # ---- 5. build this rank's stages from a private copy of the model
        self._build(model, checkpointed)

    # ------------------------------------------------------------------ building
    def _plan_on_rank0(self, model, example_args, example_kwargs, n_ranks, schedule,
                       n_microbatches, stages_per_rank, options) -> Plan:
        """Rank 0 runs the planner; every rank receives its plan, or its error."""
        outcome: tuple[str, Any] | None = None
        if self.rank == 0:
            try:
                from ..planning.planner import partition  # the planner is optional until it is installed

                options.setdefault("device", self.device)  # measure where the stages will run
                found = partition(model, n_ranks, example_args=example_args, example_kwargs=example_kwargs,
                                  schedule=schedule, n_microbatches=n_microbatches,
                                  stages_per_rank=stages_per_rank, **options)
                outcome = ("ok", found.to_dict())
            except Exception as e:  # noqa: BLE001 - re-raised below, on every rank
                error = e
                outcome = ("error", f"{type(e).__name__}: {e}")
        outcome = broadcast_object(outcome, src=0, device=self._comm_device())
        if outcome[0] == "error":
            if self.rank == 0:
                raise error
            raise RuntimeError(f"planning failed on rank 0, so no rank can build its stages: {outcome[1]}")
        return Plan.from_dict(outcome[1])

    def _gather_digests(self, value: Any) -> list[str]:
        """Every rank's SHA-256 of ``repr(value)``, in rank order (collective): a cheap way to
        learn whether the ranks agree without sending the values themselves."""
        digests: list[Any] = [None] * self.world_size
        dist.all_gather_object(digests, hashlib.sha256(repr(value).encode()).hexdigest())
        return digests

    def _check_ranks_agree(self, plan: Plan, schedule: str, n_microbatches: int, stages_per_rank: int) -> None:
        """Every rank must run the same split and schedule; otherwise all raise the same error."""
        digests = self._gather_digests((plan.split_points, plan.num_stages, schedule, n_microbatches,
                                        stages_per_rank))
        if len(set(digests)) > 1:
            groups = {d: [r for r, x in enumerate(digests) if x == d] for d in set(digests)}
            raise ValueError(
                f"ranks were given different plans or settings (split points, schedule, "
                f"n_microbatches, stages_per_rank); ranks agreeing with each other: "
                f"{sorted(groups.values())}. Give every rank the same plan file."
            )

    def _build(self, model: nn.Module, checkpointed: list[int]) -> None:
        # Before anything is traced: ranks with different models would split differently and
        # disagree on the shared parameters' process groups.
        self._check_same_model(model)
        local_model = copy.deepcopy(model)
        # The copy is private, so a Hugging Face KV cache simply stays off: it is no trainable
        # output and cannot leave a stage (autopipe.planning.hf_compat; the planner's report says so).
        hf_compat.turn_off_cache(local_model)
        self._example = (self._example[0], hf_compat.training_kwargs(local_model, self._example[1])[0])
        self._names: StateNames = model_state_names(local_model)
        split_spec = {name: SplitPoint.BEGINNING for name in self.plan.split_points}
        train_pipe = _split(local_model, split_spec, self._example, training=True, expected=self.num_stages)
        self._io: ModelIO = train_pipe.autopipe_io
        # The traced micro-batch, flattened as the first stage takes it, and a name for each
        # input: what every batch is checked against.
        self._example_inputs: list[Any] = self._io.flatten_inputs(*self._example)
        self._input_labels: list[str] = self._io.input_labels(*self._example)
        eval_pipe = None
        if _has_mode_dependent_modules(local_model):
            # torch.export bakes train/eval behaviour (dropout, batch-norm statistics) into the
            # graph, so inference in eval mode needs its own trace over the same tensors.
            eval_pipe = _split(local_model, split_spec, self._example, training=False, expected=self.num_stages)

        # What each stage uses, under the original names: every rank computes it for every
        # stage, so all ranks agree on which parameters are shared and by whom.
        all_states = [stage_state(train_pipe.get_stage_module(s), self._names) for s in range(self.num_stages)]
        held = set().union(*all_states)
        # Tensors no stage reads (unused modules) still belong in a full checkpoint.
        self._unheld_state: dict[str, torch.Tensor] = {}
        for key in self._names.state_dict_keys:
            canon = self._names.canonical.get(key, key)
            if canon not in held:
                tensor = (local_model.get_parameter(canon) if canon in self._names.parameter_names
                          else local_model.get_buffer(canon))
                self._unheld_state[canon] = tensor.detach().cpu().clone()

        self._train_modules, self._train_stages = self._build_local_stages(train_pipe)
        self._split_backward = self.schedule in SPLIT_BACKWARD_SCHEDULES
        self._state = self._share_local_replicas()
        self._eval_modules = self._train_modules
        if eval_pipe is not None:
            self._eval_modules = self._build_eval_modules(eval_pipe)
        for s in checkpointed:
            if s in self._train_modules:
                checkpoint_stage(self._train_modules[s])
        for module in {id(m): m for m in (*self._train_modules.values(), *self._eval_modules.values())}.values():
            _guard_stage_boundaries(module, fresh_outputs=self.schedule in SPLIT_BACKWARD_SCHEDULES)
        if self.schedule in _V_SCHEDULES:
            self._train_stages = [self._manual_stage(s, self._train_modules[s]) for s in self.stage_indices]
        for module in self._train_modules.values():
            module.train(self.training)

        # Parameters held on several ranks: their gradients are summed after each backward.
        # new_group is collective: every rank creates every group, in the same order.
        self._shared: list[tuple[list[str], Any]] = []
        stage_params = [[c for c in st if c in self._names.parameter_names] for st in all_states]
        for ranks, names in shared_parameters(stage_params, self.stage_ranks):
            group = None if len(ranks) == self.world_size else dist.new_group(list(ranks))
            if self.rank in ranks:
                self._shared.append((names, group))
        # Each rank built its own model, so the copies start equal only if every rank seeded
        # alike; summed gradients keep them equal only if they start so.
        #: The rank where each parameter is first used: its copy counts in the global gradient norm.
        self._grad_norm_rank: dict[str, int] = first_use_ranks(stage_params, self.stage_ranks)
        self._copy_shared_from_first_use(self._grad_norm_rank)

        # Whether torch can run this schedule forward-only (schedule.eval), for inference.
        self._forward_only = self.schedule not in _V_SCHEDULES and hasattr(schedule_class(self.schedule), "eval")
        self._train_schedule = None
        if self._loss_fn is not None:
            self._train_schedule = self._make_schedule(self._train_stages, _MicrobatchMeanLoss(self._loss_fn, self.n_microbatches, self._io))
        self._inference: dict[tuple[bool, bool], Any] = {}  # (training, with_loss) -> schedule

    def _build_local_stages(self, pipe) -> tuple[dict[int, nn.Module], list]:
        """This rank's stage modules, on its device (build_stage also rewrites device constants)."""
        modules: dict[int, nn.Module] = {}
        stages = []
        for s in self.stage_indices:
            built = pipe.build_stage(s, self.device)
            modules[s] = built.submod
            stages.append(built)
        return modules, stages

    def _share_local_replicas(self) -> dict[str, torch.Tensor]:
        """One tensor per original name on this rank, by canonical name.

        ``pipeline()`` gives a tied parameter one copy per name a stage used (T5's decoder
        embedding and output layer: two in one stage) and one per stage using it (V
        schedules put the first and the last stage on rank 0). Every such name in every
        local stage is pointed at the first copy, so autograd accumulates all of the uses'
        gradients into one ``.grad``, the optimizer sees the parameter once and the copies
        can never drift apart.

        Schedules that split the backward compute weight gradients with torch's
        ``stage_backward_weight``, which fails ("backward through the graph a second time")
        on a Parameter used at two places of one stage's graph with other weights between
        them. There a stage's second and later names of a parameter get a Parameter of
        their own over the same memory (so values stay equal); their gradients are added to
        the first's after each step (:meth:`_sum_shared_grads`). They are kept in
        ``self._use_leaves`` as ``(canonical name, Parameter)``.
        """
        state: dict[str, torch.Tensor] = {}
        self._use_leaves: list[tuple[str, nn.Parameter]] = []
        for s in self.stage_indices:
            module = self._train_modules[s]
            for canon, (_, tensor) in stage_state(module, self._names).items():
                state.setdefault(canon, tensor)
            self._use_leaves += _tie_aliases(module, self._names, state, leaf_per_use=self._split_backward)
        return state

    def _build_eval_modules(self, eval_pipe) -> dict[int, nn.Module]:
        """The eval-mode trace of this rank's stages, reading the training stages' tensors (every alias)."""
        modules: dict[int, nn.Module] = {}
        for s in self.stage_indices:
            module = eval_pipe.build_stage(s, self.device).submod
            missing = sorted(set(stage_state(module, self._names)) - set(self._state))
            if missing:
                raise RuntimeError(f"stage {s}'s eval-mode trace reads {missing}, which its training trace "
                                   f"does not; autopipe cannot share them between the two traces")
            # Inference with a V schedule runs a backward too (see _run_inference), hence leaf_per_use.
            _tie_aliases(module, self._names, self._state, leaf_per_use=self._split_backward)
            modules[s] = module.eval()
        return modules

    def _check_same_model(self, model: nn.Module) -> None:
        """Every rank must have been given the same model: names, shapes, dtypes and ties.

        Collective. One digest per rank is gathered; only when they differ are the full
        signatures gathered, to name the first difference in the error every rank raises.

        Example:
            >>> self._check_same_model(model)  # doctest: +SKIP
            ValueError: the ranks were given different models (...): 'lm_head.weight': rank 0 has a
            parameter of shape (32, 16), dtype torch.float32, tied to 'shared.weight'; rank 1 has ...
        """
        signature = model_signature(model)
        if len(set(self._gather_digests(signature))) == 1:
            return
        signatures: list[Any] = [None] * self.world_size
        dist.all_gather_object(signatures, signature)  # every rank saw the digests differ
        difference = first_model_difference(signatures) or "the models' signatures differ"
        raise ValueError(
            f"the ranks were given different models (parameter and buffer names, shapes, dtypes or tied "
            f"weights): {difference}. Every rank must build the same model; its values may differ "
            f"(shared copies are taken from the rank that uses them first)"
        )

    @torch.no_grad()
    def _copy_shared_from_first_use(self, first_use: Mapping[str, int]) -> None:
        """Give every copy of a parameter shared across ranks the value of the rank that uses it first.

        The rank of first use runs the lowest-numbered stage using the parameter.
        Broadcast over each shared set's own process group, in ``self._shared``'s order
        (the same on every member), one flat tensor per source rank.

        Example:
            >>> # ZBV on 2 ranks, a weight read by stages 1 (rank 1) and 3 (rank 0): rank 1's wins
            >>> self._copy_shared_from_first_use({"layers.1.weight": 1})  # doctest: +SKIP
        """
        for names, group in self._shared:
            by_source: dict[int, list[str]] = {}
            for name in names:
                by_source.setdefault(first_use[name], []).append(name)
            for source in sorted(by_source):
                params = [self._state[n] for n in by_source[source]]
                flat = torch.cat([p.detach().reshape(-1) for p in params])
                dist.broadcast(flat, src=source, group=group)
                offset = 0
                for p in params:
                    p.copy_(flat[offset: offset + p.numel()].view_as(p))
                    offset += p.numel()

    def _manual_stage(self, stage_index: int, module: nn.Module) -> PipelineStage:
        # PipelineStage asks its schedule which rank runs each neighbour, so V placement works.
        # It is given the traced shapes of what it receives and sends: without them torch
        # infers them by running the stage on uninitialised tensors, and an integer input
        # (token or position ids crossing a cut) then indexes out of range.
        first_inputs = tuple(self._io.stage_inputs(*self._example)) if stage_index == 0 else None
        inputs, outputs = _static_stage_meta(module, first_inputs)
        return _VStage(module, stage_index, self.num_stages, self.device, input_args=inputs, output_args=outputs)

    def _make_schedule(self, stages: list, loss_fn: Callable | None):
        cls = schedule_class(self.schedule)
        # A stage's forward or the loss that raises plays the step through (step_failures),
        # so that no rank waits for it at a receive.
        for stage in stages:
            play_through_forward(stage.submod, self._failures, stage.stage_index, self.device)
        if loss_fn is not None:
            loss_fn = PlayThroughLoss(loss_fn, self._failures)
        kwargs: dict[str, Any] = {"loss_fn": loss_fn}
        # The loss is already divided by n_microbatches (see _MicrobatchMeanLoss), so torch
        # must not divide the gradients again - its division would also hit gradients
        # accumulated over earlier steps.
        if "scale_grads" in inspect.signature(cls.__init__).parameters:
            kwargs["scale_grads"] = False
        first = stages[0] if self.schedule in _SINGLE_STAGE_SCHEDULES else stages
        return cls(first, self.n_microbatches, **kwargs)

    def _inference_schedule(self, *, with_loss: bool):
        """The schedule that runs inference in the current mode, built on first use."""
        key = (self.training, with_loss)
        if key not in self._inference:
            modules = self._train_modules if self.training else self._eval_modules
            if self.schedule in _V_SCHEDULES:
                stages = [self._manual_stage(s, modules[s]) for s in self.stage_indices]
            else:
                # Fresh stage objects: a schedule keeps per-stage communication state that
                # a forward-only run would overwrite for the training schedule.
                stages = [_rewrap_stage(st, modules[st.stage_index]) for st in self._train_stages]
            if with_loss:
                loss = _MicrobatchMeanLoss(self._loss_fn, self.n_microbatches, self._io)
            else:  # see _run_inference: without forward-only support a backward runs too
                loss = None if self._forward_only else _zero_loss
            self._inference[key] = self._make_schedule(stages, loss)
        return self._inference[key]

    def _run_inference(self, args: tuple, kwargs: dict, target: Any, *, with_loss: bool) -> tuple[Any, list]:
        """Forward every micro-batch without training; return the merged output and the losses."""
        schedule = self._inference_schedule(with_loss=with_loss)
        if target is None and not self._forward_only:
            target = torch.zeros(self.n_microbatches)  # what _zero_loss ignores, one per micro-batch
        stage_args, stage_kwargs, stage_target = self._place(args, kwargs, target)
        losses: list[torch.Tensor] = []
        if self._forward_only:
            with torch.no_grad():
                # torch insists on a full list of losses whenever one is asked for.
                output = schedule.eval(*stage_args, target=stage_target, losses=losses if with_loss else None,
                                       **stage_kwargs)
            return output, losses
        # torch's ZBVZeroBubble and DualPipeV run their backward actions even in eval() and
        # fail there, and no forward-only torch schedule places stages in a V (older torch
        # has no eval() at all). So inference runs a training step of the same schedule and
        # puts every gradient back as it was: correct, at the price of a backward pass.
        params = {id(p): p for m in (*self._train_modules.values(), *self._eval_modules.values())
                  for p in m.parameters()}
        saved = [(p, p.grad) for p in params.values()]
        for p, _ in saved:
            p.grad = None
        try:
            with torch.enable_grad():
                output = schedule.step(*stage_args, target=stage_target, losses=losses, **stage_kwargs)
        finally:
            for p, grad in saved:
                p.grad = grad
        return (output.detach() if isinstance(output, torch.Tensor) else output), losses

    def _comm_device(self) -> torch.device:
        return self.device if dist.get_backend() == "nccl" else torch.device("cpu")

    # ------------------------------------------------------------------ running
    def step(self, *args: Any, target: Any = None, **kwargs: Any) -> torch.Tensor:
        """Run one training step (forward and backward of every micro-batch); return the mean loss.

        Every rank calls it with the same batch. Gradients accumulate into the local
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
                shaped like ``example_args``, or ``target`` is missing (before any
                communication).
            RuntimeError: if the pipeline has no ``loss_fn``, is in eval mode, is closed, or
                cannot run again after an error that could not be played through.
            PipelineStepError: on every rank, when a stage's forward or ``loss_fn`` raised
                on some rank in this step (:mod:`~autopipe.runtime.step_failures`); the next
                step runs normally.

        Example:
            >>> opt.zero_grad(); loss = pipe.step(x, target=y); opt.step()  # doctest: +SKIP
        """
        self._check_usable()
        if self._train_schedule is None:
            raise RuntimeError("step() trains and needs a loss; construct the Pipeline with loss_fn=...")
        if not self.training:
            raise RuntimeError("step() trains, but the pipeline is in eval mode; call pipe.train() first")
        self._check_batch(args, kwargs, target, need_target=True)
        before = [[self._state[n].grad.clone() if self._state[n].grad is not None else None for n in names]
                  for names, _ in self._shared]
        losses: list[torch.Tensor] = []
        stage_args, stage_kwargs, stage_target = self._place(args, kwargs, target)
        with self._step_guard("step"):
            self._train_schedule.step(*stage_args, target=stage_target, losses=losses, **stage_kwargs)
            loss = self._share_loss(losses)  # also tells every rank whether any rank failed
        self._sum_shared_grads(before)
        return loss

    def measure_stage_times(self, *args: Any, target: Any, steps: int = 3, **kwargs: Any) -> dict[str, list[float]]:
        """Time every stage's forward and backward inside running training steps, for ``Plan.calibrate``.

        A profile times each piece of the model alone in one process; inside a running
        pipeline the same stage can take longer (the other ranks compute, the communication
        threads and the kernel take their share of the cores), by 10-15% on a shared CPU host
        (docs/costs-and-measurement.md). This runs ``steps`` training steps on the batch,
        times the calls torch's schedule makes on each stage (forward, backward, and the
        weight-gradient part where the schedule splits it), and returns the mean per
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
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"steps={steps!r} must be an integer >= 1 (training steps to time)")
        if self._train_schedule is None:
            raise RuntimeError("measure_stage_times() trains and needs a loss; construct the Pipeline with loss_fn=...")
        self._check_batch(args, kwargs, target, need_target=True)
        from ..planning.profile import Timer, per_run_s

        timer = Timer(self.device)
        saved = [(p, p.grad) for p in self.parameters()]
        times: dict[int, dict[str, list[float]]] = {}
        patched = []
        for stage in self._train_stages:
            rec = times.setdefault(stage.stage_index, {"F": [], "B": [], "W": []})
            for method, key in (("forward_one_chunk", "F"), ("backward_one_chunk", "B"),
                                ("backward_weight_one_chunk", "W")):
                original = getattr(stage, method, None)
                if original is None:
                    continue

                def timed(*a: Any, _original: Any = original, _into: list = rec[key], **k: Any) -> Any:
                    seconds, result = timer.time(lambda: _original(*a, **k))  # GPU: the work, not its launch
                    _into.append(seconds)
                    return result

                setattr(stage, method, timed)  # an instance attribute shadows the method
                patched.append((stage, method))
        try:
            self.zero_grad()
            self.step(*args, target=target, **kwargs)  # the first step sets up buffers: untimed
            for rec in times.values():
                for values in rec.values():
                    values.clear()
            for _ in range(steps):
                # As a training loop does: the first micro-batch's backward then creates each
                # .grad and the others add into it, as the plan charges (SegmentCost.step_bwd_s).
                self.zero_grad()
                self.step(*args, target=target, **kwargs)
        finally:
            for stage, method in patched:
                delattr(stage, method)
            for p, grad in saved:
                p.grad = grad
        # The mean per call, as the profile keeps (a step adds the calls up; profile.per_run_s).
        local = {s: (per_run_s(r["F"]) if r["F"] else 0.0,
                     (per_run_s(r["B"]) if r["B"] else 0.0) + (per_run_s(r["W"]) if r["W"] else 0.0))
                 for s, r in times.items()}
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, local)
        every = {s: v for part in gathered for s, v in part.items()}
        n_stages = len(self.stage_ranks)
        return {"fwd_s": [every[s][0] for s in range(n_stages)], "bwd_s": [every[s][1] for s in range(n_stages)]}

    def evaluate(self, *args: Any, target: Any, **kwargs: Any) -> torch.Tensor:
        """Forward only, in the current mode; return the mean loss on every rank.

        Args:
            *args, **kwargs: the model's inputs for the whole batch.
            target: what ``loss_fn`` compares the output with.

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
        self._check_batch(args, kwargs, target, need_target=True)
        with self._step_guard("evaluate"):
            _, losses = self._run_inference(args, kwargs, target, with_loss=True)
            return self._share_loss(losses)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Inference in the current mode: the merged output on the last stage's rank.

        With ZBVZeroBubble and DualPipeV, which torch cannot run forward-only, this costs a
        backward pass too (gradients are left as they were).

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
        self._check_batch(args, kwargs, None, need_target=False)
        with self._step_guard("forward"):
            output, _ = self._run_inference(args, kwargs, None, with_loss=False)
            self._agree_on_failures()
        return self._io.unflatten_output(output) if self.has_last_stage else None

    __call__ = forward

    def _as_traced(self, kwargs: dict) -> dict:
        """``kwargs`` with ``use_cache=True`` read as False where the pipeline traced a Hugging Face
        model with its KV cache off (:mod:`autopipe.planning.hf_compat`): it trains without a cache."""
        if kwargs.get("use_cache") is True and self._example[1].get("use_cache") is False:
            return {**kwargs, "use_cache": False}
        return dict(kwargs)

    def _check_batch(self, args: tuple, kwargs: dict, target: Any, *, need_target: bool) -> None:
        """Each rank checks the batch it was given, so a bad batch fails everywhere, silently nowhere."""
        m = self.n_microbatches
        if len(args) != len(self._example[0]):
            raise ValueError(f"the batch has {len(args)} positional inputs, but the pipeline was traced with "
                             f"{len(self._example[0])}")
        # Flattened the way the first stage takes them: keywords matched by name (a missing
        # or unknown keyword is named by flatten_inputs).
        given = self._io.flatten_inputs(tuple(args), self._as_traced(kwargs))
        for label, x, ex in zip(self._input_labels, given, self._example_inputs):
            if not isinstance(ex, torch.Tensor):
                # torch.export bakes a non-tensor input into the graph as the traced value:
                # another value would be silently ignored.
                if x is not ex and x != ex:
                    raise ValueError(f"input {label}={x!r}, but the pipeline was traced with {ex!r}; a "
                                     f"non-tensor input is fixed at tracing, so build the pipeline with this value")
                continue
            if not isinstance(x, torch.Tensor):
                raise ValueError(f"input {label} is a {type(x).__name__}, but the pipeline was traced with a tensor")
            if x.dtype != ex.dtype:
                raise ValueError(f"input {label} has dtype {x.dtype}, but the pipeline was traced with {ex.dtype}; "
                                 f"convert the batch (e.g. x.to({ex.dtype})) or trace with that dtype")
            if ex.dim() == 0:
                continue
            expected = (ex.shape[0] * m, *ex.shape[1:])
            if tuple(x.shape) != expected:
                raise ValueError(
                    f"input {label} of the batch has shape {tuple(x.shape)}, which does not split into "
                    f"n_microbatches={m} micro-batches shaped like the example {tuple(ex.shape)}; "
                    f"pass a batch of shape {expected}"
                )
        if need_target:
            if target is None:
                raise ValueError("target=None: pass target=... for loss_fn(output, target)")
            for t in tree_flatten(target)[0]:
                if isinstance(t, torch.Tensor) and (t.dim() == 0 or t.shape[0] % m):
                    raise ValueError(
                        f"target has shape {tuple(t.shape)}, whose first dimension does not split "
                        f"into n_microbatches={m} equal micro-batches"
                    )

    def _place(self, args: tuple, kwargs: dict, target: Any) -> tuple[tuple, dict, Any]:
        """Inputs go to the first stage's rank, targets to the last's, on their device.

        The first stage takes the model's inputs flat and positional, in the traced order
        (:class:`~autopipe.runtime.model_io.ModelIO`): keyword inputs are matched by name,
        never by position.

        Tensors are made contiguous: ``torch.export`` records contiguous strides for the
        stage inputs, and some torch releases (2.11) check a micro-batch's strides against
        them (a batch sliced from a wider tensor, ``data[:, :-1]``, would fail there).
        """
        def to_device(t):
            return t.to(self.device, non_blocking=True).contiguous() if isinstance(t, torch.Tensor) else t
        stage_args, stage_kwargs = ((), {})
        if self.has_first_stage:
            stage_args = tuple(to_device(t) for t in self._io.stage_inputs(tuple(args), self._as_traced(kwargs)))
        stage_target = tree_map(to_device, target) if self.has_last_stage and target is not None else None
        return stage_args, stage_kwargs, stage_target

    def _share_loss(self, losses: list[torch.Tensor]) -> torch.Tensor:
        """Sum of the (already divided) micro-batch losses, sent from the last stage to all ranks.

        Returned in the loss's own dtype on every rank: the value travels as float64 (exact
        for every floating dtype a loss has) beside a code for its dtype, since only the last
        stage's rank knows it. The sum is taken in at least float32, as before the division.

        The same message carries one flag per rank: did its stages or the loss fail in this
        step (:mod:`~autopipe.runtime.step_failures`)? It is summed over the ranks, the other
        ranks adding zeros to the loss and its code, so every rank learns both at once; if
        any rank failed, every rank raises :class:`~autopipe.errors.PipelineStepError`.
        """
        device = self._comm_device()
        message = torch.zeros(2 + self.world_size, dtype=torch.float64, device=device)
        message[2 + self.rank] = float(self._failures.failed)
        if self.has_last_stage and losses:
            dtype = losses[0].dtype
            if dtype in _LOSS_DTYPES:
                total = torch.stack([l.detach().to(torch.promote_types(dtype, torch.float32)) for l in losses]).sum()
                message[0] = total.to(device=device, dtype=torch.float64)
                message[1] = _LOSS_DTYPES.index(dtype)
            else:  # every rank raises below, none waits for a loss that will not come
                message[1] = -1
        dist.all_reduce(message)
        self._failures.settled = True
        self._raise_if_a_rank_failed(message[2:])
        code = int(message[1].item())
        if code < 0:
            raise TypeError(f"loss_fn returned a loss that is not floating point; a training loss is one "
                            f"of {list(_LOSS_DTYPES)}")
        return message[0].to(_LOSS_DTYPES[code])

    def _sum_shared_grads(self, before: list[list[torch.Tensor | None]]) -> None:
        """Sum this step's gradients of every copy of a shared parameter: on this rank, then across ranks.

        The per-use Parameters of split-backward schedules (:meth:`_share_local_replicas`)
        add their gradients to their parameter's and drop them. Then parameters held on
        several ranks are summed across those ranks; only the step's own contribution is
        summed (gradient minus what was there before), so gradients accumulated over
        several steps stay right.
        """
        _fold_use_leaf_grads(self._use_leaves, self._state)
        for (names, group), previous in zip(self._shared, before):
            params = [self._state[n] for n in names]
            deltas = []
            for p, prev in zip(params, previous):
                g = p.grad if p.grad is not None else torch.zeros_like(p)
                deltas.append((g - prev if prev is not None else g).reshape(-1))
            flat = torch.cat(deltas)
            dist.all_reduce(flat, group=group)
            offset = 0
            for p, prev in zip(params, previous):
                chunk = flat[offset: offset + p.numel()].view_as(p)
                offset += p.numel()
                p.grad = chunk.clone() if prev is None else prev + chunk

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
        for _, leaf in self._use_leaves:  # normally empty already (see _sum_shared_grads)
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
        for arg, value in (("max_norm", max_norm), ("norm_type", norm_type)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{arg}={value!r} must be a number > 0 (norm_type may be float('inf'))")
        if not math.isfinite(max_norm):
            raise ValueError(f"max_norm={max_norm!r} must be finite")
        norm_type = float(norm_type)
        # Each parameter is counted on one rank only: where it is first used (its copies on
        # other ranks hold the same, summed gradient after step()).
        counted = [p.grad for name, p in self.named_parameters()
                   if p.grad is not None and self._grad_norm_rank.get(name, self.rank) == self.rank]
        device = self._comm_device()
        if norm_type == math.inf:
            local = max((g.detach().abs().max().double() for g in counted), default=torch.zeros((), dtype=torch.float64))
            total = local.to(device).reshape(1)
            dist.all_reduce(total, op=dist.ReduceOp.MAX)
            total = total[0]
        else:
            local = sum((torch.linalg.vector_norm(g.detach(), norm_type).double() ** norm_type for g in counted),
                        torch.zeros((), dtype=torch.float64))
            total = local.to(device).reshape(1)
            dist.all_reduce(total)
            total = total[0] ** (1.0 / norm_type)
        if error_if_nonfinite and not torch.isfinite(total):
            raise RuntimeError(f"the global {norm_type}-norm of the gradients is {total.item()}; "
                               f"error_if_nonfinite=True refuses to clip by it")
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for p in self.parameters():
            if p.grad is not None:
                p.grad.detach().mul_(coef.to(device=p.grad.device, dtype=p.grad.dtype))
        dtype = counted[0].dtype if counted else torch.float32
        return total.to(dtype)

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

    # ------------------------------------------------------------------ state dicts
    def state_dict(self, *, full: bool = False) -> dict[str, torch.Tensor]:
        """The parameters and persistent buffers under the original model's names.

        Args:
            full: False: this rank's tensors only (save one file per rank). True: the whole
                model, gathered to every rank on the CPU, with every key of the unsplit
                model's ``state_dict()`` (tied aliases included) - load it with
                ``model.load_state_dict``. Collective: every rank must call it.

        Returns:
            ``{name: tensor}``; the local form holds detached views of the live tensors,
            the full form CPU copies.

        Example:
            >>> model.load_state_dict(pipe.state_dict(full=True))  # doctest: +SKIP
        """
        local = {n: t.detach() for n, t in self._state.items() if n in self._names.canonical}
        if not full:
            return local
        gathered: list[dict[str, torch.Tensor] | None] = [None] * self.world_size
        dist.all_gather_object(gathered, {n: t.cpu().clone() for n, t in local.items()})
        merged: dict[str, torch.Tensor] = dict(self._unheld_state)
        for part in gathered:
            for n, t in part.items():
                merged.setdefault(n, t)
        return {key: merged[self._names.canonical.get(key, key)] for key in self._names.state_dict_keys}

    @torch.no_grad()
    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor], *, strict: bool = True) -> None:
        """Copy values into this rank's parameters and buffers from a full or per-rank state dict.

        Keys are the original model's names; any alias of a tied tensor will do. Each rank
        takes what it holds and ignores the rest, so the same full dict can be given to
        every rank. No communication.

        Args:
            state_dict: ``model.state_dict()`` of the unsplit model, ``pipe.state_dict(full=True)``
                or this rank's ``pipe.state_dict()``.
            strict: raise if a tensor of this rank is missing or a key is not a name of the
                model.

        Raises:
            KeyError: (strict) names missing or unknown, listed.
            ValueError: a shape differs from the model's.

        Example:
            >>> pipe.load_state_dict(torch.load("model.pt"))  # doctest: +SKIP
        """
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"state_dict must be a mapping of names to tensors, got {type(state_dict).__name__}")
        unknown = sorted(k for k in state_dict if k not in self._names.canonical)
        by_canon: dict[str, torch.Tensor] = {}
        for key, value in state_dict.items():
            if key in self._names.canonical:
                by_canon.setdefault(self._names.canonical[key], value)
        missing = sorted(n for n in self._state if n not in by_canon)
        if strict and (unknown or missing):
            raise KeyError(f"load_state_dict(strict=True): missing names {missing}, unknown names {unknown}")
        for name, tensor in self._state.items():
            if name in by_canon:
                value = by_canon[name]
                if tuple(value.shape) != tuple(tensor.shape):
                    raise ValueError(f"{name!r} has shape {tuple(value.shape)} in state_dict but "
                                     f"{tuple(tensor.shape)} in the model")
                tensor.copy_(value)

    # ------------------------------------------------------------------ failed steps and closing
    def _start_lifecycle(self) -> None:
        """State for failed steps and :meth:`close`; makes interpreter exit call :meth:`close`.

        The exit hook holds the pipeline only weakly, so an unreferenced pipeline is still
        garbage-collected (its hook is then dropped too).
        """
        self._closed = False
        self._broken: str | None = None  # why the pipeline cannot run again, once it cannot
        self._calls: dict[str, int] = {}  # step/evaluate/forward -> calls so far, for messages
        self._failures = StepFailures()
        # The default process group, when autopipe created it, is destroyed when the last
        # pipeline holding it closes.
        self._holds_group = hold_process_group(self)
        ref = weakref.ref(self)

        def close_at_exit() -> None:
            pipe = ref()
            if pipe is not None:
                pipe.close()

        self._close_at_exit = close_at_exit
        atexit.register(close_at_exit)
        weakref.finalize(self, atexit.unregister, close_at_exit).atexit = False

    def close(self) -> None:
        """Release what the pipeline holds for communication; safe to call again.

        Drops the schedules and stages, destroys the process groups the pipeline created for
        parameters shared across ranks, and destroys the default process group if autopipe
        created it (no group existed when the first pipeline was built) and no other open
        pipeline uses it. A group the user created is left alone. Every rank must close its
        pipeline (as every rank built it). Called at interpreter exit for a pipeline still
        open; a ``with Pipeline(...) as pipe:`` block calls it at its end.

        Destroying the group before the interpreter shuts down is what lets a finished run
        exit cleanly: gloo's worker threads release the last collective's tensors after the
        call returned, and a thread that does so once shutdown has begun aborts the process.

        After ``close()`` the parameters, :meth:`state_dict` (this rank's) and
        :meth:`load_state_dict` still work; :meth:`step`, :meth:`evaluate` and
        :meth:`forward` raise ``RuntimeError``.

        Example:
            >>> with Pipeline(model, example_args=(x_mb,), loss_fn=loss_fn) as pipe:  # doctest: +SKIP
            ...     for x, y in loader:
            ...         opt.zero_grad(); pipe.step(x, target=y); opt.step()
            >>> pipe.close()  # closed already: nothing happens  # doctest: +SKIP
        """
        if getattr(self, "_closed", True):
            return
        self._closed = True
        atexit.unregister(self._close_at_exit)
        # The schedules and stages hold the process group and the step's buffers; a gloo
        # group joins its threads only once nothing refers to it any more.
        self._train_schedule = None
        self._inference = {}
        self._train_stages = []
        # getattr: a constructor that raised after joining the job leaves no _shared behind.
        shared = getattr(self, "_shared", [])
        groups = [group for _, group in shared if group is not None]
        self._shared = [(names, None) for names, _ in shared]
        for group in groups:
            try:
                dist.destroy_process_group(group)
            except (ValueError, RuntimeError):  # the user destroyed every group already
                pass
        del groups
        if self._holds_group:
            self._holds_group = False
            release_process_group(self)

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran."""
        return getattr(self, "_closed", False)

    def __enter__(self) -> "Pipeline":
        """``with Pipeline(...) as pipe:`` closes the pipeline when the block ends.

        Example:
            >>> with Pipeline(model, example_args=(x_mb,), loss_fn=loss_fn) as pipe:  # doctest: +SKIP
            ...     loss = pipe.step(x, target=y)
        """
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def _check_usable(self) -> None:
        """Raise if the pipeline was closed, or a failed step left it unable to run."""
        if self.closed:
            raise RuntimeError("the pipeline is closed (close() or the end of its with-block): build a new "
                               "Pipeline to run more steps")
        if self._broken is not None:
            raise RuntimeError(self._broken)

    @contextmanager
    def _step_guard(self, call: str) -> Iterator[None]:
        """Run one step, evaluation or forward call so that a failure cannot strand the other ranks.

        Inside, a stage's forward or the loss that raises plays the step through
        (:mod:`~autopipe.runtime.step_failures`), and the step's closing collective makes
        every rank raise :class:`~autopipe.errors.PipelineStepError`; the pipeline stays
        usable. Any other error that leaves this rank's schedule before that collective (a
        backward, torch's communication) leaves the ranks' messages unpaired: the pipeline
        then refuses to run again, saying why, instead of failing later with an unrelated error.
        """
        n = self._calls[call] = self._calls.get(call, 0) + 1
        self._failures.start(f"{call}() call {n}")
        try:
            yield
        except BaseException as e:
            if not self._failures.settled:
                self._broken = (
                    f"this pipeline cannot run again: {call}() call {n} raised {one_line(e)} on rank "
                    f"{self.rank} outside a stage's forward and the loss (in a backward, or in torch's schedule "
                    f"or communication), where it cannot be played through; this rank left the schedule while "
                    f"the other ranks may still wait for it (until it exits or timeout_s passes). Restart the "
                    f"job, or build a new Pipeline on every rank"
                )
            raise
        finally:
            self._failures.stop()

    def _agree_on_failures(self) -> None:
        """Tell every rank whether any rank failed in the running call; raise on every rank if one did."""
        flags = torch.zeros(self.world_size, dtype=torch.float64, device=self._comm_device())
        flags[self.rank] = float(self._failures.failed)
        dist.all_reduce(flags)
        self._failures.settled = True
        self._raise_if_a_rank_failed(flags)

    def _raise_if_a_rank_failed(self, flags: torch.Tensor) -> None:
        """Raise :class:`~autopipe.errors.PipelineStepError` on every rank if a rank's flag is set.

        Collective when one is: the ranks exchange their errors' texts, so that each rank's
        message names every failure.
        """
        failed = [r for r, flag in enumerate(flags.tolist()) if flag > 0]
        if not failed:
            return
        texts: list[Any] = [None] * self.world_size
        dist.all_gather_object(texts, self._failures.describe())
        # The per-use gradients of the failed step would be folded into the next step's.
        for _, leaf in getattr(self, "_use_leaves", ()):
            leaf.grad = None
        failures = {r: texts[r] for r in failed}
        listed = "; ".join(f"rank {r}: {text}" for r, text in failures.items())
        gradients = "; zero the gradients before it, as this step's are partial" if self._failures.call.startswith(
            "step") else ""
        raise PipelineStepError(
            f"{self._failures.call} failed on rank {', '.join(map(str, failed))}: {listed}. The failing stage "
            f"handed zeros on for the rest of the step, so every rank finished it and raises this error "
            f"(stages after a failing one computed on those zeros). The pipeline is usable: the next call runs "
            f"normally{gradients}",
            failures=failures,
        ) from self._failures.error

    def __repr__(self) -> str:
        return (f"Pipeline(rank {self.rank}/{self.world_size}, stages {self.stage_indices} of "
                f"{self.num_stages}, split at {self.plan.split_points}, {self.schedule} x"
                f"{self.n_microbatches} micro-batches, device {self.device})")


# ---------------------------------------------------------------------- helpers
#: The dtypes a training loss may have; the index is how the last stage tells the others.
_LOSS_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


class _MicrobatchMeanLoss:
    """The user's per-micro-batch loss divided by the number of micro-batches.

    Summed over the micro-batches this is the batch's mean loss, and its gradients are
    those of the batch mean - without torch rescaling gradients after the step. The
    user's ``loss_fn`` gets the micro-batch's output as the unsplit model returns it (a
    ``ModelOutput``, dict or tuple rebuilt from the last stage's flat tensors), so the
    same loss works split and unsplit.
    """

    def __init__(self, loss_fn: Callable, n_microbatches: int, io: ModelIO | None = None) -> None:
        self.loss_fn = loss_fn
        self.n_microbatches = n_microbatches
        self.io = io

    def __call__(self, output: Any, target: Any, **kwargs: Any) -> torch.Tensor:
        if self.io is not None:
            output = self.io.unflatten_output(output)
        return self.loss_fn(output, target, **kwargs) / self.n_microbatches


def _zero_loss(output: Any, target: Any) -> torch.Tensor:
    """A loss of exactly zero that still depends on the output (so a backward can run)."""
    floats = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.is_floating_point()]
    return sum(t.sum() for t in floats) * 0.0


def _split(model: nn.Module, split_spec: dict, example: tuple[tuple, dict], *, training: bool, expected: int):
    """``pipeline()`` on ``model`` in the given mode, leaving the model's forwards as they were.

    torch's ``annotate_split_points`` wraps the split modules' ``forward`` in place; a second
    ``pipeline()`` on the same model would then wrap the wrapper.
    """
    was_training = model.training
    saved = {}
    for name in split_spec:
        module = model.get_submodule(name)
        saved[name] = {k: module.__dict__[k] for k in ("forward", "_orig_forward") if k in module.__dict__}
    model.train(training)
    try:
        with capture_export() as exported, safe_submodule_outlining():  # pytorch/pytorch#184361
            pipe = pipeline(model, tuple(example[0]), dict(example[1]) or None, split_spec=split_spec)
    finally:
        model.train(was_training)
        for name, attrs in saved.items():
            module = model.get_submodule(name)
            for k in ("forward", "_orig_forward"):
                module.__dict__.pop(k, None)
            module.__dict__.update(attrs)
    if pipe.num_stages != expected:
        raise ValueError(
            f"splitting at {list(split_spec)} gave {pipe.num_stages} stages, not {expected}: a split "
            f"point must be a module called exactly once per forward, in forward order"
        )
    #: How a call's (args, kwargs) map to stage 0's flat inputs, and the last stage's
    #: outputs back to what the model returns.
    pipe.autopipe_io = ModelIO.from_example(tuple(example[0]), dict(example[1]), exported[0] if exported else None)
    # torch's schedules and stages only pass tensors between neighbouring stages.
    relay_skip_connections(pipe)
    for s in range(pipe.num_stages):
        # A received input is a leaf that requires grad: one the stage (or a submodule it
        # calls) writes in place, as ReLU(inplace=True) does, gets a copy (autopipe.planning.inplace).
        clone_inputs_written_in_place(pipe.get_stage_module(s).graph)
        _make_boundary_tensors_sendable(pipe.get_stage_module(s), first=s == 0, last=s == pipe.num_stages - 1)
        _run_generated_code(pipe.get_stage_module(s))
    return pipe


def _run_generated_code(stage_module: nn.Module) -> int:
    """Run torch's unflattened submodules as generated Python code, not through the fx Interpreter.

    ``pipeline()`` rebuilds each stage's module tree as ``torch.export.unflatten.
    InterpreterModule`` objects, which by default execute their graph one node at a time
    through ``torch.fx.Interpreter`` (for readable stack traces). That Python cost per node
    made blocks of many small ops ~1.5x slower than the same graph as generated code - the
    form autopipe profiles - so plans cut late (docs/benchmarks.md, "What the measurements
    found"). The generated code is what ``InterpreterModule`` itself runs under
    ``torch.compile``. Returns how many modules were switched (0 on a torch without the switch).
    """
    # The Interpreter binds no names; generated code binds each node's name as a local, and
    # a node named after a submodule called `self` (BertAttention.self) would rebind `self`.
    rename_nodes_shadowing_self(stage_module)
    switched = 0
    for module in stage_module.modules():
        if hasattr(module, "_run_with_interpreter") and hasattr(module, "graph_module"):
            module._run_with_interpreter = False
            switched += 1
    return switched


class _ContiguousGrad(torch.autograd.Function):
    """Identity forward; the gradient flowing back through it is made contiguous.

    Placed on every stage input, so the input gradient a stage sends back is contiguous
    whatever the backward produced (the gradient of a ``torch.cat`` input is a strided
    slice, of a transposed input a transposed tensor). gloo and NCCL send only contiguous
    tensors, and torch's V schedules size the receiving buffer from the gradient's strides.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return grad.contiguous()


def _guard_stage_boundaries(stage_module: nn.Module, *, fresh_outputs: bool = False) -> None:
    """Make what crosses a stage boundary sendable, in both directions, at run time.

    * Outputs are never views (a view is copied): torch's zero-bubble backward detaches each
      stage output in place, which a view does not allow ("Can't detach views in-place"); a
      cut right after a reshape makes one. Outputs are also made contiguous, in case the
      run's strides differ from the traced ones (see :func:`_make_boundary_tensors_sendable`).
    * With ``fresh_outputs`` (schedules that split the backward), every output is a copy:
      torch detaches the outputs in place, and an output the stage's own backward still
      needs (the residual stream a layer norm in the stage saved) would be lost with it.
    * Inputs that will receive a gradient pass through :class:`_ContiguousGrad`, so the
      gradient sent back to the previous stage is contiguous.
    """
    inner = stage_module.forward
    wire = getattr(stage_module, "_autopipe_wire", {"inputs": {}, "outputs": {}})

    def sendable(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        if fresh_outputs or t._is_view():
            return t.clone(memory_format=torch.contiguous_format)
        return t.contiguous()

    def guarded(t: Any) -> Any:
        if isinstance(t, torch.Tensor) and t.requires_grad and torch.is_grad_enabled():
            return _ContiguousGrad.apply(t)
        return t

    def forward(*args, **kwargs):
        args = list(args)
        encoded = []  # received integers, as floats: decoded here, tied to an output below
        for i, dtype in wire["inputs"].items():
            if i < len(args) and isinstance(args[i], torch.Tensor) and args[i].dtype != dtype:
                encoded.append(args[i])
                args[i] = args[i].detach().to(dtype)
        out = inner(*tree_map(guarded, tuple(args)), **tree_map(guarded, kwargs))
        flat, spec = tree_flatten(out)
        # A float output in the autograd graph: sent integers and received ones hang off it.
        anchor = next((j for j, v in enumerate(flat) if isinstance(v, torch.Tensor) and v.requires_grad
                       and j not in wire["outputs"]), None) if torch.is_grad_enabled() else None
        for j, value in enumerate(flat):
            if j in wire["outputs"] and isinstance(value, torch.Tensor):
                flat[j] = value.to(WIRE_DTYPE)
                if anchor is not None:  # torch's backward wants every sent tensor in the graph
                    flat[j] = _Attached.apply(flat[j], flat[anchor])
        tied = [t for t in encoded if t.requires_grad]
        if tied and anchor is not None:
            flat[anchor] = _TieZeroGrad.apply(flat[anchor], *tied)
        return tree_map(sendable, tree_unflatten(flat, spec))

    stage_module.forward = forward


class _VStage(PipelineStage):
    """A manual stage whose first step never sends to its own rank.

    Before the first step torch exchanges a dummy tensor with each neighbouring stage to set
    up the communicators. In a V the two middle stages share a rank, and some torch releases
    (2.11) send that dummy to the rank itself, which gloo refuses ("Pair is not connected");
    NCCL allows it, and torch 2.13 skips it. The ops with this rank as peer are dropped
    here, in pairs (the send and the matching receive both name this rank).
    """

    def _get_init_p2p_neighbors_ops(self) -> list:
        ops = super()._get_init_p2p_neighbors_ops()
        me_in_group, me = dist.get_rank(self.group), dist.get_rank()

        def peer_is_me(op) -> bool:
            group_peer = getattr(op, "group_peer", None)
            return group_peer == me_in_group if group_peer is not None else getattr(op, "peer", None) == me

        return [op for op in ops if not peer_is_me(op)]


def _static_stage_meta(stage_module: nn.Module, first_stage_args: tuple | None
                       ) -> tuple[tuple[torch.Tensor, ...] | None, tuple[torch.Tensor, ...] | None]:
    """What a stage receives and sends, as meta tensors from its traced graph (one micro-batch).

    Received floating-point tensors require grad, as torch's traced stages assume; integer
    ones (ids, masks) do not. ``first_stage_args`` are the model's example inputs for stage 0.
    Returns ``(None, None)`` when some boundary value is not a tensor, leaving torch to infer.
    """
    def meta(val: Any, requires_grad: bool) -> torch.Tensor | None:
        if not isinstance(val, torch.Tensor):
            return None
        t = torch.empty(val.shape, dtype=val.dtype, device="meta")
        return t.requires_grad_(requires_grad and t.is_floating_point())

    graph = stage_module.graph
    if first_stage_args is not None:
        inputs = [meta(a, a.requires_grad) if isinstance(a, torch.Tensor) else None for a in first_stage_args]
    else:
        inputs = [meta(p.meta.get("val"), True) for p in graph.nodes if p.op == "placeholder"]
    output = next(n for n in graph.nodes if n.op == "output")
    values, _ = tree_flatten(output.args[0])
    outputs = [meta(v.meta.get("val") if isinstance(v, torch.fx.Node) else v, True) for v in values]
    if any(t is None for t in inputs) or not outputs or any(t is None for t in outputs):
        return None, None
    return tuple(inputs), tuple(outputs)


#: The dtype integer and boolean tensors travel in between stages (exact for |x| < 2**53).
WIRE_DTYPE = torch.float64


def _travels_as_float(val: torch.Tensor) -> bool:
    """An integer or boolean boundary tensor: it crosses a cut as :data:`WIRE_DTYPE`."""
    return not (val.is_floating_point() or val.is_complex())


def _make_boundary_tensors_sendable(stage_module: nn.Module, *, first: bool, last: bool) -> None:
    """Describe every tensor a stage sends or receives as one torch can send, in its graph.

    * Contiguous: a cut inside a module can fall where a tensor is a strided view
      (``k.transpose(...)``). torch's stage sends the output as it is and allocates receive
      buffers with the traced strides, and gloo (like NCCL) only sends and receives
      contiguous tensors. So each non-contiguous stage output gets a
      ``clone(memory_format=contiguous_format)`` and each stage input is described as
      contiguous; contiguous boundaries are left untouched.
    * Floating point: integer and boolean tensors (token or position ids, masks) crossing a
      cut are described as :data:`WIRE_DTYPE`, because torch's stages make every received
      tensor require grad and some releases (2.11) do so on the receive buffer itself, which
      fails for integers. :func:`_guard_stage_boundaries` converts them at run time (to
      float after the sending stage, back before the receiving stage runs) and gives them a
      zero gradient, so every received tensor has one, as those releases also demand.
      The positions and original dtypes are kept in ``stage_module._autopipe_wire``.

    The model's own inputs (first stage) and outputs (last stage) are left alone.
    """
    graph = stage_module.graph
    wire: dict[str, dict[int, torch.dtype]] = {"inputs": {}, "outputs": {}}
    changed = False
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    for i, node in enumerate(placeholders):
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            continue
        if not val.is_contiguous():
            node.meta["val"] = val = val.clone(memory_format=torch.contiguous_format)
        if not first and _travels_as_float(val):
            wire["inputs"][i] = val.dtype
            node.meta["val"] = val.to(WIRE_DTYPE)
    output = next(n for n in graph.nodes if n.op == "output")

    def contiguous(arg):
        nonlocal changed
        val = arg.meta.get("val") if isinstance(arg, torch.fx.Node) else None
        if not isinstance(val, torch.Tensor) or val.is_contiguous():
            return arg
        with graph.inserting_before(output):
            copy = graph.call_function(torch.ops.aten.clone.default, (arg,),
                                       {"memory_format": torch.contiguous_format})
        copy.meta["val"] = val.clone(memory_format=torch.contiguous_format)
        changed = True
        return copy

    output.args = torch.fx.node.map_arg(output.args, contiguous)
    if changed:
        stage_module.recompile()
    if not last:
        values, _ = tree_flatten(output.args[0])
        for j, node in enumerate(values):
            val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
            if isinstance(val, torch.Tensor) and _travels_as_float(val):
                wire["outputs"][j] = val.dtype
                node.meta["val"] = val.to(WIRE_DTYPE)  # what torch checks the sent value against
    stage_module._autopipe_wire = wire


class _Attached(torch.autograd.Function):
    """``value`` unchanged but part of ``anchor``'s autograd graph, contributing no gradient.

    A float-encoded integer a stage sends has no autograd history; torch's input-gradient
    backward (``stage_backward_input``) fails on such an output in some releases (2.11).
    """

    @staticmethod
    def forward(ctx, value: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return value.view_as(value)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: D102
        return None, None


class _TieZeroGrad(torch.autograd.Function):
    """``out`` unchanged; in backward, ``out``'s gradient and a zero gradient for each tied input.

    Ties the float-encoded integer inputs of a stage (see
    :func:`_make_boundary_tensors_sendable`) to one of its outputs, so torch computes a
    gradient, zero, for every received tensor.
    """

    @staticmethod
    def forward(ctx, out: torch.Tensor, *tied: torch.Tensor) -> torch.Tensor:  # noqa: D102
        ctx.tied_meta = [(t.shape, t.dtype, t.device) for t in tied]
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: D102
        return (grad, *(torch.zeros(shape, dtype=dtype, device=device) for shape, dtype, device in ctx.tied_meta))


def _rewrap_stage(stage, module: nn.Module):
    """A new stage object of the same kind over ``module`` (for a separate schedule)."""
    return type(stage)(module, stage.stage_index, stage.pipe_info, stage.device, stage.group)


def _tie_aliases(module: nn.Module, names: StateNames, state: Mapping[str, torch.Tensor], *,
                 leaf_per_use: bool = False) -> list[tuple[str, nn.Parameter]]:
    """Point every name in ``module`` of a tensor in ``state`` (canonical name -> tensor) at it.

    Names of tensors not in ``state`` are left alone. With ``leaf_per_use``, the second and
    later names of a parameter that ``module``'s code reads get instead a new Parameter
    over the same memory (equal values, a gradient of its own), for torch's split weight
    backward (see ``Pipeline._share_local_replicas``); names it never reads (left over from
    the split) still point at the parameter itself.

    Returns:
        The new Parameters, as ``(canonical name, Parameter)``.

    Example:
        >>> class Scale(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.a, self.b = nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(2))
        ...     def forward(self, x):
        ...         return x * self.a * self.b
        >>> tied = Scale(); tied.b = tied.a  # the original model: a and b are one parameter
        >>> names = model_state_names(tied)
        >>> stage = torch.fx.symbolic_trace(Scale())  # a stage reading two copies of it
        >>> _tie_aliases(stage, names, {"a": stage.a}), stage.b is stage.a
        ([], True)
        >>> stage = torch.fx.symbolic_trace(Scale())
        >>> [c for c, _ in _tie_aliases(stage, names, {"a": stage.a}, leaf_per_use=True)]
        ['a']
        >>> stage.b is stage.a, stage.b.data_ptr() == stage.a.data_ptr()
        (False, True)
    """
    leaves: list[tuple[str, nn.Parameter]] = []
    used = used_attribute_names(module)
    for canon, local_names in stage_aliases(module, names).items():
        target = state.get(canon)
        if target is None:
            continue
        reads = 0
        for local_name in local_names:
            reads += local_name in used
            if local_name in used and reads > 1 and leaf_per_use and isinstance(target, nn.Parameter):
                leaf = nn.Parameter(target.detach(), requires_grad=target.requires_grad)  # shares the memory
                _set_tensor(module, local_name, leaf)
                leaves.append((canon, leaf))
            else:
                _set_tensor(module, local_name, target)
    return leaves


def _fold_use_leaf_grads(leaves: Sequence[tuple[str, nn.Parameter]], state: Mapping[str, torch.Tensor]) -> None:
    """Add each per-use Parameter's gradient to its parameter's (``state[canonical name]``) and clear it.

    Example:
        >>> p = nn.Parameter(torch.zeros(2)); leaf = nn.Parameter(p.detach())
        >>> p.grad, leaf.grad = torch.ones(2), torch.full((2,), 2.0)
        >>> _fold_use_leaf_grads([("w", leaf)], {"w": p})
        >>> p.grad, leaf.grad
        (tensor([3., 3.]), None)
    """
    for canon, leaf in leaves:
        if leaf.grad is None:
            continue
        target = state[canon]
        target.grad = leaf.grad if target.grad is None else target.grad + leaf.grad
        leaf.grad = None


def _set_tensor(module: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Make ``module``'s parameter or buffer ``name`` be ``tensor`` (the same object)."""
    prefix, _, leaf = name.rpartition(".")
    parent = module.get_submodule(prefix) if prefix else module
    if leaf in parent._parameters:
        parent._parameters[leaf] = tensor
    else:
        parent._buffers[leaf] = tensor


def _has_mode_dependent_modules(model: nn.Module) -> bool:
    """True if train and eval mode compute differently: dropout with p > 0 or batch statistics."""
    for m in model.modules():
        if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0:
            return True
        if isinstance(m, nn.modules.batchnorm._NormBase) and m.track_running_stats:
            return True
    return False


#: Planner options that bring costs of their own, so that the ranks have nothing to profile:
#: ``costs`` / ``scaling`` are profiles already; ``devices`` carry speeds relative to the one
#: device a profile was taken on (a mean over the ranks' devices would count them twice).
_OWN_COSTS_OPTIONS = ("costs", "scaling", "devices")


def _profile_in_ranks_by_default(world_size: int, options: Mapping[str, Any]) -> bool:
    """``profile_in_ranks=None``: profile in every rank when there are several and nothing else gives the costs.

    Profiles every rank took at once predicted two-rank CPU steps better than a profile taken
    alone in most runs of ``benchmarks/prediction_accuracy`` (docs/costs-and-measurement.md
    section 4, every run's figures); the other ranks would only wait meanwhile, so it costs
    no time.

    Example:
        >>> _profile_in_ranks_by_default(2, {"repeats": 3})
        True
        >>> _profile_in_ranks_by_default(2, {"cost": "flops"}), _profile_in_ranks_by_default(1, {})
        (False, False)
    """
    return (world_size > 1 and not any(k in options for k in _OWN_COSTS_OPTIONS)
            and options.get("cost", "measured") == "measured")


def _rank_profile_settings(options: Mapping[str, Any]) -> dict[str, Any]:
    """The settings of the ranks' profile: ``planner_options``' own, else what the planner would use.

    ``warmup`` / ``repeats`` default to ``profile_segments``' (the planner's too, not
    ``profile_in_ranks``' longer 15 rounds), so the ranks profile as many rounds as rank 0
    alone would have and planning takes no longer.

    Example:
        >>> _rank_profile_settings({"repeats": 3, "flush_cache": False})
        {'warmup': 2, 'repeats': 3, 'flush_cache': False}
    """
    from ..planning.profile import profile_segments

    defaults = inspect.signature(profile_segments).parameters
    settings = {k: options.get(k, defaults[k].default) for k in ("warmup", "repeats")}
    settings.update({k: options[k] for k in ("flush_cache", "fit_to_whole") if k in options})
    return settings


def _plan_from_split_points(split_points: list[str], schedule: str, n_microbatches: int,
                            stages_per_rank: int) -> Plan:
    """A Plan for a hand-chosen split: the split points, no cost predictions."""
    n = len(split_points) + 1
    stages = [StagePlan(index=i, fqns=[], first_segment=i, last_segment=i, fwd_s=0.0, bwd_s=0.0, comm_s=0.0,
                        param_bytes=0, act_bytes=0, peak_bytes=0, send_bytes=0, recv_bytes=0) for i in range(n)]
    return Plan(num_stages=n, split_points=list(split_points), stages=stages, schedule=schedule,
                n_microbatches=n_microbatches, bottleneck_s=0.0, predicted_step_s=0.0, lower_bound_s=0.0,
                cost_source="none", objective="given by hand", stages_per_rank=stages_per_rank,
                extras={"source": "split_points given to autopipe.Pipeline"})


def _check_count(arg: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{arg} must be an int >= 1, got {value!r}")
    if value < 1:
        raise ValueError(f"{arg} must be >= 1, got {value!r}")


def _check_model_and_inputs(model: Any, example_args: Any, example_kwargs: Any,
                            loss_fn: Any) -> tuple[tuple[Any, ...], dict[str, Any] | None]:
    """The checked ``(example_args, example_kwargs)``: ``()`` for args when only keywords are given.

    With neither, the model's own example (``example_input_array``, ``dummy_inputs``) is
    used, or :class:`~autopipe.errors.MissingExampleInputsError` says what to pass.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if example_args is None and example_kwargs is None:
        example_args, example_kwargs = resolve_example_inputs(model, None, None)
    elif example_args is None:  # every input is a keyword (Hugging Face's input_ids=...)
        example_args = ()
    if not isinstance(example_args, tuple):
        raise TypeError(
            f"example_args must be a tuple of one micro-batch's positional inputs, e.g. (x_mb,); "
            f"got {type(example_args).__name__}"
        )
    if example_kwargs is not None and not isinstance(example_kwargs, dict):
        raise TypeError(f"example_kwargs must be a dict or None, got {type(example_kwargs).__name__}")
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable as loss_fn(output, target), got {loss_fn!r}")
    return example_args, example_kwargs


def _load_plan(plan: Any, split_points: Any) -> Plan | None:
    if plan is not None and split_points is not None:
        raise ValueError("give either plan= or split_points=, not both")
    if plan is None or isinstance(plan, Plan):
        return plan
    if isinstance(plan, (str, os.PathLike)):
        if not os.path.isfile(plan):
            raise FileNotFoundError(f"plan={os.fspath(plan)!r}: no such plan file")
        return Plan.load(plan)
    raise TypeError(f"plan must be an autopipe Plan, a plan file path or None, got {type(plan).__name__}")


def _check_split_points(model: nn.Module, split_points: Any, arg: str) -> list[str] | None:
    if split_points is None:
        return None
    if isinstance(split_points, str) or not isinstance(split_points, Sequence):
        raise TypeError(f"{arg} must be a list of module names, got {split_points!r}")
    names = dict(model.named_modules())
    bad = [p for p in split_points if not isinstance(p, str) or p not in names or p == ""]
    if bad:
        raise ValueError(
            f"{arg}={list(split_points)!r}: {bad} are not submodules of the model; split points "
            f"are module names such as {[n for n in names if n][:5]}"
        )
    if len(set(split_points)) != len(split_points):
        raise ValueError(f"{arg}={list(split_points)!r} names a module twice")
    return list(split_points)

