"""Building this rank's stages: torch's ``pipeline()`` on a private copy, then what this rank runs."""

from __future__ import annotations

import copy
import functools
import gc
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage, SplitPoint, pipeline

from ..layouts.sharding import find_tensor_parallel
from ..machine.host_memory import return_freed_heap
from ..planning import hf_compat
from ..planning.inplace import clone_inputs_written_in_place
from ..planning.plan import Plan
from ..planning.schedules import schedule_spec
from ..errors import ModelExportError
from ..planning.autograd_functions import kept_function_classes
from ..planning.export_check import EagerComparison, compare_with_eager, gradient_mismatch_message
from ..planning.tracing import export_guards, release_last_export
from .checkpointing import block_names, checkpoint_blocks, checkpoint_stage
from .materialize import (WeightSource, check_state_fits, describe_weights, load_weights, materialize_leftovers,
                          materialize_rank, meta_twin, on_meta, stored_shapes, take_constants, to_meta)
from .compat import (VStage, generated_source_recorded, guard_stage_boundaries, make_boundary_tensors_sendable,
                     meta_devices_to, rename_nodes_shadowing_self, safe_submodule_outlining, stage_call_order,
                     stages_in_split_order, static_stage_meta)
from .data_parallel import local_tensor
from .distributed import gather_digests, raise_on_every_rank
from .mixed_precision import carry_autocast_dtypes
from .model_io import ModelIO, TracedBatch, capture_export
from .params import (StateNames, first_model_difference, first_use_ranks, model_signature, model_state_names,
                     shared_parameters, stage_state, tie_aliases, used_attribute_names)
from .relay import relay_skip_connections
from .tensor_parallel import StageSharding, shard_stages, vocabulary_parallel

def split_model(model: nn.Module, split_spec: dict, example: tuple[tuple, dict], *, training: bool,
                expected: int, stop_after_export: Callable[[list[str]], bool] | None = None,
                autocast: tuple[str, torch.device] | None = None, check_gradients: bool = False,
                tensor_parallel: bool = False) -> Any:
    """``pipeline()`` on ``model`` in the given mode, each stage module ready to run split.

    The model's forwards are left as they were: torch's ``annotate_split_points`` wraps the
    split modules' ``forward`` in place, and a second ``pipeline()`` on the same model would
    then wrap the wrapper. The returned ``Pipe`` carries ``autopipe_io``, the
    :class:`~autopipe.runtime.model_io.ModelIO` of the traced call.

    ``stop_after_export``, when given, is called with the trace's :func:`graph_text` before
    the split; where it returns True the split is skipped and None returned (the export
    alone tells whether a trace computes what another does). With
    ``autocast`` (a mixed precision and the device the stages run on), the stage boundaries
    carry the dtypes autocast gives them there (:mod:`~autopipe.runtime.mixed_precision`).
    With ``check_gradients``, the traced program's gradients are compared with the model's on
    the example (:func:`~autopipe.planning.export_check.compare_with_eager`), and the Pipe
    carries the result as ``autopipe_gradient_check`` for the caller to act on. With
    ``tensor_parallel``, it carries ``autopipe_tensor_parallel``: what the export lets tensor
    parallelism shard (:func:`~autopipe.layouts.sharding.find_tensor_parallel`).

    Raises:
        ValueError: the split did not give ``expected`` stages (a split point that is not
            called exactly once per forward, in forward order).

    Example::

        split = split_model(model, {"layers.1": SplitPoint.BEGINNING}, ((x,), {}),
                            training=True, expected=2)
    """
    was_training = model.training
    saved = {}
    for name in split_spec:
        module = model.get_submodule(name)
        saved[name] = {k: module.__dict__[k] for k in ("forward", "_orig_forward") if k in module.__dict__}
    model.train(training)

    def stop_if_alike(program: Any) -> None:
        if stop_after_export is not None and stop_after_export(graph_text(program.graph)):
            raise _SameGraph

    try:
        with capture_export(stop_if_alike) as exported, safe_submodule_outlining(), stages_in_split_order(), \
                export_guards(model):
            pipe = pipeline(model, tuple(example[0]), dict(example[1]) or None, split_spec=split_spec)
        comparison = EagerComparison(skipped="not asked for")
        if check_gradients and exported:
            comparison = compare_with_eager(model, exported[0].module(), tuple(example[0]), dict(example[1]))
    except _SameGraph:
        return None
    finally:
        release_last_export()
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
    order = stage_call_order(pipe.split_gm)
    if order != list(range(pipe.num_stages)):
        raise RuntimeError(
            f"torch's pipeline() called the stages of {list(split_spec)} in the order {order}: its stages "
            "would compute another function"
        )
    #: How a call's (args, kwargs) map to stage 0's flat inputs, and the last stage's
    #: outputs back to what the model returns.
    pipe.autopipe_io = ModelIO.from_example(tuple(example[0]), dict(example[1]), exported[0] if exported else None)
    #: What the traced program computes (:func:`graph_text`), to compare another mode's trace with.
    pipe.autopipe_graph = graph_text(exported[0].graph) if exported else None
    #: The traced program's gradients against the model's, and the Functions kept whole.
    pipe.autopipe_gradient_check = comparison
    pipe.autopipe_kept_functions = kept_function_classes(exported[0].graph) if exported else []
    if tensor_parallel:
        pipe.autopipe_tensor_parallel = find_tensor_parallel(exported[0])
    _refuse_data_dependent_boundaries(pipe, list(split_spec))
    # torch's schedules and stages only pass tensors between neighbouring stages.
    relay_skip_connections(pipe)
    if autocast is not None:  # before the boundaries are made sendable: they record the dtypes sent
        carry_autocast_dtypes([pipe.get_stage_module(s) for s in range(pipe.num_stages)],
                              pipe.autopipe_io.stage_inputs(tuple(example[0]), dict(example[1])), *autocast)
    for s in range(pipe.num_stages):
        # A received input is a leaf that requires grad: one the stage (or a submodule it
        # calls) writes in place, as ReLU(inplace=True) does, gets a copy (autopipe.planning.inplace).
        clone_inputs_written_in_place(pipe.get_stage_module(s).graph)
        make_boundary_tensors_sendable(pipe.get_stage_module(s), first=s == 0, last=s == pipe.num_stages - 1)
        run_generated_code(pipe.get_stage_module(s))
    return pipe


