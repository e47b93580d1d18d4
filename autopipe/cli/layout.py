"""``autopipe layout``: the layout of a Transformer on a GPU cluster, searched or checked.

The model is a named shape (``llama3-70b``), a Hugging Face ``config.json`` (a file or its
folder), or a factory (``package.module:factory``, ``file.py:factory``) built on the meta
device and traced, its shape read from the graph: nothing is downloaded or run. With every degree given (``--tp --pp
--dp --micro-batch``), that layout alone is predicted; otherwise every layout is searched
and the fastest that fits is printed with the runners-up, then in torchtitan's and
Megatron-LM's words.

Example::

    autopipe layout llama3-70b --gpus 256 --global-batch 512 --device H100
    autopipe layout path/to/config.json --gpus 64 --global-batch 128 --seq-len 4096
    autopipe layout mypkg.models:build_llama --gpus 64 --global-batch 128   # traced on meta
    autopipe layout llama3-70b --gpus 256 --global-batch 512 --tp 8 --pp 1 --dp 32 --micro-batch 16 \\
        --recompute full --dp-mode fsdp          # predict the layout you run today
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from ..layouts.blocks import RECOMPUTE_MODES
from ..layouts.gpu import GpuCosts
from ..layouts.search import search_layouts
from ..layouts.shapes import NAMED_SHAPES, TransformerShape
from ..layouts.layout import DP_MODES, LAYOUT_SCHEDULES, Layout
from ..layouts.step import StepPrediction, predict_step
from ..machine.device import parse_bytes
from ..machine.presets import ACCELERATORS, LINKS, find_accelerator
from ..machine.topology import Topology

_GIVEN = ("tp", "pp", "dp", "micro_batch")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="autopipe layout", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help=f"a named shape ({', '.join(sorted(NAMED_SHAPES))}), a Hugging Face config.json "
                                 "(file or folder), or package.module:factory / file.py:factory (traced on meta)")
    p.add_argument("--gpus", type=int, required=True, help="GPUs in all")
    p.add_argument("--global-batch", type=int, required=True, help="sequences per step")
    p.add_argument("--seq-len", type=int, help="tokens per sequence (default: the shape's)")
    p.add_argument("--device", default="H100", help=f"accelerator: {', '.join(sorted(ACCELERATORS))}")
    p.add_argument("--memory", help="memory per GPU in place of the data sheet's, e.g. 96GB")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--intra", default=None, help=f"link inside a node ({', '.join(sorted(LINKS))}); default: the "
                                                  "accelerator's")
    p.add_argument("--inter", default="ib-ndr", help="link between nodes, per GPU")
    p.add_argument("--dtype", default="bf16", help="training dtype: bf16 or fp16")
    p.add_argument("--no-flash", action="store_true", help="an unfused attention kernel")
    p.add_argument("--float8", action="store_true", help="the blocks' GEMMs in float8")
    p.add_argument("--compile", action="store_true", help="stages compiled")
    p.add_argument("--async-tp", action="store_true", help="tensor-parallel collectives overlapped with the GEMMs")
    p.add_argument("--sp-regather", action="store_true",
                   help="sequence parallelism gathers the inputs again in the backward (Megatron-LM); default: "
                        "kept whole, as torch's tensor-parallel API (torchtitan, autopipe) keeps them")
    p.add_argument("--top", type=int, default=5, help="how many layouts to list")
    p.add_argument("--json", metavar="FILE", help="write the layouts listed as JSON")
    given = p.add_argument_group("a layout to predict (all four degrees given: no search)")
    for name in _GIVEN:
        given.add_argument(f"--{name.replace('_', '-')}", type=int)
    given.add_argument("--schedule", choices=LAYOUT_SCHEDULES, default="1F1B")
    given.add_argument("--virtual-stages", type=int, default=1)
    given.add_argument("--recompute", choices=RECOMPUTE_MODES, default="none")
    given.add_argument("--recompute-layers", type=int, help="blocks per pipeline rank that checkpoint")
    given.add_argument("--dp-mode", choices=DP_MODES, default="replicate")
    given.add_argument("--no-sequence-parallel", action="store_true")
    return p


def load_shape(model: str, seq_len: int | None) -> TransformerShape:
    """A named shape, or the shape a config.json describes; ``seq_len`` in place of its own."""
    if model.lower() in NAMED_SHAPES:
        shape = TransformerShape.named(model)
        return shape.with_seq_len(seq_len) if seq_len else shape
    path = Path(model)
    if path.exists():
        return TransformerShape.from_hf_config(path, seq_len=seq_len, name=path.stem if path.is_file() else path.name)
    if ":" in model:
        return _traced_shape(model, seq_len)
    raise ValueError(f"model={model!r} is neither a named shape ({', '.join(sorted(NAMED_SHAPES))}), a config.json "
                     "file or folder, nor a package.module:factory")


def _traced_shape(spec: str, seq_len: int | None) -> TransformerShape:
    """Build the factory's model and example on the meta device, trace it, read its shape."""
    import torch

    from ..layouts.sharding import shape_from_graph
    from ..planning.tracing import trace
    from .modelspec import load_model_spec

    with torch.device("meta"):
        loaded = load_model_spec(spec)
    args = loaded.example_args or ()
    first = next((a for a in args if isinstance(a, torch.Tensor)), None)
    if first is None or first.dim() < 2:
        raise ValueError(f"model={spec!r}: its example must start with a (batch, sequence) tensor of token ids")
    shape = shape_from_graph(trace(loaded.model, args, loaded.example_kwargs).exported,
                             seq_len=int(first.shape[1]), name=spec)
    return shape.with_seq_len(seq_len) if seq_len else shape


