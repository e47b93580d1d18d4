"""Run a function on a small gloo world of CPU processes, with no way to hang.

``run_world(fn, world_size, *args)`` calls ``fn(rank, world_size, *args)`` on ``world_size``
processes joined in a gloo process group on loopback, and returns every rank's return value
(or raises :class:`WorldFailed` with each failing rank's traceback). The whole world is killed
after ``timeout_s`` seconds whatever happens, so a test can fail but never hang.

Most calls run on a **pool**: ``world_size`` processes started and joined once per test
session (per world size), which run call after call. After each call every rank puts back
what a call may leave behind (the process groups it made are destroyed; the environment,
the working folder, torch's random state, default dtype, grad mode and thread count are
restored), so the next call starts as in a fresh world. A call that raises on some rank,
kills a rank, overruns ``timeout_s`` or destroys the default group ends that pool (the
next call starts a new one), and a pool is replaced after :data:`POOL_CALLS` calls, so what
calls leave behind stays bounded.

A call asking for another ``pg_timeout_s`` than the pool's, or ``fresh=True``, spawns its own
world as before: tests of exit behaviour, of collective timeouts and of a rank's death.

``fn`` must be importable by name (a module-level function): it reaches the ranks pickled.
"""

from __future__ import annotations

import atexit
import os
import time
import traceback
from typing import Any, Callable

from autopipe._spawn import finish_rank, free_port, join_loopback_world, process_context, spawn_ranks

__all__ = ["WorldFailed", "run_world"]

#: The collective timeout of a pool's process group; calls asking for another spawn their own world.
POOL_PG_TIMEOUT_S = 60.0
#: Calls a pool runs before it is replaced.
POOL_CALLS = 30


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


# ----------------------------------------------------------------------------- the pool's ranks


#: What join_loopback_world sets for a rank, kept whatever the caller's environment holds.
_RANK_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


def _snapshot() -> dict[str, Any]:
    """What a call may change in a rank and the next call must not see."""
    import random

    import numpy as np
    import torch
    import torch.distributed.distributed_c10d as c10d

    return {"environ": dict(os.environ), "cwd": os.getcwd(), "rng": torch.get_rng_state(),
            "np_rng": np.random.get_state(), "py_rng": random.getstate(), "dtype": torch.get_default_dtype(),
            "groups": set(c10d._world.pg_map)}


def _restore(base: dict[str, Any]) -> bool:
    """Put a rank back as :func:`_snapshot` found it; False where it cannot be (the default group is gone)."""
    import gc
    import random

    import numpy as np
    import torch
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    gc.collect()  # pipelines a call left open let go of their groups
    for group in [g for g in list(c10d._world.pg_map) if g not in base["groups"]]:
        try:
            dist.destroy_process_group(group)
        except Exception:  # noqa: BLE001 - already gone with its pipeline
            pass
    os.environ.clear()
    os.environ.update(base["environ"])
    os.chdir(base["cwd"])
    torch.set_rng_state(base["rng"])
    np.random.set_state(base["np_rng"])
    random.setstate(base["py_rng"])
    torch.set_default_dtype(base["dtype"])
    torch.set_grad_enabled(True)
    torch.set_num_threads(1)
    _freeze_survivors()
    return dist.is_initialized()


def _freeze_survivors() -> None:
    """Leave what a rank holds now (torch, the test modules, what earlier calls kept) out of later collections.

    A call's pipeline build ends with a full collection (``build_rank_stages``), which would
    otherwise walk every object torch and the test modules hold, a fifth of a second a build;
    frozen, it walks only what the call made. A pool is replaced after :data:`POOL_CALLS` calls,
    which bounds what is frozen.
    """
    import gc

    gc.collect()
    gc.freeze()


