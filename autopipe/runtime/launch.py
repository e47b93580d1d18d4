"""``autopipe run script.py --nproc N [args]``: start a training script on N processes per machine.

Example:
        >>> parse_run_args(["train.py", "--nproc", "2", "--lr", "0.1"])  # doctest: +SKIP
        RunArgs(script='train.py', nproc=2, script_args=['--lr', '0.1'], nnodes=1, rdzv_endpoint=None)
"""

from __future__ import annotations

import os
import re
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from .._checks import check_int

USAGE = """usage: autopipe run SCRIPT [--nproc N] [--nnodes M --rdzv-endpoint HOST:PORT] [SCRIPT ARGS ...]
       autopipe run [--nproc N] [--nnodes M --rdzv-endpoint HOST:PORT] SCRIPT [SCRIPT ARGS ...]

Start SCRIPT on N processes per machine under torch.distributed.run (torchrun).
  --nproc N                  processes on this machine; default: the number of GPUs.
  --nnodes M                 machines taking part (default 1); run the same command on each.
  --rdzv-endpoint HOST:PORT  where the machines meet (one of them); needed with --nnodes > 1.
autopipe's options come before SCRIPT or right after it; everything else goes to the script."""

_OPTIONS = ("--nproc", "--nnodes", "--rdzv-endpoint")
#: CPU processes allowed per core (the pipeline x data parallel tests start 4 on 2 cores).
_CPU_RANKS_PER_CORE = 4


@dataclass
class RunArgs:
    """What ``autopipe run`` was asked to start."""

    script: str  # path of the Python script
    nproc: int  # processes on this machine
    script_args: list[str]  # arguments handed to the script unchanged
    nnodes: int = 1  # machines taking part
    rdzv_endpoint: str | None = None  # HOST:PORT where they meet (more than one machine)


def parse_run_args(argv: Sequence[str]) -> RunArgs:
    """Read ``[options] SCRIPT [options] [script args]``; the options are ``--nproc``,
    ``--nnodes`` and ``--rdzv-endpoint``.

    Example:
        >>> parse_run_args(["--nproc=4", "train.py"]).nproc  # doctest: +SKIP
        4
    """
    args = list(argv)
    given: dict[str, str] = {}

    def take_options(i: int) -> int:
        """Read autopipe's options from args[i] on; return the index after them."""
        while i < len(args):
            name, eq, value = args[i].partition("=")
            if name not in _OPTIONS:
                break
            if eq:
                i += 1
            elif i + 1 < len(args):
                value, i = args[i + 1], i + 2
            else:
                raise ValueError(f"{name} needs a value\n{USAGE}")
            given[name] = value
        return i

    i = take_options(0)
    if i >= len(args) or args[i].startswith("-"):
        raise ValueError(f"no script given\n{USAGE}")
    script = args[i]
    i = take_options(i + 1)
    if not os.path.isfile(script):
        raise ValueError(f"script {script!r} is not a file")
    nproc = _positive(given, "--nproc")
    nnodes = _positive(given, "--nnodes") or 1
    if nproc is None:
        nproc = _gpu_count()
        if nproc == 0:
            raise ValueError("this machine has no GPU; say how many CPU processes to start with --nproc N")
    cores = os.cpu_count() or 1
    if nproc > _CPU_RANKS_PER_CORE * cores:
        raise ValueError(f"--nproc {nproc} is more processes than this machine can run: it has {cores} CPU cores, "
                         f"and more than {_CPU_RANKS_PER_CORE} processes a core only compete for them (at most "
                         f"{_CPU_RANKS_PER_CORE * cores})")
    endpoint = given.get("--rdzv-endpoint")
    if nnodes > 1 and (endpoint is None or not re.fullmatch(r"\[?[\w.:-]+\]?:\d+", endpoint)):
        raise ValueError(f"--nnodes {nnodes} needs --rdzv-endpoint HOST:PORT (one of the machines, reachable from "
                         f"all of them), got {endpoint!r}")
    return RunArgs(script=script, nproc=nproc, script_args=args[i:], nnodes=nnodes, rdzv_endpoint=endpoint)


def _positive(given: dict[str, str], name: str) -> int | None:
    """The positive integer given for ``name``, None when it was not given."""
    if name not in given:
        return None
    try:
        value = int(given[name])
    except ValueError:
        raise ValueError(f"{name}={given[name]!r} must be a positive integer") from None
    if value < 1:
        raise ValueError(f"{name}={value} must be a positive integer")
    return value


def torchrun_argv(script: str, nproc: int, args: Sequence[str] = (), *, nnodes: int = 1,
                  rdzv_endpoint: str | None = None) -> list[str]:
    """The torchrun arguments ``autopipe run`` passes: standalone on one machine, c10d rendezvous across several.

    Example:
        >>> torchrun_argv("train.py", 8, ["--steps", "5"], nnodes=2, rdzv_endpoint="node0:29500")
        ['--nnodes=2', '--nproc-per-node=8', '--rdzv-backend=c10d', '--rdzv-endpoint=node0:29500', 'train.py', '--steps', '5']
    """
    if nnodes == 1:
        return ["--standalone", f"--nproc-per-node={nproc}", script, *args]
    return [f"--nnodes={nnodes}", f"--nproc-per-node={nproc}", "--rdzv-backend=c10d",
            f"--rdzv-endpoint={rdzv_endpoint}", script, *args]


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def run_script(script: str, nproc: int, args: Sequence[str] = (), *, nnodes: int = 1,
               rdzv_endpoint: str | None = None) -> int:
    """Run ``script`` on ``nproc`` processes of this machine with torchrun; return the exit code.

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
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    try:
        torchrun.main(torchrun_argv(script, nproc, args, nnodes=nnodes, rdzv_endpoint=rdzv_endpoint))
    except ChildFailedError as e:  # torchrun has already printed which rank failed and why
        codes = [f.exitcode for f in e.failures.values() if f.exitcode]
        return codes[0] if codes and codes[0] > 0 else 1
    except (KeyboardInterrupt, SignalException) as e:
        # Ctrl-C (or a SIGTERM): torchrun has stopped the ranks; its own traceback says nothing more.
        signum = int(getattr(e, "sigval", signal.SIGINT))
        print(f"autopipe run: interrupted ({signal.Signals(signum).name}); the {nproc} processes were stopped",
              file=sys.stderr)
        return 128 + signum
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``autopipe run`` (``argv`` = the arguments after ``run``).

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
        return run_script(parsed.script, parsed.nproc, parsed.script_args, nnodes=parsed.nnodes,
                          rdzv_endpoint=parsed.rdzv_endpoint)
    except ValueError as e:
        print(f"autopipe run: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
