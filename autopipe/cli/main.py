"""The ``autopipe`` command line: profile a model, plan its pipeline, render reports, run a demo."""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import os
import sys
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, NoReturn

from ..planning.options import COST_SOURCE_NAMES, OBJECTIVES, TARGETS

PROG = "autopipe"


class CliError(Exception):
    """A problem with the command line the user can fix; printed as one line, exit status 2."""


# --------------------------------------------------------------------------- help texts

_MODEL_HELP = """\
MODEL is one of:
  path/to/file.py:factory     a function in a file, returning (model, example_args)
                              or (model, example_args, example_kwargs)
  package.module:factory      the same, importable (e.g. autopipe.models:seed_transformer)
  HF_CONFIG                   a Hugging Face config, built with random weights (nothing is
                              downloaded): a folder with config.json, a model type such as
                              gpt2, or a hub id in the local cache
--set KEY=VALUE passes keyword arguments to the factory (values read as JSON when they
parse: 4, 0.1, true, [64, 64]); for a Hugging Face config they override config fields,
and batch=, seq_len= shape the example token ids.
"""

_MAIN_EPILOG = f"""\
examples:
  autopipe profile autopipe.models:seed_transformer --sort time --top 10
  autopipe plan my_model.py:make --gpus 4 --memory 16GiB --out plan.json --report report.html
  autopipe plan gpt2 --set n_layer=4 --gpus 2 --schedule auto --report report.md
  autopipe report plan.json --report report.html --trace trace.json
  autopipe demo --out-dir autopipe-demo
  autopipe run train.py --nproc 2

{_MODEL_HELP}
Run 'autopipe COMMAND --help' for each command's options.
"""

_PROFILE_EPILOG = f"""\
Prints one row per layer: the code between two legal split points, named by the split
point it starts at, with its forward and backward time per micro-batch, parameter bytes,
activation bytes saved for backward, and bytes it hands to later layers.

examples:
  autopipe profile my_model.py:make
  autopipe profile autopipe.models:seed_transformer --set vocab_size=30000 --sort time --top 5
  autopipe profile unet --cost flops --json layers.json --png layers.png
  autopipe profile ./gpt2-config/ --set batch=4 --set seq_len=128 --device cuda

{_MODEL_HELP}"""

_PLAN_EPILOG = f"""\
Prints the split points (a split_spec for torch.distributed.pipelining), each stage's
predicted time and memory, the predicted step time, the usual splits costed the same way,
and a text timeline of one step. Output files:
  --out plan.json          the plan, for 'autopipe report' and autopipe.Pipeline(plan=...)
  --report FILE            .html (self-contained page), .md (Markdown, PNGs beside it in
                           FILE_files/), .json (every number); repeat for several
  --png-dir DIR            the figures as PNG files
  --trace FILE             Chrome trace of the simulated step (chrome://tracing, Perfetto)

examples:
  autopipe plan my_model.py:make --gpus 4
  autopipe plan my_model.py:make --gpus 4 --schedule GPipe --microbatches 16 --memory 24GiB
  autopipe plan my_model.py:make --gpus 2 --memory 8GiB,16GiB --out plan.json --report report.html
  autopipe plan seed_transformer --gpus 2 --schedule auto --report report.md --trace trace.json
  autopipe plan my_model.py:make --gpus 8 --schedule Interleaved1F1B --stages-per-rank 2

{_MODEL_HELP}"""

_REPORT_EPILOG = """\
Reads a plan written by 'autopipe plan --out' (or Plan.save) and renders it again: the
terminal tables, and any of the files below. No model is needed.

examples:
  autopipe report plan.json
  autopipe report plan.json --report report.html --report report.md --report report.json
  autopipe report plan.json --png-dir charts/ --trace trace.json
"""