def _pool_rank(rank: int, world_size: int, port: int, backend: str, conn: Any, environ: dict[str, str]) -> None:
    """A pool's rank: join once, then run each call the parent sends until it sends None."""
    os.environ.clear()
    os.environ.update(environ)
    import torch

    torch.set_num_threads(1)
    try:
        join_loopback_world(rank, world_size, port, backend=backend, timeout_s=POOL_PG_TIMEOUT_S)
    except BaseException as e:  # noqa: BLE001 - the parent reads it and starts no calls here
        conn.send((("error", f"could not join the pool's world: {type(e).__name__}: {e}"), False))
        os._exit(1)
    base = _snapshot()
    _freeze_survivors()
    while True:
        task = conn.recv()
        if task is None:
            break
        fn, args, environ, cwd = task
        # The caller's environment and folder as they are at the call, this rank's place in the world kept.
        os.environ.clear()
        os.environ.update({**environ, **{k: base["environ"][k] for k in _RANK_VARIABLES}})
        os.chdir(cwd)
        try:
            result = ("ok", fn(rank, world_size, *args))
        except BaseException as e:  # noqa: BLE001 - report everything to the parent
            result = ("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
        reusable = _restore(base)
        try:
            conn.send((result, reusable))
        except Exception as e:  # noqa: BLE001 - a result that does not pickle
            conn.send((("error", f"the result could not be sent back: {type(e).__name__}: {e}"), reusable))
    os._exit(0)


class _Pool:
    """``world_size`` ranks joined once, running one call after another."""

    def __init__(self, world_size: int, backend: str) -> None:
        ctx = process_context()
        port = free_port()
        self.calls = 0
        self.conns, self.procs = [], []
        for rank in range(world_size):
            mine, theirs = ctx.Pipe()
            proc = ctx.Process(target=_pool_rank, args=(rank, world_size, port, backend, theirs, dict(os.environ)),
                               daemon=True)
            proc.start()
            theirs.close()
            self.conns.append(mine)
            self.procs.append(proc)

    def run(self, fn: Callable, args: tuple, timeout_s: float) -> tuple[list[tuple[str, Any]], bool, list]:
        """Every rank's outcome, whether the pool can run another call, and the ranks' exit codes."""
        self.calls += 1
        for conn in self.conns:
            conn.send((fn, args, dict(os.environ), os.getcwd()))
        deadline = time.monotonic() + timeout_s
        outcomes: list[tuple[str, Any]] = []
        reusable = True
        for rank, conn in enumerate(self.conns):
            if not conn.poll(max(0.0, deadline - time.monotonic())):
                outcomes.append(("error", f"still running after timeout_s={timeout_s}; killed"))
                reusable = False
                continue
            try:
                outcome, clean = conn.recv()
            except (EOFError, OSError):
                self.procs[rank].join(5)
                outcome, clean = ("error", f"died without a result (exit code {self.procs[rank].exitcode})"), False
            outcomes.append(outcome)
            reusable = reusable and clean and outcome[0] == "ok"
        return outcomes, reusable and self.calls < POOL_CALLS, [p.exitcode for p in self.procs]

    def close(self) -> None:
        for conn in self.conns:
            try:
                conn.send(None)
            except (OSError, BrokenPipeError):
                pass
        deadline = time.monotonic() + 5
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        for conn in self.conns:
            conn.close()


_POOLS: dict[tuple[int, str], _Pool] = {}


@atexit.register
def _close_pools() -> None:
    for pool in _POOLS.values():
        pool.close()
    _POOLS.clear()


def _on_pool(fn: Callable, world_size: int, args: tuple, timeout_s: float,
             backend: str) -> tuple[list[tuple[str, Any]], list]:
    key = (world_size, backend)
    pool = _POOLS.get(key) or _POOLS.setdefault(key, _Pool(world_size, backend))
    outcomes, reusable, exit_codes = pool.run(fn, args, timeout_s)
    if not reusable:
        pool.close()
        del _POOLS[key]
    return outcomes, exit_codes


def run_world(fn: Callable, world_size: int, *args: Any, timeout_s: float = 120.0,
              pg_timeout_s: float = POOL_PG_TIMEOUT_S, allow_errors: bool = False, backend: str = "gloo",
              fresh: bool = False) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; return the results.

    Args:
        fn: module-level function; its return value must pickle.
        world_size: number of processes.
        timeout_s: the whole world is killed after this many seconds.
        pg_timeout_s: timeout of every collective / point-to-point transfer; another than
            :data:`POOL_PG_TIMEOUT_S` spawns a world of its own.
        allow_errors: return ``("error", text)`` / ``("ok", value)`` pairs instead of raising.
        backend: ``"gloo"`` (CPU, every test but the CUDA ones) or ``"nccl"`` (one GPU per rank).
        fresh: spawn a world of its own (exit behaviour, a rank's death) instead of the pool.

    Returns:
        The return value of each rank, in rank order.

    Raises:
        WorldFailed: a rank raised, died or overran ``timeout_s`` (unless ``allow_errors``).
    """
    if fresh or pg_timeout_s != POOL_PG_TIMEOUT_S:
        outcomes, _, exit_codes = spawn_ranks(
            _worker, world_size,
            lambda rank, port, out_dir: (fn, rank, world_size, port, pg_timeout_s, backend, out_dir, args),
            timeout_s=timeout_s, prefix="autopipe-world-",
        )
    else:
        outcomes, exit_codes = _on_pool(fn, world_size, args, timeout_s, backend)
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