def _refuse_data_dependent_boundaries(pipe: Any, split_points: list[str]) -> None:
    """A stage receives into buffers of one fixed shape: refuse a split a tensor of data-dependent size crosses."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    for s in range(1, pipe.num_stages):
        for node in pipe.get_stage_module(s).graph.nodes:
            val = node.meta.get("val") if node.op == "placeholder" else None
            if isinstance(val, torch.Tensor) and free_unbacked_symbols(val):
                raise ValueError(
                    f"split point {split_points[s - 1]!r}: {node.name} crosses it with a size that depends on the data "
                    f"(shape {tuple(val.shape)}), and a pipeline stage receives into buffers of one fixed shape. Give "
                    f"other split_points= (autopipe.partition offers only cuts no such tensor crosses), or reduce the "
                    f"tensor to a fixed size (pad, pool) before that module")


def run_generated_code(stage_module: nn.Module) -> int:
    """Run torch's unflattened submodules as generated Python code, not through the fx Interpreter."""
    # The Interpreter binds no names; generated code binds each node's name as a local, and
    # a node named after a submodule called `self` (BertAttention.self) would rebind `self`.
    rename_nodes_shadowing_self(stage_module)
    switched = 0
    for module in stage_module.modules():
        if hasattr(module, "_run_with_interpreter") and hasattr(module, "graph_module"):
            module._run_with_interpreter = False
            switched += 1
    return switched


class _SameGraph(Exception):
    """Raised inside ``pipeline()`` to stop after the export (``split_model(stop_after_export=...)``)."""