_DEMO_EPILOG = """\
The seed tutorial split a small Transformer by hand ({"layers.1": SplitPoint.BEGINNING}).
The demo takes the same model with a large vocabulary - so its output layer outweighs the
blocks - and shows what autopipe does instead: profile every layer, plan 2 stages, compare
the plan with the hand split, then train both for a few steps on 2 CPU processes (gloo),
printing the loss and the measured step time beside the predicted one. Everything lands
in --out-dir: plan.json, report.html, report.md (+ PNGs), report.json, and Chrome traces
of the simulated and the measured step.

examples:
  autopipe demo
  autopipe demo --out-dir /tmp/demo --steps 10
  autopipe demo --no-train
"""

_RUN_HELP = """\
usage: autopipe run SCRIPT [--nproc N] [--nnodes M --rdzv-endpoint HOST:PORT] [SCRIPT ARGS ...]

Start SCRIPT on N processes of this machine under torch.distributed.run (torchrun); inside
it, autopipe.Pipeline builds each rank's stages. Across M machines, run the same command on
each with --nnodes M and the address of one of them as --rdzv-endpoint.

examples:
  autopipe run train.py --nproc 2
  autopipe run train.py --nproc 4 --lr 0.1 --steps 100
  autopipe run train.py --nnodes 2 --nproc 8 --rdzv-endpoint node0:29500 --steps 100
"""


# --------------------------------------------------------------------------- parser


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the examples' line breaks; shows defaults where an option has one."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default not in (None, False, argparse.SUPPRESS, [], "==SUPPRESS==") and "%(default)" not in text:
            text += " (default: %(default)s)"
        return text


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad option is one line on stderr (with where to look), not a usage block."""

    def error(self, message: str) -> "NoReturn":  # type: ignore[override]
        print(f"{self.prog}: error: {message} (see '{self.prog} --help')", file=sys.stderr)
        sys.exit(2)


def _int_at_least(minimum: int):
    """An argparse type: an integer >= ``minimum``, with a one-line message otherwise."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{text!r} must be >= {minimum}")
        return value

    return parse


_positive_int = _int_at_least(1)
_nonneg_int = _int_at_least(0)


def _microbatches(text: str) -> int | str:
    if text.strip().lower() == "auto":
        return "auto"
    return _positive_int(text)


def _key_value(text: str) -> tuple[str, Any]:
    from .modelspec import parse_option_value

    key, sep, value = text.partition("=")
    if not sep or not key.strip().isidentifier():
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE with KEY a Python name (e.g. num_layers=4)")
    return key.strip(), parse_option_value(value)


