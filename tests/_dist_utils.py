"""Run a function on a small gloo world of spawned CPU processes, with no way to hang.

``run_world(fn, world_size, *args)`` starts ``world_size`` processes on loopback, joins
them into a gloo process group whose collectives time out after ``pg_timeout_s``, calls
``fn(rank, world_size, *args)`` in each, and returns every rank's return value (or raises
:class:`WorldFailed` with each failing rank's traceback). The whole world is killed after
``timeout_s`` seconds whatever happens, so a test can fail but never hang.

``fn`` must be importable by name (a module-level function) because processes are spawned.
"""

from __future__ import annotations

import datetime
import os
import pickle
import socket
import tempfile
import time
import traceback
from typing import Any, Callable

import torch.multiprocessing as mp

__all__ = ["WorldFailed", "free_port", "run_world"]


class WorldFailed(RuntimeError):
    """Some rank raised, died or overran the deadline; ``errors[rank]`` says how."""

    def __init__(self, errors: dict[int, str], exitcodes: dict[int, int | None]) -> None:
        self.errors = errors
        self.exitcodes = exitcodes
        lines = [f"--- rank {r} (exit code {exitcodes.get(r)}) ---\n{msg}" for r, msg in sorted(errors.items())]
        super().__init__("distributed run failed:\n" + "\n".join(lines))


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(fn: Callable, rank: int, world_size: int, port: int, pg_timeout_s: float,
            out_dir: str, args: tuple) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)  # the test machine has few cores, shared by every rank
    path = os.path.join(out_dir, f"rank{rank}.pkl")
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=pg_timeout_s))
        result = ("ok", fn(rank, world_size, *args))
    except BaseException as e:  # noqa: BLE001 - report everything to the parent
        result = ("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
    with open(path, "wb") as f:
        pickle.dump(result, f)
    # No destroy_process_group on error: a peer may be gone and the teardown could block.
    if result[0] == "ok" and dist.is_initialized():
        dist.destroy_process_group()
    os._exit(0 if result[0] == "ok" else 1)


def run_world(fn: Callable, world_size: int, *args: Any, timeout_s: float = 120.0,
              pg_timeout_s: float = 60.0, allow_errors: bool = False) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo processes; return the results.

    Args:
        fn: module-level function; its return value must pickle.
        world_size: number of processes.
        timeout_s: the whole world is killed after this many seconds.
        pg_timeout_s: timeout of every collective / point-to-point transfer.
        allow_errors: return ``("error", text)`` / ``("ok", value)`` pairs instead of raising.

    Returns:
        The return value of each rank, in rank order.

    Raises:
        WorldFailed: a rank raised, died or overran ``timeout_s`` (unless ``allow_errors``).
    """
    ctx = mp.get_context("spawn")
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="autopipe-world-") as out_dir:
        procs = [
            ctx.Process(target=_worker, args=(fn, r, world_size, port, pg_timeout_s, out_dir, args), daemon=True)
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        overran = [r for r, p in enumerate(procs) if p.is_alive()]
        for r in overran:  # kill stragglers: a test may fail, never hang
            procs[r].kill()
            procs[r].join(10)
        results: dict[int, tuple[str, Any]] = {}
        for r in range(world_size):
            path = os.path.join(out_dir, f"rank{r}.pkl")
            if os.path.exists(path):
                with open(path, "rb") as f:
                    results[r] = pickle.load(f)
            elif r in overran:
                results[r] = ("error", f"still running after timeout_s={timeout_s}; killed")
            else:
                results[r] = ("error", f"died without a result (exit code {procs[r].exitcode})")
    if allow_errors:
        return [results[r] for r in range(world_size)]
    errors = {r: msg for r, (status, msg) in results.items() if status != "ok"}
    if errors:
        raise WorldFailed(errors, {r: p.exitcode for r, p in enumerate(procs)})
    return [results[r][1] for r in range(world_size)]
