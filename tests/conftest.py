"""Test lanes and shared fixtures.

Every test is in exactly one lane, a marker this file sets at collection:

- ``unit`` (``pytest -m unit``): everything that runs in the test process itself: tracing,
  profiling at test size, the partitioner, the simulator, plans, plan files, reports, the
  command line called in-process, the runtime's parts. No process is started. About a
  minute and a half on a quiet 2-core machine.
- ``distributed`` (``pytest -m distributed``): the pipeline on a gloo world of spawned CPU
  processes (loopback only): steps against the unsplit model, every schedule, tied and
  in-place parameters, clean exit, link probes. Several minutes.
- ``slow`` (``pytest -m slow``): long or process-heavy: ``tests/thirdparty``, the
  benchmarks' smoke runs, the command line run as a user runs it (a subprocess per test).
  Several minutes.

``pytest`` with no ``-m`` runs all three (what CI runs). Every run is shared by two
pytest-xdist workers that each take whole files (pyproject's ``addopts``), so the worlds and
fixtures a file shares stay in one process; ``-n 0`` runs in one process, for a debugger.

Where tests share costly work, they share it on purpose: each distributed scenario runs once
per session in one world (``functools.lru_cache`` on the function that runs it), and the
tests read its results; traced and profiled models are built once (the session fixtures below,
module caches, ``traces_reused``) where the tests only read them.

How a test gets its lane, first match wins:

1. ``slow``: marked ``@pytest.mark.slow`` (the test, its class or the module's
   ``pytestmark``), or under ``tests/thirdparty``.
2. ``distributed``: marked ``@pytest.mark.distributed``, or it reaches ``run_world``
   (tests/_dist_utils.py) or ``autopipe._spawn.spawn_ranks`` through its own code, the
   test-suite functions it calls, or the fixtures of its module it takes.
3. ``slow``: it reaches ``subprocess`` the same way: each such test starts a Python
   interpreter, seconds apiece.
4. ``unit``: everything else. A unit test that starts a Python process anyway (through a
   library call the scan does not follow, such as a link probe) fails at once naming the
   marker it needs, so no process ever runs in the unit lane.
"""

from __future__ import annotations

import copy
import gc
import inspect
import multiprocessing.process
import os
import subprocess
import sys
import types
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from autopipe.models import seed_transformer
from autopipe.planning.profile import profile_segments
from autopipe.planning.tracing import trace

# Plans in tests must not depend on this host's link, nor a test write to the home folder: the
# planner's link measurement (autopipe.planning.link_choice) and its cache file are off unless
# a test turns them on (tests/test_link_default.py). Child processes inherit this.
os.environ.setdefault("AUTOPIPE_MEASURE_LINK", "0")
os.environ.setdefault("AUTOPIPE_LINK_CACHE", "0")
# Profiles in tests empty a 4 MiB cache before each pass, not what /sys reports: a virtual
# machine can report its socket's whole L3 (480 MiB on the test host, so each pass of a profile
# wrote 960 MiB, most of a profile's time). No test judges a measured time; the flusher's own
# size is tested with the host's figure (tests/test_profile.py).
os.environ.setdefault("AUTOPIPE_LLC_BYTES", "4MiB")

# The suite runs in two pytest-xdist workers (pyproject's addopts: ``-n 2 --dist loadfile``), one
# per core of the test machine. Each computes with one thread, and so do the interpreters it starts:
# two workers with a pool of threads each would oversubscribe the cores, and torch's thread pools
# spin while they wait (the unit lane takes more than twice as long so).
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)

LANES = ("unit", "distributed", "slow")
TESTS = Path(__file__).resolve().parent
THIRDPARTY = TESTS / "thirdparty"
#: Names whose use means a gloo world of spawned processes.
SPAWNS_A_WORLD = frozenset({"run_world", "spawn_ranks"})
#: Names whose use means starting a Python interpreter as a subprocess.
STARTS_A_PROCESS = frozenset({"subprocess"})


def _code_names(code: types.CodeType) -> Iterator[str]:
    """Global and attribute names ``code`` uses, nested functions and lambdas included."""
    yield from code.co_names
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _code_names(const)


def _names_reached(func: Callable, seen: set[int] | None = None) -> set[str]:
    """Every name ``func`` uses, and those used by the test-suite functions it calls by name."""
    seen = set() if seen is None else seen
    func = inspect.unwrap(func)  # fixtures and functools.lru_cache wrap the function
    code = getattr(func, "__code__", None)
    if code is None or id(code) in seen:
        return set()
    seen.add(id(code))
    names = set(_code_names(code))
    for name in list(names):
        target = func.__globals__.get(name)
        if callable(target) and _defined_in_tests(target):
            names |= _names_reached(target, seen)
    return names


def _defined_in_tests(obj: object) -> bool:
    try:
        return TESTS in Path(inspect.getfile(inspect.unwrap(obj))).resolve().parents
    except (TypeError, OSError):  # builtins, classes from C, objects without a source file
        return False


