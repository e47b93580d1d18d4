"""Run a function on N spawned processes that can fail but never hang.

Shared by :mod:`autopipe.machine.measure` (the link probe) and the test suite's gloo worlds. Each
rank writes ``("ok", value)`` or ``("error", text)`` to a file (:func:`finish_rank`); the
parent waits until one deadline for all ranks, kills any still running, and reads the files
back (:func:`spawn_ranks`). Files, not pipes: a rank that dies mid-write leaves no partial
message that could block the parent.
"""

from __future__ import annotations

import os
import pickle
import socket
import tempfile
import time
from collections.abc import Callable
from typing import Any, NoReturn

import torch.multiprocessing as mp

__all__ = ["free_port", "join_loopback_world", "finish_rank", "spawn_ranks"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join_loopback_world(rank: int, world_size: int, port: int, *, backend: str = "gloo",
                        timeout_s: float) -> None:
    """In a spawned rank: join the process group of ``world_size`` ranks on 127.0.0.1:``port``.

    Sets the torchrun variables first (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
    ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), which
    :class:`autopipe.Pipeline` reads, then starts the group; every collective in it times
    out after ``timeout_s``.
    """
    import datetime

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    dist.init_process_group(backend, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))


def _outcome_path(out_dir: str, rank: int) -> str:
    return os.path.join(out_dir, f"rank{rank}.pkl")


def finish_rank(out_dir: str, rank: int, result: tuple[str, Any]) -> NoReturn:
    """In a spawned rank: record ``result`` for the parent and exit at once.

    The process group is torn down only after success: with a peer gone, teardown could
    block. ``os._exit`` skips interpreter teardown for the same reason.
    """
    import torch.distributed as dist

    with open(_outcome_path(out_dir, rank), "wb") as f:
        pickle.dump(result, f)
    if result[0] == "ok" and dist.is_initialized():
        dist.destroy_process_group()
    os._exit(0 if result[0] == "ok" else 1)


def spawn_ranks(
    target: Callable[..., None],
    world_size: int,
    make_args: Callable[[int, int, str], tuple],
    *,
    timeout_s: float,
    prefix: str = "autopipe-ranks-",
) -> tuple[list[tuple[str, Any]], list[int], list[int | None]]:
    """Start ``target(*make_args(rank, port, out_dir))`` on ``world_size`` spawned processes.

    Returns:
        ``(outcomes, killed, exit_codes)``: per rank ``("ok", value)`` or ``("error", text)``
        (a rank with no result gets an error saying whether it was killed or died), the
        ranks still running after ``timeout_s`` (killed), and every rank's exit code.
    """
    ctx = mp.get_context("spawn")
    port = free_port()
    with tempfile.TemporaryDirectory(prefix=prefix) as out_dir:
        procs = [ctx.Process(target=target, args=make_args(rank, port, out_dir), daemon=True)
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