def graph_text(graph: torch.fx.Graph) -> list[str]:
    """What a traced graph computes, node by node, read from the graph (not from module types).

    Example:
        >>> gm = torch.fx.symbolic_trace(nn.Linear(2, 2))
        >>> graph_text(gm.graph)[0]
        'input_1 = placeholder[input]()'
    """
    def text(node: torch.fx.Node) -> str:
        args = node.args
        if (node.op == "call_function" and getattr(node.target, "__name__", "").startswith(("dropout", "native_dropout"))
                and len(args) == 3 and args[1] == 0):
            args = args[:2]
        return f"{node.name} = {node.op}[{node.target}]{args}" + (f"{node.kwargs}" if node.kwargs else "")

    return [text(n) for n in graph.nodes]


@dataclass
class RankStages:
    """This rank's share of the split model, as :func:`build_rank_stages` leaves it."""

    batch: TracedBatch
    names: StateNames
    train_modules: dict[int, nn.Module]
    eval: EvalModules
    train_stages: list
    state: dict[str, torch.Tensor]
    use_leaves: list[tuple[str, nn.Parameter]]
    shared: list[tuple[list[str], Any]]
    grad_norm_rank: dict[str, int]
    unheld_state: dict[str, torch.Tensor]
    unwritten: dict[str, torch.Tensor]
    #: What tracing this rank's stages again at another input shape needs (:func:`retrace_rank_stages`).
    retrace: Retrace | None = None
    #: Where torch.fx keeps the source it generated while building them (``compat.generated_source_recorded``).
    generated_source: list[str] = field(default_factory=list)

    def generated_source_keys(self) -> list[str]:
        """Every key torch.fx keeps generated source under for these stages, the eval-mode trace's included."""
        return [*self.generated_source, *self.eval.generated_source]


@dataclass
class Retrace:
    """How this rank's stages were built, to build them again at another input shape over the same tensors."""

    model: nn.Module  # the private copy's twin on the meta device: its structure, no memory
    split_spec: dict
    num_stages: int
    stage_indices: list[int]
    device: torch.device
    pp_group: Any
    pp_rank: int  # this rank in the pipeline's group, and the group's size: the ranks that trace together
    pp_size: int
    names: StateNames
    state: dict[str, torch.Tensor]
    traced: dict[int, nn.Module]  # the training stages first built, whose constants a retrace reuses
    checkpointed: Sequence[int]
    split_backward: bool
    v_placement: bool
    training: bool
    autocast: tuple[str, torch.device] | None
    compile_options: dict[str, Any] | None
    tp: StageSharding | None = None  # what tensor parallelism shards in every trace
    blocks: Sequence[str] = ()  # the model's blocks, each checkpointed in ``block_mode``
    block_mode: str = "none"


def _generated_source_kept_with(build: Callable[..., RankStages]) -> Callable[..., RankStages]:
    """``build``, the source torch.fx generates while it runs recorded on the stages it returns, to drop with them."""
    @functools.wraps(build)
    def recorded(*args: Any, **kwargs: Any) -> RankStages:
        with generated_source_recorded() as keys:
            built = build(*args, **kwargs)
        built.generated_source = keys
        return built

    return recorded


