"""Plans for the frameworks users train with: cut where a framework can cut, say the split in its words.

torchtitan builds its pipeline stages from a list of module names per stage
(``[parallelism] module_fqns_per_model_part``): each name is a child of the model
(``tok_embeddings``, ``norm``, ``output``) or an entry of a child that is a layer container
(``layers.3``); every other child is dropped from that stage. So a torchtitan plan cuts only
before such a module (:func:`restrict_to_target`) and exports each stage's list
(:func:`torchtitan_config`, ``plan.to_torchtitan()``).

Megatron-Core places whole decoder layers, with the embedding ahead of the first and the
loss (final norm, output layer) after the last: ``--pipeline-model-parallel-layout
"Ettt|tttL"``. A Megatron plan cuts only before a decoder layer or before what follows the
last one (:func:`megatron_layout`, ``plan.to_megatron()``).

DeepSpeed's ``PipelineModule`` takes a list of layers and partitions it by boundaries
(``parts``): a DeepSpeed plan is made for ``nn.Sequential(*layers)``, cuts only between its
entries and exports the boundaries (:func:`deepspeed_parts`, ``plan.to_deepspeed()``).

Example:
    >>> print(toml({"parallelism": {"pipeline_parallel_degree": 2,
    ...                             "module_fqns_per_model_part": [["tok_embeddings", "layers.0"], ["norm"]]}}))
    [parallelism]
    pipeline_parallel_degree = 2
    module_fqns_per_model_part = [["tok_embeddings", "layers.0"], ["norm"]]
"""

from __future__ import annotations

import json
from typing import Any

import torch

from .options import TARGETS
from .schedules import schedule_spec
from .tracing import SplitCandidate, TracedModel, module_spans, with_candidates

_CONTAINERS = (torch.nn.ModuleList, torch.nn.ModuleDict)


def decoder_layers(model: torch.nn.Module) -> tuple[str, list[str]]:
    """The model's decoder layers as Megatron counts them: its one stack of layers and that stack's entries.

    A stack is a layer container (``nn.ModuleList`` / ``nn.ModuleDict``) not inside another, with
    entries that hold parameters. Megatron-Core's layout (``E t…t L``) places one such stack.

    Raises:
        ValueError: the model has no stack, or several (an encoder and a decoder), which the
            layout cannot express.
    """
    stacks: list[tuple[str, list[str]]] = []
    for name, m in model.named_modules():
        inside = any(name.startswith(outer + ".") for outer, _ in stacks)
        if name and isinstance(m, _CONTAINERS) and not inside:
            entries = [f"{name}.{key}" for key, child in m.named_children() if any(True for _ in child.parameters())]
            if entries:
                stacks.append((name, entries))
    if not stacks:
        raise ValueError("target='megatron' places whole decoder layers, but the model has no layer container "
                         "(nn.ModuleList or nn.ModuleDict of its blocks)")
    if len(stacks) > 1:
        found = ", ".join(f"{name} ({len(entries)} layers)" for name, entries in stacks)
        raise ValueError(f"target='megatron' places one stack of decoder layers (--pipeline-model-parallel-layout "
                         f"'Ett|ttL'), but {type(model).__name__} has several: {found}. Megatron-Core's layout "
                         f"cannot express the others, so its export would not be this model: plan it for autopipe's "
                         f"own Pipeline (no target) or for torchtitan (target='torchtitan')")
    return stacks[0]


def target_units(model: torch.nn.Module) -> set[str]:
    """The module names torchtitan can place on a stage: the model's children and its layer containers' entries."""
    units = set()
    for name, child in model.named_children():
        if isinstance(child, _CONTAINERS):
            units.update(f"{name}.{key}" for key, _ in child.named_children())
        else:
            units.add(name)
    return units


def restrict_to_target(traced: TracedModel, model: torch.nn.Module, target: str) -> TracedModel:
    """``traced`` cut only where ``target`` can cut (``target`` one of :data:`TARGETS`)."""
    if target not in TARGETS:
        raise ValueError(f"target={target!r} is not a framework autopipe plans for; use one of {list(TARGETS)}")
    if target == "megatron":
        units = set(_megatron_cuts(traced, model))
    elif target == "deepspeed":
        if not isinstance(model, torch.nn.Sequential):
            raise ValueError(f"target='deepspeed' plans the layer list a PipelineModule takes; pass it as "
                             f"nn.Sequential(*layers), not a {type(model).__name__}")
        _check_numbered(name for name, _ in model.named_children())
        units = {name for name, _ in model.named_children()}
    else:
        units = target_units(model)
    inside = _inside_shared_units(traced, units) if target == "torchtitan" else {}

    def cuttable(c: SplitCandidate) -> bool:
        return c.name not in inside and (c.name in units or any(a in units for a in c.aliases))

    restricted = with_candidates(traced, cuttable)
    restricted.excluded_cuts = {**traced.excluded_cuts, **inside}
    return restricted


