"""``autopipe demo``: the whole story on the seed tutorial's Transformer, in well under a minute.

Example:
    >>> from autopipe.cli.demo import run_demo
    >>> result = run_demo(out_dir="/tmp/autopipe-demo", steps=4)  # doctest: +SKIP
    >>> result["measured"]["runs"][0]["name"]  # doctest: +SKIP
    'autopipe'
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from .._checks import check_int
from .._spawn import finish_rank, join_loopback_world, spawn_ranks
from ..planning.options import PlannerOptions

DEMO_RANKS = 2  # CPU processes, one pipeline stage each
DEMO_SCHEDULE = "1F1B"
DEMO_MICROBATCHES = 4
_WORKER_TIMEOUT_S = 150.0  # the whole training run; a stuck rank is killed after this


def _model_config(vocab_size: int, num_layers: int) -> dict[str, Any]:
    """Sizes of the demo Transformer: tutorial architecture, large vocabulary, CPU-sized."""
    return {"vocab_size": vocab_size, "d_model": 128, "num_heads": 4, "d_ff": 512,
            "num_layers": num_layers, "batch": 4, "seq_len": 64, "dropout": 0.0}


def _hand_split(num_layers: int) -> list[str]:
    """The tutorial's way: the second half of the blocks on the second device."""
    return [f"layers.{max(1, num_layers // 2)}"]


# --------------------------------------------------------------------------- training (in each rank)


def _lm_loss(logits: Any, target: Any) -> Any:
    import torch.nn.functional as F

    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def _train_worker(rank: int, world_size: int, port: int, config: dict[str, Any], plan_dict: dict[str, Any],
                  hand_split: list[str], steps: int, work_dir: str, out_dir: str) -> None:
    """One rank: build both pipelines, alternate their training steps, time them, hand the times back."""
    # Results travel back in a file; the profiler's C++ chatter on stdout/stderr would only
    # interleave with the parent's tables.
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    result: tuple[str, Any]
    try:
        import warnings

        warnings.simplefilter("ignore")
        import torch
        import torch.distributed as dist

        from ..models import seed_transformer
        from ..planning.plan import Plan
        from ..runtime import Pipeline

        torch.set_num_threads(1)  # one core per rank: the profile was taken the same way
        join_loopback_world(rank, world_size, port, timeout_s=_WORKER_TIMEOUT_S)
        model, (x_mb,) = seed_transformer(**config)
        pipes = {
            "autopipe": Pipeline(model, example_args=(x_mb,), loss_fn=_lm_loss, plan=Plan.from_dict(plan_dict),
                                 device="cpu"),
            "hand split": Pipeline(model, example_args=(x_mb,), loss_fn=_lm_loss, split_points=hand_split,
                                   schedule=DEMO_SCHEDULE, n_microbatches=DEMO_MICROBATCHES, device="cpu"),
        }
        optimizers = {name: torch.optim.Adam(p.parameters(), lr=2e-3) for name, p in pipes.items()}
        # One fixed batch of token sequences: next-token prediction, so the loss visibly falls.
        g = torch.Generator().manual_seed(1)
        tokens = torch.randint(0, config["vocab_size"], (DEMO_MICROBATCHES * config["batch"], config["seq_len"] + 1),
                               generator=g)
        x, y = tokens[:, :-1], tokens[:, 1:]
        runs: dict[str, dict[str, list[float]]] = {name: {"step_s": [], "cpu_s": [], "losses": []} for name in pipes}
        for _ in range(steps):
            for name, pipe in pipes.items():  # alternate, so load on the machine hits both splits alike
                opt = optimizers[name]
                dist.barrier()
                t0 = time.perf_counter()
                opt.zero_grad()
                cpu0 = time.thread_time()
                loss = pipe.step(x, target=y)
                # CPU time of this rank's compute thread: what its stages cost, however much
                # other work on the machine stretches the wall clock (gloo waits do not spin).
                runs[name]["cpu_s"].append(time.thread_time() - cpu0)
                opt.step()
                dist.barrier()
                runs[name]["step_s"].append(time.perf_counter() - t0)
                runs[name]["losses"].append(float(loss))
        # One more autopipe step under torch.profiler: the measured Chrome trace.
        from torch.profiler import ProfilerActivity, profile, record_function

        dist.barrier()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            with record_function("autopipe training step"):
                optimizers["autopipe"].zero_grad()
                pipes["autopipe"].step(x, target=y)
                optimizers["autopipe"].step()
        prof.export_chrome_trace(os.path.join(work_dir, f"trace_rank{rank}.json"))
        dist.barrier()
        dist.destroy_process_group()
        result = ("ok", runs)
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which prints one line
        result = ("error", f"{type(e).__name__}: {e}")
    finish_rank(out_dir, rank, result)


