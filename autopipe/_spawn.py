"""Run a function on N spawned processes that can fail but never hang."""

from __future__ import annotations

import os
import pickle
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any, NoReturn

import torch.multiprocessing as mp

#: Longest timeout accepted, in seconds: 365 days. torch turns the timeout into integer
#: milliseconds deadlines inside the process group; a year works, while 1e10 s made the
#: store's client time out at once and 1e13 s was refused by gloo ("Invalid timeout"),
#: and an infinite one cannot be converted at all.
MAX_TIMEOUT_S = 365 * 24 * 3600.0


def check_timeout_s(timeout_s: Any, name: str = "timeout_s") -> float:
    """``timeout_s`` as seconds, refusing what torch's process groups cannot wait for.

    Example:
        >>> check_timeout_s(60)
        60.0
        >>> check_timeout_s(float("inf"))
        Traceback (most recent call last):
        ...
        ValueError: timeout_s=inf must be a finite number of seconds > 0 and <= 31536000 (365 days)
    """
    if (isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float))
            or not 0 < timeout_s <= MAX_TIMEOUT_S):  # NaN fails every comparison, so it lands here too
        raise ValueError(f"{name}={timeout_s!r} must be a finite number of seconds > 0 and <= "
                         f"{MAX_TIMEOUT_S:.0f} (365 days)")
    return float(timeout_s)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join_loopback_world(rank: int, world_size: int, port: int, *, backend: str = "gloo",
                        timeout_s: float) -> None:
    """In a spawned rank: join the process group of ``world_size`` ranks on 127.0.0.1:``port``."""
    import datetime

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    dist.init_process_group(backend, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))


def _outcome_path(out_dir: str, rank: int) -> str:
    return os.path.join(out_dir, f"rank{rank}.pkl")


def finish_rank(out_dir: str, rank: int, result: tuple[str, Any]) -> NoReturn:
    """In a spawned rank: record ``result`` for the parent and exit at once."""
    import torch.distributed as dist

    with open(_outcome_path(out_dir, rank), "wb") as f:
        pickle.dump(result, f)
    if result[0] == "ok" and dist.is_initialized():
        dist.destroy_process_group()
    os._exit(0 if result[0] == "ok" else 1)


#: Imported once in the fork server, so that each rank starts with them loaded.
_PRELOAD = ["torch", "torch.distributed", "torch.distributed.pipelining"]


def process_context() -> Any:
    """The forkserver context, its server preloading :data:`_PRELOAD`, on Linux; spawn elsewhere."""
    # macOS has a fork server too, but forking a process that has loaded its system
    # frameworks is not safe there (why Python defaults to spawn on macOS).
    if not sys.platform.startswith("linux"):
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _in_callers_environment(environ: dict[str, str], target: Callable[..., None], *args: Any) -> None:
    """In a rank: take the caller's environment (the fork server holds the one it started with), run ``target``."""
    os.environ.clear()
    os.environ.update(environ)
    target(*args)


def spawn_ranks(
    target: Callable[..., None],
    world_size: int,
    make_args: Callable[[int, int, str], tuple],
    *,
    timeout_s: float,
    prefix: str = "autopipe-ranks-",
) -> tuple[list[tuple[str, Any]], list[int], list[int | None]]:
    """Start ``target(*make_args(rank, port, out_dir))`` on ``world_size`` spawned processes."""
    ctx = process_context()
    port = free_port()
    environ = dict(os.environ)
    with tempfile.TemporaryDirectory(prefix=prefix) as out_dir:
        procs = [ctx.Process(target=_in_callers_environment, args=(environ, target, *make_args(rank, port, out_dir)),
                             daemon=True)
                 for rank in range(world_size)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        killed = [rank for rank, p in enumerate(procs) if p.is_alive()]
        for rank in killed:  # a rank may fail, never hang
            procs[rank].kill()
            procs[rank].join(10)
        outcomes: list[tuple[str, Any]] = []
        for rank in range(world_size):
            path = _outcome_path(out_dir, rank)
            if os.path.exists(path):
                with open(path, "rb") as f:
                    outcomes.append(pickle.load(f))
            elif rank in killed:
                outcomes.append(("error", f"still running after timeout_s={timeout_s}; killed"))
            else:
                outcomes.append(("error", f"died without a result (exit code {procs[rank].exitcode})"))
    return outcomes, killed, [p.exitcode for p in procs]


def run_ranks(worker: Callable[..., None], n_ranks: int, make_args: Callable[[int, int, str], tuple], *,
              timeout_s: float, what: str, advice: str) -> list[Any]:
    """:func:`spawn_ranks` for a measurement: every rank's value in rank order, or a clear error."""
    outcomes, late, _ = spawn_ranks(worker, n_ranks, make_args, timeout_s=timeout_s, prefix=f"autopipe-{what}-")
    if late:
        raise TimeoutError(f"the {what} measurement was not done after timeout_s={timeout_s}; ranks {late} "
                           f"were killed. Raise timeout_s, or {advice}.")
    errors = [f"--- rank {rank} ---\n{text}" for rank, (status, text) in enumerate(outcomes) if status != "ok"]
    if errors:
        raise RuntimeError(f"the {what} measurement failed:\n" + "\n".join(errors))
    return [value for _, value in outcomes]
