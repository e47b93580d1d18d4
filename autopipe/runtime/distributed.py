"""Process group and device helpers: which device this rank uses and how it joins the job.

A script started by ``torchrun`` (or ``autopipe run``) finds ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` in its environment. The helpers here
turn that into a process group and a device, the same way on one machine or many:

    >>> from autopipe.runtime.distributed import default_backend, default_device
    >>> default_backend() in ("nccl", "gloo")
    True
    >>> default_device().type in ("cuda", "cpu")
    True

CUDA with NCCL where a GPU is present, CPU with gloo otherwise. :class:`autopipe.Pipeline`
calls :func:`init_distributed` itself when no process group exists yet, so a training
script needs no distributed code of its own.
"""

from __future__ import annotations

import datetime
import os
import pickle
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "default_backend",
    "default_device",
    "init_distributed",
    "broadcast_object",
]

#: How long a collective or point-to-point transfer may wait for a peer before the process
#: group raises, in seconds. A rank that dies makes the others fail within this bound
#: instead of hanging; long first steps (compilation, large models) may need more.
DEFAULT_TIMEOUT_S = 600.0

# Variables torchrun sets for every worker; without them we cannot join a job.
_REQUIRED_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def default_backend() -> str:
    """The process-group backend for this machine: ``"nccl"`` with CUDA, else ``"gloo"``.

    Returns:
        ``"nccl"`` when CUDA and NCCL are available, ``"gloo"`` otherwise.

    Example:
        >>> default_backend() in ("nccl", "gloo")
        True
    """
    if torch.cuda.is_available() and dist.is_available() and dist.is_nccl_available():
        return "nccl"
    return "gloo"


def default_device() -> torch.device:
    """The device this process should run its stages on.

    With CUDA, ``cuda:LOCAL_RANK`` (torchrun starts one process per GPU and numbers them
    per machine with ``LOCAL_RANK``); without, the CPU.

    Returns:
        A ``torch.device``.

    Raises:
        ValueError: if ``LOCAL_RANK`` is not an integer or names a GPU this machine lacks.

    Example:
        >>> default_device().type in ("cuda", "cpu")
        True
    """
    if not torch.cuda.is_available():
        return torch.device("cpu")
    raw = os.environ.get("LOCAL_RANK", "0")
    try:
        local_rank = int(raw)
    except ValueError:
        raise ValueError(f"environment variable LOCAL_RANK={raw!r} must be an integer") from None
    n_gpus = torch.cuda.device_count()
    if not 0 <= local_rank < n_gpus:
        raise ValueError(
            f"LOCAL_RANK={local_rank} but this machine has {n_gpus} GPU(s) (0..{n_gpus - 1}); "
            f"start at most {n_gpus} processes per machine (--nproc {n_gpus})"
        )
    return torch.device("cuda", local_rank)


def init_distributed(
    *, backend: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S
) -> tuple[int, int]:
    """Join the job's default process group if this process has not yet; return rank and size.

    Reads torchrun's environment variables. A process group that already exists (the user
    or a test harness made it) is used as it is.

    Args:
        backend: ``"nccl"``, ``"gloo"`` or None for :func:`default_backend`.
        timeout_s: seconds any collective may wait for a peer before raising.

    Returns:
        ``(rank, world_size)`` of the default process group.

    Raises:
        RuntimeError: if no process group exists and the torchrun variables are missing;
            the message says how to launch.
        ValueError: if ``timeout_s`` is not a positive number.

    Example:
        >>> rank, world_size = init_distributed()  # doctest: +SKIP  (needs torchrun)
    """
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or timeout_s <= 0:
        raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
    if not dist.is_available():
        raise RuntimeError("this torch build has no torch.distributed; autopipe needs it to run stages")
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    missing = [name for name in _REQUIRED_ENV if name not in os.environ]
    if missing:
        raise RuntimeError(
            f"no torch.distributed process group and the environment lacks {missing}; start "
            f"the script with `autopipe run script.py --nproc N` or `torchrun "
            f"--nproc-per-node N script.py`, or call torch.distributed.init_process_group first"
        )
    backend = backend or default_backend()
    device = default_device()
    if device.type == "cuda":
        # NCCL picks the GPU from the current device; set it before the first collective.
        torch.cuda.set_device(device)
    dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


def broadcast_object(obj: Any, *, src: int, device: torch.device) -> Any:
    """Send a picklable object from rank ``src`` to every rank; each rank returns it.

    Used for the plan: computed once on rank 0, then every rank builds its stages from the
    very same split, however its own timings would have differed.

    Args:
        obj: the object on rank ``src`` (ignored elsewhere).
        src: the sending rank.
        device: this rank's device; NCCL moves the pickled bytes through it.

    Returns:
        ``obj`` as rank ``src`` had it.

    Example:
        >>> plan = broadcast_object(plan, src=0, device=device)  # doctest: +SKIP
    """
    # A length then the bytes: two tensor broadcasts, which every backend supports.
    if dist.get_rank() == src:
        payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(device)
        size = torch.tensor([payload.numel()], dtype=torch.long, device=device)
    else:
        size = torch.zeros(1, dtype=torch.long, device=device)
    dist.broadcast(size, src=src)
    if dist.get_rank() != src:
        payload = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.broadcast(payload, src=src)
    return pickle.loads(payload.cpu().numpy().tobytes())