def _train(config: dict[str, Any], plan_dict: dict[str, Any], hand_split: list[str], steps: int,
           work_dir: str) -> dict[str, Any]:
    """Run the ranks (killing any that overrun) and return rank 0's results, with every rank's CPU times."""
    outcomes, _, _ = spawn_ranks(
        _train_worker, DEMO_RANKS,
        lambda rank, port, out_dir: (rank, DEMO_RANKS, port, config, plan_dict, hand_split, steps, work_dir, out_dir),
        timeout_s=_WORKER_TIMEOUT_S + 30, prefix="autopipe-demo-")
    errors = [f"rank {r}: {text}" for r, (status, text) in enumerate(outcomes) if status != "ok"]
    if errors:
        raise RuntimeError("training failed on " + "; ".join(errors))
    results = [runs for _, runs in outcomes]
    # Wall times and losses are the same on every rank (barriers, shared mean loss); CPU
    # times are per rank.
    merged = {"runs": results[0]}
    for name, run in merged["runs"].items():
        run["rank_cpu_s"] = [res[name]["cpu_s"] for res in results]
        del run["cpu_s"]
    return merged


# --------------------------------------------------------------------------- the demo


def run_demo(
    *,
    out_dir: str | os.PathLike = "autopipe-demo",
    steps: int = 8,
    train: bool = True,
    vocab_size: int = 10000,
    num_layers: int = 4,
    console: Any = None,
) -> dict[str, Any]:
    """Profile, plan, compare with the hand split, train on 2 CPU processes, and report.

    Keyword Args:
        out_dir: folder for ``plan.json``, ``report.html``, ``report.md`` (+ PNGs in
            ``report_files/``), ``report.json``, ``trace_simulated.json`` and, after
            training, ``trace_measured.json``. Created when missing.
        steps: training steps per split (the first is a warm-up, left out of the median).
        train: False stops after planning and writing the reports; no process is started.
        vocab_size: the Transformer's vocabulary; the larger, the heavier ``out_linear``.
        num_layers: Transformer blocks (>= 2, so the hand split has a block on each side).
        console: a rich ``Console`` to print to; default stdout.

    Returns:
        :func:`~autopipe.reporting.data.report_data` of the plan, with ``"measured"``
        filled in after training, plus ``"files"``: the paths written.

    Raises:
        ValueError: ``steps`` < 1, ``num_layers`` < 2 or ``vocab_size`` < 2.
        OSError: ``out_dir`` cannot be written.
        RuntimeError: a training process failed (its error is in the message) or overran.

    Example:
        >>> run_demo(out_dir="/tmp/demo", train=False)["summary"]["num_stages"]  # doctest: +SKIP
        2
    """
    for name, value, low in (("steps", steps, 1), ("num_layers", num_layers, 2), ("vocab_size", vocab_size, 2)):
        check_int(name, value, low)
    import torch

    import autopipe

    from ..models import seed_transformer
    from ..planning.profile import profile_segments
    from ..reporting.chrome import merge_rank_traces, simulated_trace
    from ..reporting.data import layer_rows, report_data, sort_layer_rows
    from ..reporting.files import write_json, write_report
    from ..reporting.terminal import make_console, print_layers, print_plan
    from ..reporting.units import format_seconds
    from ..reporting.timeline import plan_timeline, split_timeline
    from ..planning.tracing import trace

    console = console or make_console()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = _model_config(vocab_size, num_layers)
    hand_split = _hand_split(num_layers)
    model, args = seed_transformer(**config)

    console.rule(f"[bold]1. Profile[/bold]: the seed tutorial's Transformer, vocabulary {vocab_size:,}")
    console.print(f"{num_layers} blocks, d_model {config['d_model']}, one micro-batch = {config['batch']} sequences "
                  f"x {config['seq_len']} tokens; measured with 1 CPU thread, as each rank will run.")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        traced = trace(model, args)
        costs = profile_segments(traced, device="cpu", warmup=2, repeats=5)  # the demo trains on CPU processes
    finally:
        torch.set_num_threads(threads)
    rows = layer_rows(traced, costs)
    print_layers(sort_layer_rows(rows, "time")[:8], totals_of=rows,
                 title=f"The 8 heaviest of {len(rows)} layers (per micro-batch, largest first)")

    console.rule(f"[bold]2. Plan[/bold]: {DEMO_RANKS} stages, {DEMO_SCHEDULE}, {DEMO_MICROBATCHES} micro-batches")
    # The CPU's defaults (link, cost per action), also beside a GPU: the demo trains on CPU processes.
    plan = autopipe.partition(model, DEMO_RANKS, args, schedule=DEMO_SCHEDULE, n_microbatches=DEMO_MICROBATCHES,
                              planner=PlannerOptions(cost=costs, profiling=autopipe.ProfileOptions(device="cpu")))
    timeline = plan_timeline(plan)
    data = report_data(plan, timeline=timeline)
    print_plan(data, console=console, gantt=timeline.to_text())

    console.rule("[bold]3. Against the hand split[/bold]")
    hand = next((b for b in plan.baselines if b.split_points == hand_split), None)
    if hand is not None:
        console.print(f"The tutorial's way, half the blocks per device (split at {hand_split[0]}), is the "
                      f"{hand.name} baseline: predicted step {format_seconds(hand.predicted_step_s)} against "
                      f"autopipe's {format_seconds(plan.predicted_step_s)} "
                      f"({hand.predicted_step_s / plan.predicted_step_s:.2f}x).", markup=False)
    else:
        console.print(f"The hand split {hand_split} is trained below beside the plan.", markup=False)

    files: list[Path] = [out / "plan.json"]
    plan.save(out / "plan.json")
    files.append(write_json(simulated_trace(plan, timeline=timeline), out / "trace_simulated.json"))

    if train:
        console.rule(f"[bold]4. Train[/bold]: {steps} steps of each split on {DEMO_RANKS} CPU processes (gloo)")
        busy = _busy_machine_note()
        if busy:
            console.print(busy, markup=False)
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="autopipe-demo-") as work_dir:
            result = _train(config, plan.to_dict(), hand_split, steps, work_dir)
            measured_trace = merge_rank_traces(
                [os.path.join(work_dir, f"trace_rank{r}.json") for r in range(DEMO_RANKS)],
                label="autopipe demo: one measured 1F1B step (torch.profiler)")
        files.append(write_json(measured_trace, out / "trace_measured.json"))
        simulated = {"autopipe": timeline, "hand split": split_timeline(plan, hand_split)}
        splits = {"autopipe": list(plan.split_points), "hand split": hand_split}
        runs = []
        for name, run in result["runs"].items():
            timed = run["step_s"][1:] or run["step_s"]  # the first step warms up caches and allocators
            runs.append({
                # The step's once-per-step tail (merging outputs, the loss broadcast) is the
                # same for both splits: the demo model has no tied weights.
                "name": name, "split_points": splits[name],
                "predicted_step_s": plan.split_step_s(splits[name]),
                "best_step_s": min(timed), "median_step_s": statistics.median(timed),
                "rank_compute_s": [statistics.median(cpu[1:] or cpu) for cpu in run["rank_cpu_s"]],
                "predicted_rank_compute_s": list(simulated[name].busy_s),
                **run,
            })
        notes = [
            f"best and median of steps 2..{steps} (step 1 warms up); both splits alternate step by step on the "
            "same machine, so other processes slow both alike; the best step is the one they disturbed least, "
            "and the speed-up is read from it",
            f"training took {time.perf_counter() - t0:.1f} s including process start-up",
        ]
        data["measured"] = {"runs": runs, "n_ranks": DEMO_RANKS, "threads_per_rank": 1,
                            "notes": ([busy] if busy else []) + notes}
        _print_training(console, runs, steps)

    console.rule("[bold]5. Files[/bold]")
    for path in ("report.html", "report.md", "report.json"):
        files += write_report(data, out / path)
    for path in files:
        console.print(f"  {path}", markup=False)
    console.print("Open the .json traces in https://ui.perfetto.dev or chrome://tracing; report.html in a browser.")
    data["files"] = [str(p) for p in files]
    return data