def lane_of(item: pytest.Item) -> str:
    """The lane ``item`` runs in (see the module docstring)."""
    marked = {mark.name for mark in item.iter_markers()}
    if "slow" in marked or THIRDPARTY in Path(item.path).parents:
        return "slow"
    func = getattr(item, "function", None)
    reached: set[str] = set()
    if func is not None:
        reached = _names_reached(func)
        module = getattr(item, "module", None)
        for fixture in getattr(item, "fixturenames", ()):  # fixtures defined beside the test
            defined = getattr(module, fixture, None)
            if defined is not None and _defined_in_tests(defined):
                reached |= _names_reached(defined)
    if "distributed" in marked or reached & SPAWNS_A_WORLD:
        return "distributed"
    if reached & STARTS_A_PROCESS:
        return "slow"
    return "unit"


def pytest_collection_finish(session: pytest.Session) -> None:
    """Leave what collection made (torch, the test modules, the items) out of later garbage collections.

    A full collection walks every tracked object; tracing and planning trigger many, and each
    would otherwise walk the millions of objects imported torch and the test modules hold.
    """
    gc.collect()
    gc.freeze()


@pytest.hookimpl(tryfirst=True)  # before pytest's own -m selection reads the markers
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Give every test exactly one lane marker, so ``-m distributed`` never picks a slow test."""
    lanes = [lane_of(item) for item in items]  # all first: the markers below are shared by a module
    for item in items:
        for node in item.listchain():
            node.own_markers[:] = [mark for mark in node.own_markers if mark.name not in LANES]
    for item, lane in zip(items, lanes):
        item.add_marker(lane)


def _starts_python(args: object) -> bool:
    argv = [args] if isinstance(args, (str, bytes)) else list(args or ())
    return bool(argv) and Path(str(argv[0])).name.startswith(("python", Path(sys.executable).name))


@pytest.fixture(autouse=True)
def _no_process_in_the_unit_lane(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail a unit-lane test that starts a process, naming the marker it needs.

    Only Python interpreters and multiprocessing children count: a library may run a small
    system tool (matplotlib asks fontconfig for the fonts once) without leaving the lane.
    """
    if request.node.get_closest_marker("unit") is None:
        return
    wrong_lane = ("{what}: a unit-lane test starts no process; mark it @pytest.mark.distributed "
                  "(it joins a process group) or @pytest.mark.slow")
    popen_init = subprocess.Popen.__init__

    def guarded_popen(self, args, *rest, **kwargs):
        if _starts_python(args):
            pytest.fail(wrong_lane.format(what=f"started {args!r}"), pytrace=False)
        popen_init(self, args, *rest, **kwargs)

    def guarded_start(self):
        pytest.fail(wrong_lane.format(what=f"started the process {self!r}"), pytrace=False)

    monkeypatch.setattr(subprocess.Popen, "__init__", guarded_popen)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", guarded_start)


@pytest.fixture(scope="session")
def small_transformer():
    """The seed Transformer at test size: (model, args). Do not mutate it."""
    return seed_transformer(vocab_size=500, d_model=32, num_heads=4, d_ff=64, num_layers=2, batch=2, seq_len=8)


@pytest.fixture(scope="session")
def small_traced(small_transformer):
    model, args = small_transformer
    return trace(model, args)


@pytest.fixture(scope="session")
def small_costs_once(small_traced):
    """Segment costs of ``small_traced`` from counted FLOPs at a fixed 1 GFLOP/s, computed once."""
    return profile_segments(small_traced, cost="flops", device_flops=1e9, progress=False)


@pytest.fixture
def small_costs(small_costs_once):
    """A fresh copy of the small Transformer's counted costs: every plan made from them is the
    same on every machine, however busy (a measured profile would move the splits), and
    planning from them skips the measurement."""
    return copy.deepcopy(small_costs_once)


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield


@pytest.fixture
def flushers_built(monkeypatch):
    """A list that gets one entry per ``CacheFlusher`` the profiler builds (it builds one per
    profile that empties the caches)."""
    import autopipe.planning.profile as profile

    built: list[int] = []

    class CountingFlusher(profile.CacheFlusher):
        def __init__(self, *args, **kwargs):
            built.append(1)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(profile, "CacheFlusher", CountingFlusher)
    return built


@pytest.fixture
def rounds_seen(monkeypatch):
    """A list that gets ``(whole graph given, fit)`` for every profile timed in rounds."""
    import autopipe.planning.profile as profile

    seen: list[tuple[bool, bool]] = []
    real = profile.time_in_rounds

    def spy(segments, timer, warmup, repeats, flush=None, whole=None, fit=False, **kwargs):
        seen.append((whole is not None, fit))
        return real(segments, timer, warmup, repeats, flush, whole, fit, **kwargs)

    monkeypatch.setattr(profile, "time_in_rounds", spy)
    return seen