def _add_model_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="MODEL", help="file.py:factory, package.module:factory or HF config")
    p.add_argument("--set", dest="options", metavar="KEY=VALUE", type=_key_value, action="append", default=[],
                   help="keyword argument for the factory / Hugging Face config field (repeatable)")
    p.add_argument("--device", help="device to profile on: cpu, cuda, cuda:1 (default: cuda when present, else cpu)")
    p.add_argument("--cost", choices=COST_SOURCE_NAMES, default="measured",
                   help="measure each layer, or estimate from FLOPs or parameter counts")
    p.add_argument("--repeats", type=_positive_int, default=5, help="timed runs per layer; their mean is kept")
    p.add_argument("--warmup", type=_nonneg_int, default=2, help="untimed runs per layer before timing")
    p.add_argument("--threads", type=_positive_int,
                   help="CPU threads torch may use while profiling (match what each rank will get)")
    p.add_argument("--no-flush-cache", action="store_true",
                   help="keep the caches warm between the profile's passes (default: empty them, as a "
                        "pipeline action finds them)")
    p.add_argument("--fit-to-whole", choices=("auto", "yes", "no"), default="auto",
                   help="scale the segments' times to the whole graph timed beside them (auto: on CUDA only)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def _fit_to_whole(args: argparse.Namespace) -> bool | None:
    return {"auto": None, "yes": True, "no": False}[args.fit_to_whole]


def _add_output_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--report", metavar="FILE", action="append", default=[],
                   help="write the report: .html, .md or .json by suffix (repeatable)")
    p.add_argument("--png-dir", metavar="DIR", help="write the figures as PNG files into DIR")
    p.add_argument("--trace", metavar="FILE", help="write a Chrome trace (JSON) of the simulated step")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``autopipe`` command (sub-commands profile, plan, report, demo, run).

    Example:
        >>> build_parser().parse_args(["plan", "m.py:make", "--gpus", "2"]).gpus
        2
    """
    from .. import __version__

    parser = _Parser(
        prog=PROG, formatter_class=_Formatter, epilog=_MAIN_EPILOG,
        description="Automatic pipeline parallelism for PyTorch: find where to cut a model into "
                    "pipeline stages, explain why, and run it.",
    )
    parser.add_argument("--version", action="version", version=f"autopipe {__version__}")
    parser.add_argument("--debug", action="store_true",
                        help="show full tracebacks and library warnings instead of one-line errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")

    p = sub.add_parser("profile", help="per-layer cost table of a model", formatter_class=_Formatter,
                       epilog=_PROFILE_EPILOG, description="Trace MODEL and measure what every layer costs.")
    _add_model_options(p)
    from ..reporting.data import LAYER_SORT_KEYS

    p.add_argument("--sort", choices=list(LAYER_SORT_KEYS), default="graph",
                   help="graph order, or largest first by total time, forward, backward, params, activations, out")
    p.add_argument("--top", type=_positive_int, help="show only the first N rows (after sorting)")
    p.add_argument("--json", metavar="FILE", help="write the per-layer profile as JSON")
    p.add_argument("--png", metavar="FILE", help="write the per-layer cost chart as PNG")

    p = sub.add_parser("plan", help="find the split points and predict the pipeline", formatter_class=_Formatter,
                       epilog=_PLAN_EPILOG, description="Plan MODEL's pipeline on --gpus ranks.")
    _add_model_options(p)
    p.add_argument("--gpus", type=_positive_int, required=True, help="pipeline ranks (devices)")
    p.add_argument("--schedule", default="1F1B",
                   help="GPipe, 1F1B, Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble, "
                        "DualPipeV, or auto (compare them all)")
    p.add_argument("--microbatches", type=_microbatches,
                   help="micro-batches per step, or auto with --global-batch (default: 2 x gpus)")
    p.add_argument("--global-batch", type=_positive_int, help="samples per step (for --microbatches auto)")
    p.add_argument("--stages-per-rank", type=_positive_int, help="stages per rank for interleaved/V schedules")
    p.add_argument("--memory", help="memory per device: 16GiB, or one per device: 8GiB,16GiB")
    p.add_argument("--optimizer", default="adam", help="optimizer whose state counts toward memory (adam, sgd, ...)")
    p.add_argument("--bandwidth", help="bytes/s between neighbouring devices, e.g. 10GB (default: 2 GB/s CPU, "
                                       "10 GB/s CUDA)")
    p.add_argument("--latency-us", type=float, help="microseconds per message between devices")
    p.add_argument("--action-overhead-ms", type=float,
                   help="milliseconds each pipeline action costs beyond its compute (default: 0.7 on CPU, "
                        "0 on CUDA; measure with autopipe measure --overhead)")
    p.add_argument("--objective", choices=OBJECTIVES, default="step",
                   help="minimise the simulated step, or only the heaviest stage")
    p.add_argument("--target", choices=TARGETS,
                   help="plan for a framework's stages and print its config (torchtitan: [parallelism] TOML; "
                        "megatron: --pipeline-model-parallel-layout and its companions; deepspeed: parts)")
    p.add_argument("--out", metavar="FILE", help="save the plan as JSON")
    _add_output_options(p)

    p = sub.add_parser("report", help="re-render a saved plan", formatter_class=_Formatter,
                       epilog=_REPORT_EPILOG, description="Render a saved plan again.")
    p.add_argument("plan_file", metavar="PLAN_JSON", help="a plan written by 'autopipe plan --out'")
    _add_output_options(p)

    p = sub.add_parser("demo", help="profile, plan, compare and train the seed Transformer on 2 CPU processes",
                       formatter_class=_Formatter, epilog=_DEMO_EPILOG,
                       description="autopipe end to end on the seed tutorial's Transformer.")
    p.add_argument("--out-dir", default="autopipe-demo", help="folder for the plan, reports and traces")
    p.add_argument("--steps", type=_positive_int, default=8, help="training steps per split")
    p.add_argument("--no-train", action="store_true", help="stop after planning (no processes are started)")
    p.add_argument("--vocab-size", type=_positive_int, default=10000, help="vocabulary of the Transformer")
    p.add_argument("--layers", type=_positive_int, default=4, help="Transformer blocks")

    sub.add_parser("run", help="start a training script on N processes (torchrun)", add_help=False,
                   formatter_class=_Formatter, description=_RUN_HELP)
    sub.add_parser("measure", help="measure this host's link between ranks, kept for later plans", add_help=False)
    sub.add_parser("layout", help="tp x pp x dp layout of a Transformer on N GPUs, from a config.json or a name",
                   add_help=False)
    return parser


# --------------------------------------------------------------------------- helpers


@contextlib.contextmanager
def _quiet_libraries(debug: bool) -> Iterator[None]:
    """Hide library warnings (torch.export, transformers) unless --debug: the tables are the output."""
    if debug:
        yield
        return
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    levels = {name: logging.getLogger(name).level for name in ("torch", "transformers")}
    for name in levels:
        logging.getLogger(name).setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            yield
        finally:
            for name, level in levels.items():
                logging.getLogger(name).setLevel(level)


def _status(message: str) -> None:
    """A progress line on stderr, only when a person is watching (stderr is a terminal)."""
    if sys.stderr.isatty():
        print(message, file=sys.stderr, flush=True)


def _spinner(message: str) -> Any:
    """A spinner on stderr while ``message`` is under way; nothing when stderr is not a terminal."""
    if not sys.stderr.isatty():
        return contextlib.nullcontext()
    from rich.console import Console

    return Console(stderr=True).status(message)


def _check_outputs(args: argparse.Namespace) -> None:
    """Every output path is checked before any tracing or profiling starts."""
    from ..reporting.files import check_writable, report_format

    for path in getattr(args, "report", []) or []:
        try:
            report_format(path)
        except ValueError as e:
            raise CliError(f"--report: {e}") from None
        check_writable(path, what="--report")
    for option in ("out", "trace", "json", "png"):
        path = getattr(args, option, None)
        if path:
            check_writable(path, what=f"--{option}")
    if getattr(args, "png", None) and Path(args.png).suffix.lower() != ".png":
        raise CliError(f"--png {args.png!r} must end in .png")
    if getattr(args, "png_dir", None):
        check_writable(args.png_dir, what="--png-dir", directory=True)


def _load_model(args: argparse.Namespace) -> Any:
    from .modelspec import load_model_spec

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    _status(f"building {args.model} ...")
    return load_model_spec(args.model, options=dict(args.options))


def _bandwidth(text: str | None) -> float | None:
    if text is None:
        return None
    from ..machine.device import parse_bytes

    try:
        return float(parse_bytes(text.strip().removesuffix("/s"), name="--bandwidth"))
    except ValueError:
        raise CliError(f"--bandwidth {text!r} is not a rate; give bytes per second such as 10GB, 1.5GB/s, "
                       "800MiB/s or 25e9") from None


def _memory(text: str | None) -> Any:
    if text is None:
        return None
    parts = [p.strip() for p in text.split(",")]
    return parts if len(parts) > 1 else parts[0]


def _write_plan_outputs(plan: Any, args: argparse.Namespace, data: dict[str, Any], timeline: Any) -> list[Path]:
    from ..reporting.chrome import simulated_trace
    from ..reporting.files import write_json, write_report

    written: list[Path] = []
    if getattr(args, "out", None):
        plan.save(args.out)
        written.append(Path(args.out))
    for path in args.report:
        _status(f"writing {path} ...")
        written += write_report(data, path)
    if args.png_dir:
        from ..reporting.charts import save_pngs

        written += list(save_pngs(data, args.png_dir).values())
    if args.trace:
        written.append(write_json(simulated_trace(plan, timeline=timeline), args.trace))
    return written


def _print_written(paths: list[Path]) -> None:
    if paths:
        print("wrote " + ", ".join(str(p) for p in paths))


# --------------------------------------------------------------------------- commands


def _cmd_profile(args: argparse.Namespace) -> int:
    _check_outputs(args)
    loaded = _load_model(args)
    from ..planning.profile import profile_segments
    from ..reporting.data import layer_rows, sort_layer_rows
    from ..reporting.terminal import print_layers
    from ..planning.tracing import trace

    with _spinner(f"tracing {type(loaded.model).__name__} with torch.export ..."):
        traced = trace(loaded.model, loaded.example_args, loaded.example_kwargs)
    costs = profile_segments(traced, cost=args.cost, device=args.device, warmup=args.warmup,
                             repeats=args.repeats, progress=not args.no_progress,
                             flush_cache=not args.no_flush_cache, fit_to_whole=_fit_to_whole(args))
    rows = layer_rows(traced, costs)
    shown = sort_layer_rows(rows, args.sort)[: args.top]
    order = "graph order" if args.sort == "graph" else f"largest {args.sort} first"
    title = f"{traced.model_name}: {len(rows)} layers ({order}{', top ' + str(args.top) if args.top else ''}), " \
            f"cost {args.cost} on {args.device or _default_device()}"
    print_layers(shown, title=title, totals_of=rows)
    written: list[Path] = []
    if args.json:
        from ..reporting.files import write_json

        written.append(write_json({"model": traced.model_name, "spec": args.model, "cost_source": args.cost,
                                   "layers": rows}, args.json))
    if args.png:
        from ..reporting.charts import layer_cost_figure

        layer_cost_figure(rows, title=f"Per-layer cost - {traced.model_name}").savefig(args.png, dpi=110)
        written.append(Path(args.png))
    _print_written(written)
    return 0


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _cmd_plan(args: argparse.Namespace) -> int:
    _check_outputs(args)
    bandwidth = _bandwidth(args.bandwidth)
    if args.latency_us is not None and args.latency_us < 0:
        raise CliError(f"--latency-us {args.latency_us} must be >= 0 microseconds")
    if args.action_overhead_ms is not None and not 0 <= args.action_overhead_ms < math.inf:
        raise CliError(f"--action-overhead-ms {args.action_overhead_ms} must be a finite time >= 0 milliseconds")
    loaded = _load_model(args)
    import autopipe

    _status(f"tracing and profiling {type(loaded.model).__name__} ...")
    device = autopipe.Device(
        bandwidth=bandwidth, latency_s=None if args.latency_us is None else args.latency_us * 1e-6,
        action_overhead_s=None if args.action_overhead_ms is None else args.action_overhead_ms * 1e-3)
    profiling = autopipe.ProfileOptions(
        device=args.device, warmup=args.warmup, repeats=args.repeats, progress=not args.no_progress,
        flush_cache=not args.no_flush_cache, fit_to_whole=_fit_to_whole(args))
    planner = autopipe.PlannerOptions(
        devices=device, memory=_memory(args.memory), cost=args.cost, profiling=profiling, objective=args.objective,
        optimizer=args.optimizer, global_batch=args.global_batch, stages_per_rank=args.stages_per_rank,
        target=args.target)
    plan = autopipe.partition(loaded.model, args.gpus, loaded.example_args, loaded.example_kwargs,
                              schedule=args.schedule, n_microbatches=args.microbatches, planner=planner)
    return _show_plan(plan, args)


def _show_plan(plan: Any, args: argparse.Namespace) -> int:
    """Print a plan with its simulated timeline, and write the files the options ask for."""
    from ..reporting.data import report_data
    from ..reporting.terminal import print_plan
    from ..reporting.timeline import plan_timeline

    timeline = plan_timeline(plan)
    data = report_data(plan, timeline=timeline)
    print_plan(data, gantt=timeline.to_text())
    if plan.target == "torchtitan":  # the lines to paste into torchtitan's train config
        print(f"\ntorchtitan config (paste into your train config):\n{plan.to_torchtitan(as_toml=True)}")
    if plan.target == "deepspeed":  # the boundaries for PipelineModule (docs/frameworks.md)
        print(f"\nDeepSpeed PipelineModule boundaries: parts = {plan.to_deepspeed()['parts']}")
    if plan.target == "megatron":  # the arguments to hand to Megatron-Core's training script
        flags = " ".join(f"--{key.replace('_', '-')} " + (repr(value) if isinstance(value, str) else str(value))
                         for key, value in plan.to_megatron().items())
        print(f"\nMegatron-Core arguments:\n{flags}")
    _print_written(_write_plan_outputs(plan, args, data, timeline))
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    path = Path(args.plan_file)
    if not path.is_file():
        raise CliError(f"PLAN_JSON {args.plan_file!r} does not exist" if not path.exists()
                       else f"PLAN_JSON {args.plan_file!r} is not a file")
    _check_outputs(args)
    from ..planning.plan import Plan

    try:
        plan = Plan.load(path)
    except (KeyError, TypeError) as e:  # a JSON file, but not of a plan
        raise CliError(f"PLAN_JSON {args.plan_file!r} is not an autopipe plan (missing or unexpected field: {e})") from e
    return _show_plan(plan, args)


def _cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo
    from ..reporting.files import check_writable

    check_writable(args.out_dir, what="--out-dir", directory=True)
    run_demo(out_dir=args.out_dir, steps=args.steps, train=not args.no_train,
             vocab_size=args.vocab_size, num_layers=args.layers)
    return 0


def _cmd_run(argv: Sequence[str]) -> int:
    if argv[:1] in (["-h"], ["--help"]):
        print(_RUN_HELP)
        return 0
    try:
        from ..runtime.launch import main as launch_main
    except ImportError as e:
        raise CliError(f"the runtime launcher is not available in this install ({e})") from None
    return launch_main(list(argv))


_COMMANDS = {"profile": _cmd_profile, "plan": _cmd_plan, "report": _cmd_report, "demo": _cmd_demo}


# --------------------------------------------------------------------------- entry point


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    if isinstance(e, KeyError) and text.startswith(("'", '"')):
        text = text[1:-1]  # KeyError quotes its message
    return text or type(e).__name__


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``autopipe`` command line; return the exit status.

    Example:
        >>> main(["report", "plan.json", "--report", "report.html"])  # doctest: +SKIP
        0
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    # `run` hands every argument after it to the training script, so argparse never sees them.
    first = next((i for i, a in enumerate(argv) if not a.startswith("-")), None)
    if first is not None and argv[first] == "run":
        try:
            return _cmd_run(argv[first + 1:])
        except CliError as e:
            print(f"{PROG} run: error: {e}", file=sys.stderr)
            return 2
    if first is not None and argv[first] == "measure":  # its own parser (autopipe measure)
        from .measure import main as measure_main

        return measure_main(argv[first + 1:])
    if first is not None and argv[first] == "layout":  # its own parser (autopipe layout)
        from .layout import main as layout_main

        try:
            return layout_main(argv[first + 1:])
        except ValueError as e:
            print(f"{PROG} layout: error: {_one_line(e)}", file=sys.stderr)
            return 2
    parser = build_parser()
    args = parser.parse_args(argv)
    command = args.command
    if command is None:
        parser.print_help()
        return 2
    try:
        with _quiet_libraries(args.debug):
            return _COMMANDS[command](args)
    except KeyboardInterrupt:
        print(f"{PROG} {command}: interrupted", file=sys.stderr)
        return 130
    except CliError as e:
        if args.debug:
            raise
        print(f"{PROG} {command}: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - the CLI's promise: one line, not a traceback wall
        if args.debug:
            raise
        from ..errors import AutopipeError

        expected = isinstance(e, (AutopipeError, ValueError, TypeError, OSError, KeyError, ImportError))
        hint = "" if expected else f" ({type(e).__name__}; rerun with --debug for the traceback)"
        print(f"{PROG} {command}: error: {_one_line(e)}{hint}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