def _row(p: StepPrediction, why: str) -> str:
    return (f"{p.layout.describe():<78} {p.tokens_per_s_per_gpu:>10,.0f} {p.mfu:>6.1%} "
            f"{p.memory_bytes / 1e9:>7.1f} GB  {why}")


def main(argv: Sequence[str] | None = None) -> int:
    """``autopipe layout``: print the fastest layout that fits (or the one given), with its parts."""
    args = build_parser().parse_args(argv)
    shape = load_shape(args.model, args.seq_len)
    accelerator = ACCELERATORS[find_accelerator(args.device) or "H100"]  # GpuCosts names an unknown one
    topology = Topology(gpus_per_node=args.gpus_per_node, intra=args.intra or accelerator.link, inter=args.inter)
    gpu = GpuCosts(args.device, topology, dtype=args.dtype,
                   memory_bytes=parse_bytes(args.memory, name="--memory") if args.memory else None)
    runtime = Layout(flash=not args.no_flash, float8=args.float8, compiled=args.compile, async_tp=args.async_tp,
                     sp_regather=args.sp_regather)
    given = {name: getattr(args, name) for name in _GIVEN if getattr(args, name) is not None}
    if given and len(given) < len(_GIVEN):
        raise ValueError(f"to predict a layout give all of --tp --pp --dp --micro-batch (missing: "
                         f"{', '.join('--' + n.replace('_', '-') for n in _GIVEN if n not in given)})")
    print(f"{shape.name or 'model'}: {shape.layers} blocks, hidden {shape.hidden}, {shape.heads} heads "
          f"({shape.kv_heads} key-value), {shape.params() / 1e9:.2f} B parameters, {shape.seq_len} tokens a sequence; "
          f"{args.gpus} x {gpu.name} ({gpu.memory_bytes / 1e9:.0f} GB), {args.gpus_per_node} per node; "
          f"global batch {args.global_batch}")
    header = f"{'layout':<78} {'tokens/s/GPU':>10} {'MFU':>6} {'memory':>10}  what holds it back"
    if given:
        layout = replace(runtime, **given, global_batch=args.global_batch, schedule=args.schedule,
                         virtual_stages=args.virtual_stages, recompute=args.recompute,
                         recompute_layers=args.recompute_layers, dp_mode=args.dp_mode,
                         sequence_parallel=given["tp"] > 1 and not args.no_sequence_parallel)
        if layout.n_gpus != args.gpus:
            raise ValueError(f"--tp x --pp x --dp = {layout.n_gpus}, not --gpus {args.gpus}")
        chosen = predict_step(shape, layout, gpu)
        listed = [chosen]
        fits = chosen.memory_bytes <= gpu.memory_bytes
        print(header)
        print(_row(chosen, _largest_parts(chosen) + ("" if fits else "; DOES NOT FIT in memory")))
    else:
        found = search_layouts(shape, args.gpus, global_batch=args.global_batch, gpu=gpu, base=runtime,
                               keep=max(args.top, 1))
        chosen = found.best
        listed = found.ranked[:args.top]
        print(f"{found.considered} layouts considered, {found.over_memory} over memory"
              + (f", {sum(found.not_runnable.values())} not runnable" if found.not_runnable else ""))
        print(header)
        for i, p in enumerate(listed):
            print(_row(p, _largest_parts(p) if i == 0 else found.why_slower(p)))
    print("\nwhere the step goes: " + ", ".join(f"{k.replace('_', ' ')} {v:.3g} s"
                                               for k, v in chosen.parts_s.items() if v > 0))
    try:
        print("torchtitan:", json.dumps(chosen.to_torchtitan()))
    except ValueError as e:
        print(f"torchtitan: {e}")
    try:
        print("Megatron-LM:", " ".join(chosen.to_megatron()))
    except ValueError as e:
        print(f"Megatron-LM: {e}")
    try:
        print("autopipe.Pipeline:", ", ".join(f"{k}={_changed(v)}" for k, v in chosen.to_pipeline().items()))
    except ValueError as e:
        print(f"autopipe.Pipeline: {e}")
    if args.json:
        Path(args.json).write_text(json.dumps([p.to_dict() for p in listed], indent=1) + "\n")
    return 0


def _largest_parts(p: StepPrediction) -> str:
    """The step's largest parts beside compute."""
    others = sorted(((v, k) for k, v in p.parts_s.items() if k != "compute" and v > 0), reverse=True)[:2]
    return ", ".join(f"{k.replace('_', ' ')} {v / p.step_s:.0%}" for v, k in others) or "compute only"


def _changed(value: object) -> str:
    """``value`` as Python, an options object with only the fields it changes from their defaults."""
    if not dataclasses.is_dataclass(value):
        return repr(value)
    changed = [f"{f.name}={getattr(value, f.name)!r}" for f in dataclasses.fields(value)
               if getattr(value, f.name) != f.default]
    return f"{type(value).__name__}({', '.join(changed)})"