@_generated_source_kept_with
def build_rank_stages(model: nn.Module, plan: Plan, *, schedule: str, n_microbatches: int, stage_ranks: list[int],
                      rank: int, world_size: int, device: torch.device, example: tuple[tuple, dict],
                      training: bool, checkpointed: Sequence[int],
                      init_weights: Callable[[nn.Module], Any] | None = None,
                      weights: WeightSource | None = None, pp_rank: int | None = None,
                      replicas: Sequence[Sequence[int]] | None = None, pp_group: Any = None,
                      mixed_precision: str | None = None, compile_options: dict[str, Any] | None = None,
                      tp_mesh: DeviceMesh | None = None, loss_parallel: bool = False,
                      sequence_parallel: bool = False, block_mode: str = "none") -> RankStages:
    """Split a private copy of ``model`` at the plan's split points and build this rank's stages
    (each sharded over ``tp_mesh`` where given, the output layer too with ``loss_parallel``, the
    norms over sequence shards with ``sequence_parallel``:
    :mod:`~autopipe.runtime.tensor_parallel`; each of
    the model's blocks checkpointed in ``block_mode``: :func:`~autopipe.runtime.checkpointing.checkpoint_blocks`)."""
    # Before anything is traced: ranks with different models would split differently and
    # disagree on the shared parameters' process groups.
    _check_same_model(model, world_size)
    names = model_state_names(model)  # the private copy below has the same names
    if weights is not None:  # the whole model on every rank, so every rank reaches the same verdict
        misfit: Exception | None = None
        try:
            check_state_fits(stored_shapes(weights), names, f"weights={describe_weights(weights)}")
        except Exception as e:  # noqa: BLE001 - raised below, on every rank
            misfit = e
        raise_on_every_rank(misfit, rank=rank, world_size=world_size, what="use weights=")
    local_model = copy.deepcopy(model)
    # The copy is private, so a Hugging Face KV cache simply stays off: it is no trainable
    # output and cannot leave a stage (autopipe.planning.hf_compat; the planner's report says so).
    hf_compat.turn_off_cache(local_model)
    example = (example[0], hf_compat.training_kwargs(local_model, example[1])[0])
    num_stages = plan.num_stages
    split_spec = {name: SplitPoint.BEGINNING for name in plan.split_points}
    meta = on_meta(local_model)
    twin = local_model if meta else meta_twin(local_model)
    # A meta model is traced with meta inputs; the batch is still checked against the real example.
    traced_example = to_meta(example) if meta else example
    autocast = (mixed_precision, device) if mixed_precision else None
    train_pipe = split_model(local_model, split_spec, traced_example, training=True, expected=num_stages,
                             autocast=autocast, check_gradients=training, tensor_parallel=tp_mesh is not None)
    # Every rank traced the same model, so all should agree; a rank that differs still must not
    # leave the others waiting.
    comparison = train_pipe.autopipe_gradient_check
    mismatch = ModelExportError(gradient_mismatch_message(type(model).__name__, comparison,
                                                          train_pipe.autopipe_kept_functions),
                                kind="gradient-mismatch") if comparison.differing else None
    raise_on_every_rank(mismatch, rank=rank, world_size=world_size,
                        what="build stages whose gradients are the model's")
    tp_plan = train_pipe.autopipe_tensor_parallel if tp_mesh is not None else None
    if tp_plan is not None and loss_parallel:  # refused alike on every rank, as the check below
        tp_plan = vocabulary_parallel(tp_plan, model)
    why = tp_plan.why_not(tp_mesh.size()) if tp_plan is not None else None
    if why:  # every rank traced alike and raises alike, before the sharding's collectives
        raise ValueError(f"tensor_parallel={tp_mesh.size()} cannot shard {type(model).__name__}: {why}")

    # What each stage uses, under the original names: every rank computes it for every
    # stage, so all ranks agree on which parameters are shared and by whom.
    all_states = [stage_state(train_pipe.get_stage_module(s), names) for s in range(num_stages)]
    held = set().union(*all_states)
    unheld_names = [c for c in names.saved if c not in held]
    replicas = [list(r) for r in replicas] if replicas is not None else [list(range(world_size))]
    pp_rank = rank if pp_rank is None else pp_rank
    my_replica = next(r for r in replicas if rank in r)
    stage_indices = [s for s, r in enumerate(stage_ranks) if r == pp_rank]
    pending: dict[str, torch.Tensor] = {}  # tensors left for the user to load before the first step
    if meta:
        local_canon = list(dict.fromkeys(c for s in stage_indices for c in all_states[s]))
        error: Exception | None = None
        try:
            local_state, unheld = materialize_rank(model, names, local_canon, device=device, extra=unheld_names,
                                                   init_weights=init_weights, weights=weights, unwritten_out=pending)
            for s in stage_indices:
                _read_real_tensors(train_pipe.get_stage_module(s), names, local_state)
        except Exception as e:  # noqa: BLE001 - raised below, on every rank
            error = e
        raise_on_every_rank(error, rank=rank, world_size=world_size,
                            what="materialize its stages of the meta-device model")
    else:
        unheld = {}
        for canon in unheld_names:
            is_param = canon in names.parameter_names
            tensor = local_model.get_parameter(canon) if is_param else local_model.get_buffer(canon)
            unheld[canon] = tensor.detach().cpu().clone()
    split_backward = schedule_spec(schedule).split_backward
    train_stages = [train_pipe.build_stage(s, device, pp_group) for s in stage_indices]  # also rewrites device constants
    train_modules = {st.stage_index: st.submod for st in train_stages}
    if meta:
        for module in train_modules.values():
            meta_devices_to(module, device)
    state, use_leaves = _share_local_replicas(train_modules, names, leaf_per_use=split_backward)
    if weights is not None and not meta:
        unread: Exception | None = None
        try:
            load_weights({**unheld, **state}, names, weights)
        except Exception as e:  # noqa: BLE001 - raised below, on every rank
            unread = e
        raise_on_every_rank(unread, rank=rank, world_size=world_size, what="read its weights")
    tp = StageSharding(tp_mesh, tp_plan, sequence_parallel) if tp_mesh is not None else None
    if tp is not None:
        shard_stages(train_modules, tp)
        for module in train_modules.values():  # the sharded parameters replace the whole ones
            state.update((canon, tensor) for canon, (_, tensor) in stage_state(module, names).items())
    batch = TracedBatch(train_pipe.autopipe_io, example, n_microbatches)
    v_placement = schedule_spec(schedule).placement == "v"
    blocks = block_names(model) if block_mode != "none" else []
    train_stages = _ready_to_run(train_modules, train_stages, batch, checkpointed=checkpointed,
                                 blocks=blocks, block_mode=block_mode,
                                 split_backward=split_backward, compile_options=compile_options,
                                 v_placement=v_placement, num_stages=num_stages, device=device, pp_group=pp_group,
                                 training=training)
    retrace = Retrace(model=twin, split_spec=split_spec, num_stages=num_stages, stage_indices=stage_indices,
                      device=device, pp_group=pp_group, pp_rank=pp_rank, pp_size=len(set(stage_ranks)), names=names,
                      state=state, traced=train_modules, checkpointed=checkpointed, split_backward=split_backward,
                      v_placement=v_placement, training=training, autocast=autocast, compile_options=compile_options,
                      tp=tp, blocks=blocks, block_mode=block_mode)
    # A meta model's training trace is a meta trace already, to compare the eval-mode one with.
    eval_modules = EvalModules(retrace, traced_example if meta else to_meta(traced_example), train_modules,
                               train_graph=train_pipe.autopipe_graph if meta else None)

    # Parameters held on several ranks: their gradients are summed after each backward.
    # new_group is collective: every rank creates every group, in the same order.
    shared: list[tuple[list[str], Any]] = []
    stage_params = [[c for c in st if c in names.parameter_names] for st in all_states]
    for pp_ranks, group_names in shared_parameters(stage_params, stage_ranks):
        for replica in replicas:  # each replica sums over its own pp ranks
            ranks = [replica[p] for p in pp_ranks]
            group = None if len(ranks) == world_size else dist.new_group(ranks)
            if rank in ranks:
                shared.append((group_names, group))
    # Each rank built its own model, so the copies start equal only if every rank seeded
    # alike; summed gradients keep them equal only if they start so.
    grad_norm_rank = first_use_ranks(stage_params, stage_ranks)
    _copy_shared_from_first_use(shared, state, {n: my_replica[r] for n, r in grad_norm_rank.items()})
    # Tracing and splitting freed tens of MiB of Python objects (export's fake tensors and
    # intermediate graphs, among them cycles only a collection frees): give the pages back to
    # the system before training allocates.
    gc.collect()
    return_freed_heap()
    return RankStages(batch=batch, names=names, train_modules=train_modules, eval=eval_modules,
                      train_stages=train_stages, state=state, use_leaves=use_leaves, shared=shared,
                      grad_norm_rank=grad_norm_rank, unheld_state=unheld, unwritten=pending, retrace=retrace)


