"""Checkpoint folders that a failed save cannot spoil: written beside the target, agreed, then swapped in.

Example:
    >>> import tempfile
    >>> folder = tempfile.mkdtemp()
    >>> save_replacing(lambda: {"w": torch.ones(2)}, f"{folder}/ckpt", rank=0, world_size=1)
    >>> sorted(os.listdir(folder)), checkpoint_to_read(f"{folder}/ckpt")[0] == f"{folder}/ckpt"
    (['ckpt'], True)
"""

from __future__ import annotations

import contextlib
import os
import shutil
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from ..errors import CheckpointError
from .distributed import raise_on_every_rank

#: Beside the target: the folder a save writes into, and where the old one waits to be deleted.
PARTIAL_SUFFIX = ".autopipe-partial"
PREVIOUS_SUFFIX = ".autopipe-previous"
#: Written into the partial folder once every rank has written: it is a whole checkpoint.
COMPLETE_MARK = ".autopipe-complete"


def _torch_failure_text(error: BaseException) -> str:
    """One line per failing rank of torch's ``CheckpointException``, or the error itself."""
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        lines = []
        for rank, failure in sorted(failures.items()):
            cause = failure[0] if isinstance(failure, tuple) else failure
            first = str(cause).splitlines()[0] if str(cause) else ""
            lines.append(f"rank {rank}: {type(cause).__name__}: {first}")
        return "; ".join(lines)
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"


@contextlib.contextmanager
def checkpoint_errors(what: str) -> Iterator[None]:
    """Turn whatever torch's checkpointing raises (its ``CheckpointException`` is no ``Exception``) into a
    :class:`~autopipe.errors.CheckpointError` that says ``what`` failed, torch's error as the cause.

    Example:
        >>> with checkpoint_errors("read weights from 'w'"):  # doctest: +ELLIPSIS
        ...     raise FileNotFoundError("no such file: w/__0_0.distcp")
        Traceback (most recent call last):
        ...
        autopipe.errors.CheckpointError: could not read weights from 'w': FileNotFoundError: no such file: ...
    """
    try:
        yield
    except (KeyboardInterrupt, SystemExit, GeneratorExit, CheckpointError):
        raise
    except BaseException as e:  # noqa: BLE001 - torch's CheckpointException derives from BaseException
        raise CheckpointError(f"could not {what}: {_torch_failure_text(e)}") from e


def check_complete(path: str | os.PathLike) -> Any:
    """``path``'s DCP ``Metadata``, once every file it indexes is there, whole; else :class:`~autopipe.errors.CheckpointError`.

    Example:
        >>> import tempfile
        >>> folder = tempfile.mkdtemp()
        >>> check_complete(folder)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        autopipe.errors.CheckpointError: ...no .metadata file...
    """
    import torch.distributed.checkpoint as dcp

    path = os.fspath(path)
    try:
        metadata = dcp.FileSystemReader(path).read_metadata()
    except FileNotFoundError as e:
        raise CheckpointError(f"checkpoint {path!r} has no .metadata file: it is no torch.distributed.checkpoint, "
                              f"or its save never finished") from e
    except Exception as e:  # noqa: BLE001 - unpickling a damaged file raises many kinds
        raise CheckpointError(f"checkpoint {path!r}: its .metadata cannot be read ({type(e).__name__}: {e}); the "
                              f"checkpoint is damaged or its save was cut short") from e
    needed: dict[str, int] = {}
    for info in (getattr(metadata, "storage_data", None) or {}).values():
        end = int(info.offset) + int(info.length)
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    for name, end in sorted(needed.items()):
        file = os.path.join(path, name)
        size = os.path.getsize(file) if os.path.isfile(file) else None
        if size is None or size < end:
            found = "is missing" if size is None else f"has {size} bytes where its index needs {end}"
            raise CheckpointError(f"checkpoint {path!r} is incomplete: {name} {found}. Its save was cut short or "
                                  f"the folder was copied in part; load an earlier checkpoint.")
    return metadata