def _busy_machine_note() -> str:
    """A warning when other work already occupies the cores the two ranks need, else ''."""
    try:
        load_1min = os.getloadavg()[0]
    except (AttributeError, OSError):  # not on every platform
        return ""
    cores = os.cpu_count() or 1
    if load_1min <= max(0.0, cores - DEMO_RANKS) + 0.5:
        return ""
    return (f"note: this machine is busy (load average {load_1min:.1f} on {cores} cores), so the {DEMO_RANKS} ranks "
            "share cores with other work; measured steps will be slower than predicted and the comparison noisy")


def _print_training(console: Any, runs: list[dict[str, Any]], steps: int) -> None:
    from rich.table import Table

    from ..reporting.units import format_seconds

    table = Table(title="Loss per step (mean over micro-batches; the same data and initial weights for both splits)",
                  title_justify="left")
    table.add_column("step", justify="right")
    for run in runs:
        table.add_column(f"{run['name']} loss", justify="right")
        table.add_column(f"{run['name']} step time", justify="right")
    for i in range(steps):
        cells = [str(i + 1)]
        for run in runs:
            cells += [f"{run['losses'][i]:.4f}", format_seconds(run["step_s"][i])]
        table.add_row(*cells)
    console.print(table)

    compute = Table(title="Compute per rank per step: CPU time of each rank's compute thread (median; waiting for "
                          "a core does not count), against the prediction", title_justify="left")
    compute.add_column("split")
    n_ranks = len(runs[0]["rank_compute_s"])
    for r in range(n_ranks):
        compute.add_column(f"rank {r} measured / predicted", justify="right")
    for run in runs:
        compute.add_row(run["name"], *[f"{format_seconds(m)} / {format_seconds(p)}"
                                       for m, p in zip(run["rank_compute_s"], run["predicted_rank_compute_s"])])
    console.print(compute)
    for run in runs:
        ratio = f" (best/predicted {run['best_step_s'] / run['predicted_step_s']:.2f})" if run["predicted_step_s"] else ""
        console.print(f"{run['name']:>10}: measured step {format_seconds(run['best_step_s'])} best, "
                      f"{format_seconds(run['median_step_s'])} median; predicted "
                      f"{format_seconds(run['predicted_step_s'])}{ratio}", markup=False)
    if len(runs) == 2:
        auto, hand = runs
        console.print(
            f"autopipe over the hand split: step {hand['best_step_s'] / auto['best_step_s']:.2f}x measured (best "
            f"steps), {hand['predicted_step_s'] / auto['predicted_step_s']:.2f}x predicted; busiest rank's compute "
            f"{max(hand['rank_compute_s']) / max(auto['rank_compute_s']):.2f}x measured, "
            f"{max(hand['predicted_rank_compute_s']) / max(auto['predicted_rank_compute_s']):.2f}x predicted",
            markup=False)