def _ready_to_run(train_modules: Mapping[int, nn.Module], train_stages: list, batch: TracedBatch, *,
                  checkpointed: Sequence[int], split_backward: bool, compile_options: dict[str, Any] | None,
                  v_placement: bool, num_stages: int, device: torch.device, pp_group: Any, training: bool,
                  blocks: Sequence[str] = (), block_mode: str = "none") -> list:
    """Recompute, boundary guards and compilation on this rank's stage modules; the training stages to run."""
    for s in checkpointed:
        if s in train_modules:
            checkpoint_stage(train_modules[s])
    for module in train_modules.values():
        checkpoint_blocks(module, blocks, block_mode)
    _guard_and_compile(train_modules.values(), split_backward, compile_options)
    if v_placement:
        # torch's Pipe.build_stage wires each stage's peers for the looped placement; a stage
        # placed in a V is a manual PipelineStage, which learns its peers from the schedule.
        train_stages = [manual_stage(train_modules[st.stage_index], st.stage_index, num_stages, device, batch,
                                     pp_group) for st in train_stages]
    for module in train_modules.values():
        module.train(training)
    return train_stages


def _guard_and_compile(modules: Iterable[nn.Module], split_backward: bool,
                       compile_options: dict[str, Any] | None) -> None:
    for module in modules:
        guard_stage_boundaries(module, fresh_outputs=split_backward)
        if compile_options is not None:  # in place: the stages, the state and the names keep the module
            module.compile(**compile_options)