def _inside_shared_units(traced: TracedModel, units: set[str]) -> dict[str, str]:
    """The candidates between the first and last call of a unit called more than once, with why: torchtitan
    builds each stage from its module list, so a module two stages call would be in one only (or copied,
    its parameters no longer shared)."""
    spans, called_twice = module_spans(traced.nodes)
    inside: dict[str, str] = {}
    for unit in sorted(units & called_twice):
        first, last = spans[unit][0], spans[unit][-1]
        for c in traced.candidates:
            if first < c.position <= last:
                inside.setdefault(c.name, f"{unit} runs on both sides, and torchtitan places a module on one stage")
    return inside


def _check_numbered(names: Any) -> None:
    """DeepSpeed numbers a PipelineModule's layers by position: refuse a Sequential whose entries have names."""
    named = [n for n in names if not n.isdigit()]
    if named:
        raise ValueError(f"target='deepspeed' numbers the layers by their position in the list a PipelineModule "
                         f"takes, but this nn.Sequential names its entries ({', '.join(named[:4])}): build it as "
                         f"nn.Sequential(*layers) (positions 0, 1, ...) and plan that, so the split points are the "
                         f"layer indices DeepSpeed uses")


def _megatron_cuts(traced: TracedModel, model: torch.nn.Module) -> list[str]:
    """Before every decoder layer, and before the first split point after the last one (the loss part)."""
    container, layers = decoder_layers(model)
    at = {name: c for c in traced.candidates for name in (c.name, *c.aliases)}
    missing = [name for name in layers[1:] if name not in at]
    if missing:
        raise ValueError(f"target='megatron' cuts between whole decoder layers of {container!r}, but "
                         f"{missing[:3]} cannot be cut before (each layer must run once, its operations together)")
    last = max((at[name].position for name in layers if name in at), default=0)
    after = next((c.name for c in traced.candidates if c.position > last and c.name not in layers
                  and not c.name.startswith(layers[-1] + ".")), None)
    return [*layers, *([after] if after else [])]


def _check_made_for(plan: Any, target: str, framework: str) -> None:
    """Refuse to export a plan made for another granularity than ``target``'s."""
    if plan.target != target:
        raise ValueError(f"the plan was made for target={plan.target or None!r}, whose split points {framework} "
                         f"may not be able to cut at: plan with PlannerOptions(target={target!r})")


def torchtitan_config(plan: Any) -> dict[str, Any]:
    """The ``[parallelism]`` fields that make torchtitan build a :class:`~autopipe.planning.Plan`'s stages.

    ``module_fqns_per_model_part`` lists each stage's modules in stage order; torchtitan
    places stage ``s`` on a rank as its schedule does, as autopipe's plan does. torchtitan
    applies one activation-checkpointing policy to every stage, so a plan that recomputes
    only some stages gives them under ``autopipe.recompute_stages`` for a ``parallelize_fn``
    to read.

    Raises:
        ValueError: the plan was made for another granularity than torchtitan's (its split
            points may fall inside a module torchtitan places whole).
    """
    _check_made_for(plan, "torchtitan", "torchtitan")
    parts = [list(stage.fqns) for stage in plan.stages]
    layers = [sum(1 for name in fqns if "." in name) for fqns in parts]
    parallelism: dict[str, Any] = {
        "pipeline_parallel_degree": plan.pp_degree,
        "pipeline_parallel_schedule": plan.schedule,
        "module_fqns_per_model_part": parts,
    }
    if plan.microbatch_size is not None:  # from the global batch, else the traced example's rows
        parallelism["pipeline_parallel_microbatch_size"] = plan.microbatch_size
    config: dict[str, Any] = {"parallelism": parallelism, "autopipe": {"layers_per_stage": layers}}
    if plan.recompute_stages:
        config["autopipe"]["recompute_stages"] = list(plan.recompute_stages)
    return config


