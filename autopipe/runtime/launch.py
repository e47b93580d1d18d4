"""``autopipe run script.py --nproc N [args]``: start a training script on N local processes.

A thin front on ``torch.distributed.run`` (torchrun) for one machine, so a user need not
write a torchrun line::

    autopipe run train.py --nproc 2 --steps 50
    python -m autopipe run train.py --nproc 2 --steps 50
    python -m autopipe.runtime.launch train.py --nproc 2 --steps 50

is ``torchrun --standalone --nproc-per-node 2 train.py --steps 50``: torchrun picks a free
port, starts the processes with ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` set, and stops all
of them when one fails. Inside the script, :class:`autopipe.Pipeline` picks the device
(CUDA with NCCL where present, CPU with gloo otherwise). For several machines use torchrun
itself (``--nnodes``, ``--rdzv-endpoint``); the script does not change.

    >>> parse_run_args(["train.py", "--nproc", "2", "--lr", "0.1"])  # doctest: +SKIP
    RunArgs(script='train.py', nproc=2, script_args=['--lr', '0.1'])
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from .._checks import check_int

__all__ = ["RunArgs", "parse_run_args", "run_script", "main"]

USAGE = """usage: autopipe run SCRIPT [--nproc N] [SCRIPT ARGS ...]
       autopipe run [--nproc N] SCRIPT [SCRIPT ARGS ...]

Start SCRIPT on N processes of this machine under torch.distributed.run (torchrun).
  --nproc N   number of processes (pipeline ranks); default: the number of GPUs.
Everything after SCRIPT other than a leading --nproc goes to the script."""


@dataclass
class RunArgs:
    """What ``autopipe run`` was asked to start."""

    script: str  # path of the Python script
    nproc: int  # processes on this machine
    script_args: list[str]  # arguments handed to the script unchanged


def parse_run_args(argv: Sequence[str]) -> RunArgs:
    """Read ``[--nproc N] SCRIPT [--nproc N] [script args]``.

    ``--nproc`` is autopipe's when it comes before the script or right after it; any
    later argument, even another ``--nproc``, belongs to the script.

    Args:
        argv: the arguments after ``run``.

    Returns:
        A :class:`RunArgs`.

    Raises:
        ValueError: no script, a script that is not a file, or ``--nproc`` missing its
            value, not a positive integer, or absent on a machine without GPUs.

    Example:
        >>> parse_run_args(["--nproc=4", "train.py"]).nproc  # doctest: +SKIP
        4
    """
    args = list(argv)
    nproc: int | None = None

    def take_nproc(i: int) -> int:
        """Parse --nproc at args[i]; return how many arguments it used."""
        nonlocal nproc
        if args[i].startswith("--nproc="):
            raw, used = args[i].split("=", 1)[1], 1
        elif i + 1 < len(args):
            raw, used = args[i + 1], 2
        else:
            raise ValueError("--nproc needs a value: the number of processes, e.g. --nproc 2")
        try:
            nproc = int(raw)
        except ValueError:
            raise ValueError(f"--nproc={raw!r} must be a positive integer") from None
        if nproc < 1:
            raise ValueError(f"--nproc={nproc} must be a positive integer")
        return used

    def is_nproc(i: int) -> bool:
        return i < len(args) and (args[i] == "--nproc" or args[i].startswith("--nproc="))

    i = 0
    if is_nproc(i):
        i += take_nproc(i)
    if i >= len(args) or args[i].startswith("-"):
        raise ValueError(f"no script given\n{USAGE}")
    script = args[i]
    i += 1
    if is_nproc(i):
        i += take_nproc(i)
    if not os.path.isfile(script):
        raise ValueError(f"script {script!r} is not a file")
    if nproc is None:
        nproc = _gpu_count()
        if nproc == 0:
            raise ValueError("this machine has no GPU; say how many CPU processes to start with --nproc N")
    return RunArgs(script=script, nproc=nproc, script_args=args[i:])


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def run_script(script: str, nproc: int, args: Sequence[str] = ()) -> int:
    """Run ``script`` on ``nproc`` processes of this machine with torchrun; return the exit code.

    Args:
        script: path of the training script.
        nproc: number of processes, >= 1. With GPUs, at most one per GPU (each process
            uses ``cuda:LOCAL_RANK``).
        args: arguments for the script.

    Returns:
        0 when every process succeeded, else the exit code of the first that failed.

    Raises:
        ValueError: ``nproc`` is not a positive integer or exceeds the GPUs present.

    Example:
        >>> run_script("train.py", 2, ["--steps", "50"])  # doctest: +SKIP
        0
    """
    check_int("nproc", nproc)
    n_gpus = _gpu_count()
    if 0 < n_gpus < nproc:
        raise ValueError(
            f"nproc={nproc} but this machine has {n_gpus} GPU(s), one per process; use --nproc "
            f"{n_gpus}, or hide the GPUs (CUDA_VISIBLE_DEVICES=) to run on CPU processes"
        )
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    torchrun_argv = ["--standalone", f"--nproc-per-node={nproc}", script, *args]
    try:
        torchrun.main(torchrun_argv)
    except ChildFailedError as e:  # torchrun has already printed which rank failed and why
        codes = [f.exitcode for f in e.failures.values() if f.exitcode]
        return codes[0] if codes and codes[0] > 0 else 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``autopipe run`` (``argv`` = the arguments after ``run``).

    Args:
        argv: command-line arguments; default ``sys.argv[1:]``.

    Returns:
        The exit code: 0 on success, 2 for bad arguments, else the failing rank's code.

    Example:
        >>> main(["train.py", "--nproc", "2"])  # doctest: +SKIP
        0
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    try:
        parsed = parse_run_args(argv)
        return run_script(parsed.script, parsed.nproc, parsed.script_args)
    except ValueError as e:
        print(f"autopipe run: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