@_generated_source_kept_with
def retrace_rank_stages(r: Retrace, batch: TracedBatch, dims: tuple[int, ...]) -> RankStages:
    """This rank's stages traced again for inputs whose dimensions after the rows are ``dims``.

    The model's meta twin is traced at that shape and split at the same points; every
    parameter and buffer of the new stage modules is the tensor the first stages hold, so
    gradients and optimizer steps reach the same parameters whatever shape a call has.
    """
    example = batch.meta_example(dims)
    train_pipe = _split_twin(r, example, training=True)
    for s in r.stage_indices:
        _read_real_tensors(train_pipe.get_stage_module(s), r.names, r.state, constants_from=r.traced[s])
    train_stages = [train_pipe.build_stage(s, r.device, r.pp_group) for s in r.stage_indices]
    train_modules = {st.stage_index: st.submod for st in train_stages}
    use_leaves: list[tuple[str, nn.Parameter]] = []
    for module in train_modules.values():
        meta_devices_to(module, r.device)
        use_leaves += tie_aliases(module, r.names, r.state, leaf_per_use=r.split_backward)
    if r.tp is not None:
        shard_stages(train_modules, r.tp)
    new_batch = TracedBatch(train_pipe.autopipe_io, example, batch.n_microbatches)
    train_stages = _ready_to_run(train_modules, train_stages, new_batch, checkpointed=r.checkpointed,
                                 split_backward=r.split_backward, compile_options=r.compile_options,
                                 v_placement=r.v_placement, num_stages=r.num_stages, device=r.device,
                                 pp_group=r.pp_group, training=r.training, blocks=r.blocks, block_mode=r.block_mode)
    return RankStages(batch=new_batch, names=r.names, train_modules=train_modules,
                      eval=EvalModules(r, example, train_modules, train_graph=train_pipe.autopipe_graph),
                      train_stages=train_stages, state=r.state, use_leaves=use_leaves, shared=[], grad_norm_rank={},
                      unheld_state={}, unwritten={})


def _split_twin(r: Retrace, example: tuple[tuple, dict], *, training: bool,
               stop_after_export: Callable[[list[str]], bool] | None = None) -> Any:
    """:func:`split_model` on the model's meta twin and a meta ``example``.

    Tensors the model's code creates without a device (``torch.arange(n)``) are made on the
    meta device too, as the real model makes them beside its real inputs; the stages built
    from the split point every ``device=meta`` at the real device (``compat.meta_devices_to``).
    """
    with torch.device("meta"):
        return split_model(r.model, r.split_spec, example, training=training, expected=r.num_stages,
                           autocast=r.autocast, stop_after_export=stop_after_export)


