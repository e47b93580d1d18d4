"""Specification of a pipeline's life: closing it, exiting cleanly, and a step that fails on one rank.

* ``close()`` / ``with Pipeline(...) as pipe:`` destroy what the pipeline created (the
  process group when autopipe created it, the groups for parameters shared by some ranks),
  at most once, and interpreter exit closes a pipeline left open; a finished run of the
  documented loop then exits with 0 on every rank.
* A stage whose forward raises plays the step through with zeros: every rank raises
  :class:`~autopipe.errors.PipelineStepError` at once (not after the process group's
  timeout), and the next step trains as if the failed batch had been skipped. An error
  that cannot be played through (in a backward) makes the next step say plainly that the
  pipeline cannot run again.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import textwrap

import pytest

import _lifecycle_workers as workers
from _dist_utils import run_world
from autopipe._spawn import spawn_ranks

pytestmark = pytest.mark.distributed

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The process group's timeout in the failing-step worlds: a rank left waiting for a peer
# would raise only after it, so an error well before it shows that none waited.
PG_TIMEOUT_S = 30.0
PROMPT_S = PG_TIMEOUT_S / 2
TOL = 1e-5

FORWARD_CASES = (("1F1B", 1), ("GPipe", 0), ("Interleaved1F1B", 1), ("ZBVZeroBubble", 0))


def _env() -> dict:
    # CPU ranks on gloo, also where GPUs are present
    return {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
            "CUDA_VISIBLE_DEVICES": ""}


# ---------------------------------------------------------------------- closing
@functools.lru_cache(maxsize=None)
def owned_group_results() -> list[dict]:
    outcomes, killed, _ = spawn_ranks(
        workers.own_group_worker, 2,
        lambda rank, port, out_dir: (workers.owned_group_run, rank, 2, port, out_dir, ()),
        timeout_s=240, prefix="autopipe-lifecycle-")
    assert not killed and all(status == "ok" for status, _ in outcomes), outcomes
    return [value for _, value in outcomes]


def test_the_with_block_closes_the_pipeline_and_destroys_the_group_it_created():
    for r in owned_group_results():
        assert r["group_before"] is False and r["closed"] is True
        assert r["group_after"] is False, "the process group the pipeline created outlived close()"
        # Nothing holds the group any more, so gloo has joined its threads.
        assert r["group_freed"] is True


def test_a_pipeline_after_a_closed_one_creates_its_group_again():
    assert all(r["second_loss"] > 0 for r in owned_group_results())


def test_a_group_the_user_creates_after_the_pipelines_closed_theirs_works():
    assert [r["user_group_after"] for r in owned_group_results()] == [2.0, 2.0]


def test_under_torchruns_store_a_users_group_after_the_pipeline_closed_finds_no_old_addresses():
    from torch.distributed import TCPStore

    stores = []  # the launcher's store, as torchrun's agent holds it: alive for the whole run

    def make_args(rank, port, out_dir):
        if not stores:
            stores.append(TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False))
        return (workers.user_group_after_close_run, rank, 2, port, out_dir, ())

    outcomes, killed, _ = spawn_ranks(workers.agent_store_worker, 2, make_args, timeout_s=120,
                                      prefix="autopipe-lifecycle-")
    assert not killed and outcomes == [("ok", 2.0), ("ok", 2.0)], outcomes


def test_the_group_stays_while_another_open_pipeline_uses_it():
    for r in owned_group_results():
        assert r["group_after_first_of_two_closed"] is True
        assert r["third_still_steps"] > 0


def test_an_unreferenced_pipeline_is_garbage_collected_despite_its_exit_hook():
    assert all(r["garbage_collected"] for r in owned_group_results())


@functools.lru_cache(maxsize=None)
def user_group_results() -> list[dict]:
    return run_world(workers.closed_on_user_group_run, 2, timeout_s=240)


def test_close_leaves_a_group_the_user_created_alone():
    for r in user_group_results():
        assert r["closed"] and r["group_alive"] and r["all_reduce"] == 2.0


def test_a_closed_pipeline_refuses_to_step_but_keeps_its_parameters():
    for r in user_group_results():
        assert "closed" in r["step_after_close"]
        assert r["parameters_after_close"] > 0 and r["state_dict_after_close"]


def test_close_destroys_the_groups_made_for_parameters_shared_by_some_ranks():
    results = run_world(workers.shared_group_run, 3, timeout_s=280)
    # The tied weight lives on stages 0 and 1: ranks 0 and 1 hold a group of two, rank 2 none.
    assert [r["groups"] for r in results] == [1, 1, 0]
    assert results[0]["sizes_before"] == [2]
    assert [r["destroyed"] for r in results] == [[True], [True], []]
    assert all(r["world_alive"] for r in results)  # the harness's own group stays


def _autopipe_run(script: str, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "autopipe", "run", script, "--nproc", "2", *args],
                          capture_output=True, text=True, timeout=timeout, env=_env(), cwd=REPO)


def test_interpreter_exit_closes_a_pipeline_the_loop_left_open(tmp_path):
    # The documented loop, which never closes its pipeline. An exit hook registered before
    # the pipeline existed runs after the pipeline's own: it sees what the interpreter's
    # shutdown will find. A gloo group still alive there can abort the process (SIGABRT).
    script = tmp_path / "loop.py"
    script.write_text(textwrap.dedent(f"""
        import atexit, os
        import torch, torch.nn as nn, torch.distributed as dist

        def report():
            with open(os.path.join({str(tmp_path)!r}, "exit" + os.environ["RANK"]), "w") as f:
                f.write(f"{{dist.is_initialized()}} {{len(os.listdir('/proc/self/task'))}} {{threads_before}}")

        atexit.register(report)
        from autopipe.runtime import Pipeline

        threads_before = len(os.listdir("/proc/self/task"))
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        pipe = Pipeline(model, example_args=(torch.zeros(2, 8),), loss_fn=nn.functional.mse_loss,
                        split_points=["2"], schedule="1F1B", n_microbatches=4)
        opt = torch.optim.AdamW(pipe.parameters())
        for _ in range(3):
            opt.zero_grad()
            loss = pipe.step(torch.randn(8, 8), target=torch.randn(8, 4))
            opt.step()
    """))
    done = _autopipe_run(str(script))
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in range(2):
        alive, threads_at_exit, threads_before = (tmp_path / f"exit{rank}").read_text().split()
        assert alive == "False", "the process group was still alive when the interpreter shut down"
        if sys.platform.startswith("linux"):  # /proc/self/task: gloo's threads are gone
            assert int(threads_at_exit) <= int(threads_before)


def test_the_documented_loop_exits_cleanly_run_after_run(tmp_path):
    # The quick form of benchmarks/clean_exit (100 runs there): every run exits with 0. Two
    # runs catch a regression only sometimes; the exit test above is the deterministic one.
    out = tmp_path / "exit_codes.json"
    done = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "clean_exit", "main.py"), "--runs", "2",
                           "--out", str(out)], capture_output=True, text=True, timeout=280, env=_env(), cwd=REPO)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "2/2 runs exited with 0; 0 with a rank aborted" in done.stdout


# ---------------------------------------------------------------------- a step failing on one rank
@functools.lru_cache(maxsize=None)
def failed_forward_results() -> list[dict]:
    return run_world(workers.failed_forward_run, 2, list(FORWARD_CASES), timeout_s=280, pg_timeout_s=PG_TIMEOUT_S)


@pytest.mark.parametrize("schedule, failing_rank", FORWARD_CASES)
def test_every_rank_raises_promptly_when_one_ranks_forward_raises(schedule, failing_rank):
    for rank, r in enumerate(failed_forward_results()):
        step = r[f"{schedule}/{failing_rank}"]["steps"][workers.FAILING_STEP]
        assert step.get("type") == "PipelineStepError", step
        assert step["failures"] == {failing_rank: step["failures"][failing_rank]}
        assert "injected forward failure" in step["failures"][failing_rank]
        assert f"failed on rank {failing_rank}" in step["error"]
        # No rank waited for the failing one until the process group's timeout.
        assert step["seconds"] < PROMPT_S, step
        if rank == failing_rank:  # the original error is kept as the cause
            assert "ValueError: injected forward failure" in step["cause"]


@pytest.mark.parametrize("schedule, failing_rank", FORWARD_CASES)
def test_the_step_after_a_failed_one_trains_as_if_that_batch_was_skipped(schedule, failing_rank):
    for r in failed_forward_results():
        case = r[f"{schedule}/{failing_rank}"]
        after = case["steps"][workers.FAILING_STEP + 1]
        assert "loss" in after, after
        assert abs(after["loss"] - after["ref_loss"]) < TOL
        assert case["param_diff"] < TOL


def test_an_error_that_cannot_be_played_through_makes_the_next_step_say_the_pipeline_must_be_rebuilt():
    results = run_world(workers.failed_backward_run, 2, timeout_s=240, pg_timeout_s=PG_TIMEOUT_S)
    assert all(r[2] == "ok" for r in results)
    assert "injected backward failure" in results[1][workers.FAILING_STEP]
    for r in results:
        assert r[workers.FAILING_STEP] != "ok"
        after = r[workers.FAILING_STEP + 1]
        assert after.startswith("RuntimeError: this pipeline cannot run again"), after
        assert f"step() call {workers.FAILING_STEP} raised" in after
