"""Run a function on a small gloo world of spawned CPU processes, with no way to hang.

``run_world(fn, world_size, *args)`` starts ``world_size`` processes on loopback, joins
them into a gloo process group whose collectives time out after ``pg_timeout_s``, calls
``fn(rank, world_size, *args)`` in each, and returns every rank's return value (or raises
:class:`WorldFailed` with each failing rank's traceback). The whole world is killed after
``timeout_s`` seconds whatever happens, so a test can fail but never hang.

``fn`` must be importable by name (a module-level function) because processes are spawned.
"""

from __future__ import annotations

import traceback
from typing import Any, Callable


from autopipe._spawn import finish_rank, join_loopback_world, spawn_ranks

__all__ = ["WorldFailed", "run_world"]


class WorldFailed(RuntimeError):
    """Some rank raised, died or overran the deadline; ``errors[rank]`` says how."""

    def __init__(self, errors: dict[int, str], exitcodes: dict[int, int | None]) -> None:
        self.errors = errors
        self.exitcodes = exitcodes
        lines = [f"--- rank {r} (exit code {exitcodes.get(r)}) ---\n{msg}" for r, msg in sorted(errors.items())]
        super().__init__("distributed run failed:\n" + "\n".join(lines))


def _worker(fn: Callable, rank: int, world_size: int, port: int, pg_timeout_s: float, backend: str,
            out_dir: str, args: tuple) -> None:
    import torch

    torch.set_num_threads(1)  # the test machine has few cores, shared by every rank
    try:
        join_loopback_world(rank, world_size, port, backend=backend, timeout_s=pg_timeout_s)
        result = ("ok", fn(rank, world_size, *args))
    except BaseException as e:  # noqa: BLE001 - report everything to the parent
        result = ("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
    finish_rank(out_dir, rank, result)


def run_world(fn: Callable, world_size: int, *args: Any, timeout_s: float = 120.0,
              pg_timeout_s: float = 60.0, allow_errors: bool = False, backend: str = "gloo") -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; return the results.

    Args:
        fn: module-level function; its return value must pickle.
        world_size: number of processes.
        timeout_s: the whole world is killed after this many seconds.
        pg_timeout_s: timeout of every collective / point-to-point transfer.
        allow_errors: return ``("error", text)`` / ``("ok", value)`` pairs instead of raising.
        backend: ``"gloo"`` (CPU, every test but the CUDA ones) or ``"nccl"`` (one GPU per rank).

    Returns:
        The return value of each rank, in rank order.

    Raises:
        WorldFailed: a rank raised, died or overran ``timeout_s`` (unless ``allow_errors``).
    """
    outcomes, _, exit_codes = spawn_ranks(
        _worker, world_size, lambda rank, port, out_dir: (fn, rank, world_size, port, pg_timeout_s, backend, out_dir, args),
        timeout_s=timeout_s, prefix="autopipe-world-",
    )
    results = dict(enumerate(outcomes))
    if allow_errors:
        return [results[r] for r in range(world_size)]
    errors = {r: msg for r, (status, msg) in results.items() if status != "ok"}
    if errors:
        raise WorldFailed(errors, dict(enumerate(exit_codes)))
    return [results[r][1] for r in range(world_size)]


def token_batch(step: int, *, rows: int, seq: int, vocab: int) -> tuple[Any, Any]:
    """Batch ``step`` of a token model: ids and targets, (rows, seq) each, the same on every rank."""
    import torch

    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, vocab, (rows, seq), generator=g), torch.randint(0, vocab, (rows, seq), generator=g)