def _share_local_replicas(modules: Mapping[int, nn.Module], names: StateNames, *, leaf_per_use: bool
                          ) -> tuple[dict[str, torch.Tensor], list[tuple[str, nn.Parameter]]]:
    """One tensor per original name on this rank, by canonical name, and the per-use Parameters."""
    state: dict[str, torch.Tensor] = {}
    use_leaves: list[tuple[str, nn.Parameter]] = []
    for module in modules.values():
        for canon, (_, tensor) in stage_state(module, names).items():
            state.setdefault(canon, tensor)
        use_leaves += tie_aliases(module, names, state, leaf_per_use=leaf_per_use)
    return state, use_leaves


def _read_real_tensors(module: nn.Module, names: StateNames, state: Mapping[str, torch.Tensor], *,
                       constants_from: nn.Module | None = None) -> None:
    """A meta-traced stage module reads ``state``'s tensors (and ``constants_from``'s traced constants);
    what it holds but never reads takes no memory. Before torch moves the module to the device."""
    tie_aliases(module, names, state)
    if constants_from is not None:
        take_constants(module, constants_from)
    materialize_leftovers(module, used_attribute_names(module))


class EvalModules:
    """This rank's stage modules for eval mode, traced at the first eval-mode call.

    torch.export bakes train/eval behaviour (dropout, batch-norm statistics, branches on
    ``self.training``) into the graph, so eval mode needs its own trace over the same tensors
    wherever the two traces differ. That trace costs as much as the training one and many
    pipelines only train, so it waits for the first forward or evaluation in eval mode, which
    every rank of the pipeline makes together (a rank that cannot trace raises on all of them).
    It is traced from the model's meta twin (:class:`Retrace`), as another input shape is; where
    it computes what the training trace computes, the training stages serve eval mode too.
    Both are compared as meta traces: a meta and a real trace of one model may differ in ops
    that compute alike (a view for a reshape).

    Example::

        built = build_rank_stages(model, plan, ...)
        built.eval.traced()   # {}: nothing traced yet
        built.eval.get()      # traced now, on every rank of the pipeline
    """

    def __init__(self, retrace: Retrace, example: tuple[tuple, dict], train_modules: Mapping[int, nn.Module], *,
                 train_graph: list[str] | None) -> None:
        self._retrace = retrace
        self._example = example  # one micro-batch on the meta device, at the training stages' shape
        self._train_modules = dict(train_modules)
        self._train_graph = train_graph  # the training trace's graph_text where it was a meta trace
        self._modules: dict[int, nn.Module] | None = None
        #: Why this pipeline cannot run a separate eval-mode trace (set by data parallelism that
        #: shards the training trace's modules only); None where it can.
        self.refusal: str | None = None
        #: Where torch.fx keeps the source it generated for the eval-mode stages.
        self.generated_source: list[str] = []

    def get(self) -> dict[int, nn.Module]:
        """The eval-mode stage modules by stage index, traced on the first call (collective)."""
        if self._modules is None:
            r = self._retrace
            modules, error = None, None
            try:
                with generated_source_recorded() as keys:
                    modules = self._trace()
                self.generated_source.extend(keys)
            except Exception as e:  # noqa: BLE001 - raised below, on every rank
                error = e
            raise_on_every_rank(error, rank=r.pp_rank, world_size=r.pp_size, group=r.pp_group,
                                what="trace its stages in eval mode")
            self._modules = modules
        return self._modules

    def traced(self) -> dict[int, nn.Module]:
        """The eval-mode stage modules traced so far: empty before the first eval-mode call."""
        return dict(self._modules or {})

    def _trace(self) -> dict[int, nn.Module]:
        r = self._retrace
        train_graph = self._train_graph
        if train_graph is None:  # the training stages came from a real trace: take a meta one to compare
            seen: list[list[str]] = []
            _split_twin(r, self._example, training=True, stop_after_export=lambda graph: seen.append(graph) or True)
            train_graph = seen[0]
        eval_pipe = _split_twin(r, self._example, training=False, stop_after_export=lambda graph: graph == train_graph)
        if eval_pipe is None:
            return dict(self._train_modules)
        if self.refusal is not None:
            raise ValueError(self.refusal)
        modules = _build_eval_modules(eval_pipe, r.stage_indices, r.device, r.names, r.state, r.split_backward,
                                      constants_from=r.traced, pp_group=r.pp_group)
        if r.tp is not None:
            shard_stages(modules, r.tp)
        _guard_and_compile(modules.values(), r.split_backward, r.compile_options)
        return modules