def checkpoint_to_read(target: str | os.PathLike) -> tuple[str, Any]:
    """The folder to load for ``target`` (itself, or what a save cut between its two moves left), and its ``Metadata``.

    Raises:
        CheckpointError: nothing whole to load (a missing folder, or an incomplete one, named).
    """
    target = os.fspath(target)
    partial, previous = target + PARTIAL_SUFFIX, target + PREVIOUS_SUFFIX
    if not os.path.exists(target):
        if os.path.exists(os.path.join(partial, COMPLETE_MARK)):
            target = partial  # every rank had written it; only the move into place was cut short
        elif os.path.isdir(previous):
            target = previous  # the old one was moved aside, the new one never finished
        else:
            raise CheckpointError(f"checkpoint_id={target!r} does not exist")
    return target, check_complete(target)


def save_replacing(gather: Callable[[], dict[str, Any]], target: str | os.PathLike, *, rank: int,
                   world_size: int) -> None:
    """``dcp.save(gather())`` to ``target`` so that any failure leaves the previous checkpoint there, whole. Collective.

    Args:
        gather: makes this rank's part of the checkpoint, as ``dcp.save`` takes it; called before
            anything is written, and a rank it fails on stops every rank.
        target: the checkpoint's folder.
        rank / world_size: this rank, and the ranks that save together.

    Raises:
        CheckpointError: some rank could not write its part or the folders could not be moved; on every rank.
    """
    import torch.distributed.checkpoint as dcp

    target = os.fspath(target)
    partial, previous = target + PARTIAL_SUFFIX, target + PREVIOUS_SUFFIX
    error: BaseException | None = None
    state: dict[str, Any] = {}
    try:
        state = gather()
        if rank == 0 and os.path.exists(partial):
            try:
                shutil.rmtree(partial)
            except OSError as e:
                raise CheckpointError(f"could not clear {partial!r}, left by an earlier save: {e}") from e
    except Exception as e:  # noqa: BLE001 - raised below, on every rank
        error = e
    _agree(error, rank, world_size, "prepare its part of the checkpoint")
    with checkpoint_errors(f"save the checkpoint {target!r} (the previous one there is untouched)"), _alone_quietly():
        dcp.save(state, checkpoint_id=partial, no_dist=not dist.is_initialized())
    if rank == 0:
        try:
            with open(os.path.join(partial, COMPLETE_MARK), "w") as f:
                f.write("every rank wrote its part\n")
            if os.path.exists(target):
                if os.path.exists(previous):
                    shutil.rmtree(previous)
                os.replace(target, previous)
            os.replace(partial, target)
            shutil.rmtree(previous, ignore_errors=True)
        except OSError as e:
            error = CheckpointError(f"every rank wrote the checkpoint into {partial!r}, but moving it to {target!r} "
                                    f"failed: {e}")
    _agree(error, rank, world_size, "move the new checkpoint into place")


@contextlib.contextmanager
def _alone_quietly() -> Iterator[None]:
    """Without a process group, torch warns that it saves or loads in one process: that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _agree(error: BaseException | None, rank: int, world_size: int, what: str) -> None:
    """Every rank raises when one failed ``what``; alone (no process group), just this one."""
    if dist.is_initialized():
        raise_on_every_rank(error, rank=rank, world_size=world_size, what=what)
    elif error is not None:
        raise error


def load_into(state: dict[str, Any], path: str | os.PathLike) -> None:
    """``dcp.load(state)`` from ``path``, a folder :func:`checkpoint_to_read` gave; errors as ``CheckpointError``."""
    import torch.distributed.checkpoint as dcp

    path = os.fspath(path)
    with checkpoint_errors(f"load the checkpoint {path!r}"), _alone_quietly():
        dcp.load(state, checkpoint_id=path, no_dist=not dist.is_initialized())
