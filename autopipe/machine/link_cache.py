"""The loopback link of this host, measured once and kept.

Example:
    >>> from autopipe.machine.link import LinkMeasurement
    >>> fake = LinkMeasurement(5e9, 5e-5, [1024, 1 << 20], [5e-5, 2.6e-4], [[5e-5], [2.6e-4]], 0.01, "gloo",
    ...                        ("cpu", "cpu"))
    >>> forget_links()
    >>> loopback_link("cpu", measure=lambda: fake, use_file=False).bandwidth_bytes_per_s
    5000000000.0
    >>> loopback_link("cpu", measure=lambda: 1 / 0, use_file=False) is fake  # kept: not measured again
    True
    >>> forget_links()
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .link import LinkMeasurement

#: A function that measures the link between two processes on this host.
MeasureFn = Callable[[], LinkMeasurement]

_LOCK = threading.Lock()
_KEPT: dict[tuple[str, str], LinkMeasurement] = {}  # (host key, device type) -> measurement


def host_key() -> str:
    """What a loopback measurement depends on: host name, torch version, torch's thread count.

    Example:
        >>> host_key().count("|")
        2
    """
    return f"{socket.gethostname()}|torch {torch.__version__}|threads {torch.get_num_threads()}"


def cache_file() -> Path | None:
    """The JSON file that keeps measurements between processes, or None when turned off.

    Example:
        >>> cache_file() is None or cache_file().name == "links.json"
        True
    """
    if os.environ.get("AUTOPIPE_LINK_CACHE", "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    folder = os.environ.get("AUTOPIPE_CACHE_DIR")
    if not folder:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        folder = os.path.join(base, "autopipe")
    return Path(folder) / "links.json"


def _read_file(path: Path) -> dict[str, Any]:
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):  # absent or damaged: measure again and rewrite it
        return {}
    return raw if isinstance(raw, dict) else {}


def _from_file(path: Path, key: str) -> LinkMeasurement | None:
    entry = _read_file(path).get(key)
    try:
        return LinkMeasurement.from_dict(entry) if entry is not None else None
    except (TypeError, ValueError):  # written by another version: measure again
        return None


def _to_file(path: Path, key: str, link: LinkMeasurement) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        raw = _read_file(path)
        raw[key] = link.to_dict()
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(raw, indent=1))
        os.replace(tmp, path)  # whole or not at all, should two processes write at once
    except OSError:  # a read-only home: the process cache still holds it
        pass


#: Longest wait for a measurement in a fresh interpreter, start-up and imports included.
FRESH_TIMEOUT_S = 180.0

#: Independent measurements in the fresh interpreter; the one with the median latency is kept.
FRESH_RUNS = 3

# One run on a busy host can catch a burst of load (latency in milliseconds, a scheduler
# tick); the median run of a few, as ``autopipe measure`` reports, is kept.
_FRESH_CODE = (
    "import json, sys\n"
    "from autopipe.machine.link import measure_link\n"
    "runs = [measure_link(device=sys.argv[1], timeout_s=float(sys.argv[2])) for _ in range(int(sys.argv[3]))]\n"
    "link = sorted(runs, key=lambda r: r.latency_s)[len(runs) // 2]\n"
    "print('AUTOPIPE-LINK ' + json.dumps(link.to_dict()))\n"
)


def measure_in_fresh_process(device_type: str = "cpu", *, timeout_s: float = FRESH_TIMEOUT_S) -> LinkMeasurement:
    """:func:`autopipe.machine.link.measure_link` run from a fresh Python interpreter."""
    package_root = str(Path(__file__).resolve().parents[2])  # where ``import autopipe`` finds this copy
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH", "")) if p)
    try:
        done = subprocess.run([sys.executable, "-c", _FRESH_CODE, device_type, str(timeout_s * 0.8 / FRESH_RUNS),
                               str(FRESH_RUNS)],
                              capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired as e:
        raise TimeoutError(f"the link measurement was not done after {timeout_s:.0f} s; it was killed") from e
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("AUTOPIPE-LINK "):
            return LinkMeasurement.from_dict(json.loads(line[len("AUTOPIPE-LINK "):]))
    tail = (done.stderr or done.stdout).strip()[-2000:]
    raise RuntimeError(f"the link measurement failed (exit code {done.returncode}):\n{tail}")


def remember_link(link: LinkMeasurement, device_type: str = "cpu") -> None:
    """Keep ``link`` as this host's loopback link for ``device_type`` in this process.

    Example:
        >>> from autopipe.machine.link import LinkMeasurement
        >>> remember_link(LinkMeasurement(3e9, 1e-4, [1, 2], [1e-4, 1e-4], [[1e-4], [1e-4]], 0.0, "gloo",
        ...                               ("cpu", "cpu")))
        >>> loopback_link("cpu", measure=lambda: 1 / 0, use_file=False).bandwidth_bytes_per_s
        3000000000.0
        >>> forget_links()
    """
    if not isinstance(link, LinkMeasurement):
        raise TypeError(f"link={link!r} must be an autopipe.machine.link.LinkMeasurement")
    with _LOCK:
        _KEPT[(host_key(), device_type)] = link


def forget_links() -> None:
    """Drop the measurements kept in this process (the file, if any, is left as it is).

    Example:
        >>> forget_links()
    """
    with _LOCK:
        _KEPT.clear()


def known_link(device_type: str = "cpu") -> LinkMeasurement | None:
    """This host's loopback link as measured before (kept in this process, or in the cache file), else None."""
    key = host_key()
    with _LOCK:
        kept = _KEPT.get((key, device_type))
    if kept is not None:
        return kept
    path = cache_file()
    link = _from_file(path, f"{key}|{device_type}") if path is not None else None
    if link is not None:
        with _LOCK:
            _KEPT[(key, device_type)] = link
    return link


def save_link(link: LinkMeasurement, device_type: str = "cpu") -> None:
    """Keep ``link`` for this process and, where the cache file is on, for later ones (``autopipe measure``)."""
    remember_link(link, device_type)
    path = cache_file()
    if path is not None:
        _to_file(path, f"{host_key()}|{device_type}", link)


def loopback_link(device_type: str = "cpu", *, measure: MeasureFn | None = None,
                  use_file: bool = True) -> LinkMeasurement:
    """This host's link between two processes on ``device_type``: kept, read from the file, or measured."""
    if device_type not in ("cpu", "cuda"):
        raise ValueError(f"device_type={device_type!r}: a loopback link is measured between 'cpu' processes "
                         "or 'cuda' GPUs")
    key = host_key()
    with _LOCK:
        kept = _KEPT.get((key, device_type))
    if kept is not None:
        return kept
    path = cache_file() if use_file else None
    file_key = f"{key}|{device_type}"
    link = _from_file(path, file_key) if path is not None else None
    if link is None:
        link = measure() if measure is not None else measure_in_fresh_process(device_type)
        if not isinstance(link, LinkMeasurement):
            raise TypeError(f"measure returned {link!r}; it must return an autopipe.machine.link.LinkMeasurement")
        if path is not None:
            _to_file(path, file_key, link)
    with _LOCK:
        _KEPT[(key, device_type)] = link
    return link