def _build_eval_modules(eval_pipe: Any, stage_indices: Sequence[int], device: torch.device, names: StateNames,
                        state: Mapping[str, torch.Tensor], leaf_per_use: bool,
                        constants_from: Mapping[int, nn.Module], pp_group: Any = None) -> dict[int, nn.Module]:
    """The eval-mode trace of this rank's stages (a meta trace), reading the training stages' tensors (every alias)."""
    modules: dict[int, nn.Module] = {}
    for s in stage_indices:
        # The training stages' tensors, before torch moves the module to the device.
        _read_real_tensors(eval_pipe.get_stage_module(s), names, state, constants_from=constants_from[s])
        module = eval_pipe.build_stage(s, device, pp_group).submod  # the pipeline's group, not the world
        meta_devices_to(module, device)
        missing = sorted(set(stage_state(module, names)) - set(state))
        if missing:
            raise RuntimeError(f"stage {s}'s eval-mode trace reads {missing}, which its training trace "
                               f"does not; autopipe cannot share them between the two traces")
        # Inference with a V schedule runs a backward too (autopipe.runtime.inference), hence leaf_per_use.
        tie_aliases(module, names, state, leaf_per_use=leaf_per_use)
        modules[s] = module.eval()
    return modules


def _check_same_model(model: nn.Module, world_size: int) -> None:
    """Every rank must have been given the same model: names, shapes, dtypes and ties."""
    signature = model_signature(model)
    if len(set(gather_digests(signature, world_size))) == 1:
        return
    signatures: list[Any] = [None] * world_size
    dist.all_gather_object(signatures, signature)  # every rank saw the digests differ
    difference = first_model_difference(signatures) or "the models' signatures differ"
    raise ValueError(
        f"the ranks were given different models (parameter and buffer names, shapes, dtypes or tied "
        f"weights): {difference}. Every rank must build the same model; its values may differ "
        f"(shared copies are taken from the rank that uses them first)"
    )


@torch.no_grad()
def _copy_shared_from_first_use(shared: Sequence[tuple[list[str], Any]], state: Mapping[str, torch.Tensor],
                                first_use: Mapping[str, int]) -> None:
    """Give every copy of a parameter shared across ranks the value of the rank that uses it first."""
    for names, group in shared:
        by_source: dict[int, list[str]] = {}
        for name in names:
            by_source.setdefault(first_use[name], []).append(name)
        for source in sorted(by_source):
            params = [local_tensor(state[n]) for n in by_source[source]]  # a DTensor's: tp ranks hold their own
            flat = torch.cat([p.detach().reshape(-1) for p in params])
            dist.broadcast(flat, src=source, group=group)
            offset = 0
            for p in params:
                p.copy_(flat[offset: offset + p.numel()].view_as(p))
                offset += p.numel()


def manual_stage(module: nn.Module, stage_index: int, num_stages: int, device: torch.device,
                 batch: TracedBatch, group: Any = None) -> PipelineStage:
    """A stage for a V schedule, which learns from the schedule which rank runs each neighbour."""
    first_inputs = tuple(batch.io.stage_inputs(*batch.example)) if stage_index == 0 else None
    inputs, outputs = static_stage_meta(module, first_inputs)
    return VStage(module, stage_index, num_stages, device, input_args=inputs, output_args=outputs, group=group)


def rewrap_stage(stage: PipelineStage, module: nn.Module) -> PipelineStage:
    """A new stage object of the same kind over ``module``, for a separate schedule."""
    return type(stage)(module, stage.stage_index, stage.pipe_info, stage.device, stage.group)


def compile_options(compile: bool | dict[str, Any]) -> dict[str, Any] | None:
    """``PlannerOptions.compile`` as ``torch.compile`` keyword arguments, None for eager.

    Example:
        >>> compile_options(True), compile_options({"backend": "aot_eager"}), compile_options(False)
        ({}, {'backend': 'aot_eager'}, None)
    """
    if compile is False:
        return None
    return {} if compile is True else dict(compile)
