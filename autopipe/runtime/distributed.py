"""Process group and device helpers: which device this rank uses and how it joins the job.

Example:
        >>> from autopipe.runtime.distributed import default_backend, default_device
        >>> default_backend() in ("nccl", "gloo")
        True
        >>> default_device().type in ("cuda", "cpu")
        True
"""

from __future__ import annotations

import atexit
import datetime
import hashlib
import os
import pickle
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

# The bound on process-group timeouts is shared with the measurements that spawn ranks.
from .._spawn import check_timeout_s

#: How long a collective or point-to-point transfer may wait for a peer before the process
#: group raises, in seconds. A rank that dies makes the others fail within this bound
#: instead of hanging; long first steps (compilation, large models) may need more.
DEFAULT_TIMEOUT_S = 600.0

# Variables torchrun sets for every worker; without them we cannot join a job.
_REQUIRED_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

# The default process group init_distributed created (None when it created none, or that
# one is gone), how many it has created in this process, and the objects (pipelines) that
# still use it. Only a group autopipe created is ever destroyed by autopipe.
_created_group: Any = None
_groups_created = 0
_holders: "weakref.WeakSet[Any]" = weakref.WeakSet()


def default_backend() -> str:
    """The process-group backend for this machine: ``"nccl"`` with CUDA, else ``"gloo"``.

    Example:
        >>> default_backend() in ("nccl", "gloo")
        True
    """
    if torch.cuda.is_available() and dist.is_available() and dist.is_nccl_available():
        return "nccl"
    return "gloo"


def default_device() -> torch.device:
    """The device this process should run its stages on.

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


def collective_device(device: torch.device) -> torch.device:
    """Where tensors for collectives live: ``device`` under NCCL, the CPU under gloo (which cannot send CUDA tensors)."""
    return device if dist.get_backend() == "nccl" else torch.device("cpu")


def check_device(device: Any) -> torch.device:
    """``device=`` as a ``torch.device``, or a ValueError naming it when this machine has no such device.

    Example:
        >>> check_device("cpu")
        device(type='cpu')
    """
    try:
        checked = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device={device!r} is not a device torch knows ({e}); use 'cpu', 'cuda', 'cuda:N' "
                         f"or a torch.device") from e
    if checked.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(f"device={device!r}, but this machine has no CUDA device torch can use "
                             f"(torch {torch.__version__}, built for CUDA: {torch.version.cuda or 'no'}); "
                             f"use device='cpu' or leave device out")
        if checked.index is not None and checked.index >= count:
            raise ValueError(f"device={device!r}, but this machine has {count} CUDA device(s): "
                             f"cuda:0 to cuda:{count - 1}")
    return checked


def init_distributed(
    *, backend: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S
) -> tuple[int, int]:
    """Join the job's default process group if this process has not yet; return rank and size.

    Example:
        >>> rank, world_size = init_distributed()  # doctest: +SKIP
    """
    timeout_s = check_timeout_s(timeout_s)
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
    global _created_group, _groups_created
    timeout = datetime.timedelta(seconds=timeout_s)
    # Each group autopipe creates writes its peers' addresses under a prefix of its own. Under
    # torchrun the store outlives the group, and a later group (autopipe's next one, or one the
    # user creates after the pipeline closed) would otherwise find the old addresses under the
    # same keys and fail to connect, or wait. Every rank creates and destroys its groups in
    # the same order, so all ranks agree on the prefix.
    store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))
    store.set_timeout(timeout)
    dist.init_process_group(backend=backend, store=dist.PrefixStore(f"autopipe_pg_{_groups_created}", store),
                            rank=rank, world_size=world_size, timeout=timeout)
    if _groups_created == 0:
        atexit.register(_destroy_created_group_at_exit)
    _groups_created += 1
    _created_group = dist.group.WORLD
    return dist.get_rank(), dist.get_world_size()


def created_process_group() -> bool:
    """Whether the default process group now in use is one :func:`init_distributed` created.

    Example:
        >>> created_process_group()  # no group in this process
        False
    """
    return (_created_group is not None and dist.is_available() and dist.is_initialized()
            and dist.group.WORLD is _created_group)


def hold_process_group(holder: Any) -> bool:
    """Count ``holder`` (a pipeline) as a user of the process group autopipe created.

    Example:
        >>> class User: pass
        >>> hold_process_group(User())  # no group autopipe created in this process
        False
    """
    if not created_process_group():
        return False
    _holders.add(holder)
    return True


def release_process_group(holder: Any) -> bool:
    """``holder`` no longer uses the process group; destroy it if autopipe created it and nobody holds it.

    Example:
        >>> class User: pass
        >>> release_process_group(User())
        False
    """
    _holders.discard(holder)
    if len(_holders) or not created_process_group():
        return False
    _destroy_created_group()
    return True


def _destroy_created_group() -> None:
    """Destroy the default group autopipe created and drop autopipe's reference to it."""
    global _created_group
    _created_group = None
    dist.destroy_process_group()


def _destroy_created_group_at_exit() -> None:
    """At interpreter exit: destroy the default group autopipe created if nothing closed it yet."""
    if created_process_group():
        _holders.clear()
        _destroy_created_group()


def broadcast_object(obj: Any, *, src: int, device: torch.device) -> Any:
    """Send a picklable object from rank ``src`` to every rank; each rank returns it.

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


def gather_digests(value: Any, world_size: int) -> list[str]:
    """Every rank's SHA-256 of ``repr(value)``, in rank order (collective).

    Example:
        >>> len(set(gather_digests(plan.split_points, dist.get_world_size()))) == 1  # doctest: +SKIP
        True
    """
    digests: list[Any] = [None] * world_size
    dist.all_gather_object(digests, hashlib.sha256(repr(value).encode()).hexdigest())
    return digests


def close_at_exit(closable: Any) -> Callable[[], None]:
    """Have interpreter exit call ``closable.close()``; returns the hook, to ``atexit.unregister`` on close.

    Example:
        >>> class Job:
        ...     def close(self):
        ...         print("closed")
        >>> job = Job(); hook = close_at_exit(job)
        >>> hook()
        closed
        >>> atexit.unregister(hook)
    """
    ref = weakref.ref(closable)

    def hook() -> None:
        obj = ref()
        if obj is not None:
            obj.close()

    atexit.register(hook)
    weakref.finalize(closable, atexit.unregister, hook).atexit = False
    return hook


def destroy_groups(groups: Iterable[Any]) -> None:
    """Destroy process groups created with ``dist.new_group``; a group already gone is skipped.

    Example:
        >>> destroy_groups([])  # nothing to destroy
    """
    for group in groups:
        try:
            dist.destroy_process_group(group)
        except (ValueError, RuntimeError):  # the user destroyed every group already
            pass


def raise_on_every_rank(error: BaseException | None, *, rank: int, world_size: int, what: str,
                        group: Any = None) -> None:
    """Raise on every rank (of ``group``, ranks and size counted in it) when some rank failed ``what``
    (collective; one all-gather)."""
    texts: list[Any] = [None] * world_size
    dist.all_gather_object(texts, None if error is None else f"{type(error).__name__}: {error}", group=group)
    if error is not None:
        raise error
    failed = [(r, text) for r, text in enumerate(texts) if text is not None]
    if failed:
        r, text = failed[0]
        raise RuntimeError(f"rank {r} could not {what}, so no rank goes on: {text}")