def megatron_layout(plan: Any) -> dict[str, Any]:
    """Megatron-Core's arguments for a :class:`~autopipe.planning.Plan` made with ``target="megatron"``.

    ``pipeline_model_parallel_layout`` names each stage in stage order (Megatron's virtual
    stages, placed in loops as the plan's schedule places them): ``E`` the embedding, one
    ``t`` per decoder layer, ``L`` the loss (final norm and output layer), stages split by
    ``|``.

    Raises:
        ValueError: the plan was made for another granularity, or its schedule places stages
            in a V (Megatron places virtual stages in loops).
    """
    _check_made_for(plan, "megatron", "Megatron-Core")
    if schedule_spec(plan.schedule).placement == "v":
        raise ValueError(f"schedule {plan.schedule!r} places stages in a V; Megatron-Core's virtual stages are "
                         "placed in loops: plan with 1F1B or Interleaved1F1B")
    names = [name for stage in plan.stages for name in stage.fqns]
    containers = sorted({n.rsplit(".", 1)[0] for n in names if "." in n})
    if len(containers) > 1:
        raise ValueError(f"the plan places layers of several containers ({', '.join(containers)}); Megatron-Core's "
                         f"layout places one stack of decoder layers, so it cannot express this model")
    container = containers[0] if containers else ""
    layers = [sum(1 for n in stage.fqns if "." in n and n.rsplit(".", 1)[0] == container) for stage in plan.stages]
    stages = ["E" * (s == 0) + "t" * k + "L" * (s == plan.num_stages - 1) for s, k in enumerate(layers)]
    config: dict[str, Any] = {
        "pipeline_model_parallel_layout": "|".join(stages),
        "pipeline_model_parallel_size": plan.pp_degree,
        "num_layers": sum(layers),
    }
    if plan.stages_per_rank > 1:
        config["virtual_pipeline_model_parallel_size"] = plan.stages_per_rank
    if plan.microbatch_size is not None:
        config["micro_batch_size"] = plan.microbatch_size
    return config


def deepspeed_parts(plan: Any, num_layers: int | None = None) -> dict[str, Any]:
    """The ``parts`` boundaries of a :class:`~autopipe.planning.Plan` made with ``target="deepspeed"``.

    ``parts[s]`` is the index of stage ``s``'s first layer in the list, and the last entry the
    number of layers (``num_layers``: by default one past the last layer a stage runs; give
    ``len(layers)`` when trailing layers do no work). DeepSpeed runs one stage per rank.

    Raises:
        ValueError: the plan was made for another granularity, or holds several stages per rank.
    """
    _check_made_for(plan, "deepspeed", "DeepSpeed")
    if plan.stages_per_rank != 1:
        raise ValueError(f"DeepSpeed's PipelineModule runs one stage per rank; the plan has {plan.stages_per_rank}: "
                         "plan with GPipe or 1F1B")
    _check_numbered(plan.split_points)
    used = [int(name) for stage in plan.stages for name in stage.fqns if name.isdigit()]
    end = max(used, default=-1) + 1 if num_layers is None else num_layers
    parts = [0, *(int(name) for name in plan.split_points), end]
    if any(b <= a for a, b in zip(parts, parts[1:])):
        raise ValueError(f"num_layers={num_layers} does not fit the plan's boundaries {parts[:-1]}")
    return {"parts": parts, "num_stages": plan.num_stages}


def versus_default(plan: Any) -> str | None:
    """One line: the plan's predicted step against its target framework's own default split, or None."""
    if plan.target != "torchtitan":
        return None
    default = next((b for b in plan.baselines if b.name == "torchtitan_default"), None)
    if default is None or not default.split_points:
        why = default.reason if default is not None else "no default split was costed"
        return f"versus torchtitan's default split: not comparable ({why})"
    gain = default.predicted_step_s / plan.predicted_step_s - 1.0 if plan.predicted_step_s > 0 else 0.0
    return (f"versus torchtitan's default split {default.split_points}: predicted {gain:.0%} faster "
            f"({plan.predicted_step_s * 1e3:.3g} ms against {default.predicted_step_s * 1e3:.3g} ms per step)"
            + ("" if default.fits_memory else "; the default does not fit the memory given"))


def torchtitan_toml(plan: Any) -> str:
    """The ``[parallelism]`` lines to paste into torchtitan's train config, the rest as comments."""
    config = torchtitan_config(plan)
    extra = "".join(f"\n# {key}: {value}" for key, value in config["autopipe"].items())
    return toml({"parallelism": config["parallelism"]}) + extra + f"\n# {versus_default(plan)}"


def toml(config: dict[str, dict[str, Any]]) -> str:
    """``config`` (sections of numbers, strings and lists) as TOML to paste into a framework's config file."""
    lines: list[str] = []
    for section, fields in config.items():
        lines += ([""] if lines else []) + [f"[{section}]"]
        lines += [f"{key} = {json.dumps(value)}" for key, value in fields.items()]
    return "\n".join(lines)
