"""Rank functions for tests/test_lifecycle.py: closing a pipeline, and steps that fail on one rank.

Module-level so spawned processes can import them. Most run in ``run_world``'s gloo world
(a group the test harness made); :func:`own_group_worker` instead leaves the process
group to :class:`autopipe.Pipeline`, which then creates it and owns it.
"""

from __future__ import annotations

import copy
import datetime
import gc
import os
import time
import traceback
import weakref
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from autopipe._spawn import finish_rank
from autopipe.errors import PipelineStepError
from autopipe.runtime import Pipeline

WIDTH = 8
N_MICROBATCHES = 4
LR = 0.1
FAILING_STEP = 3  # of steps 1..4


def small_model() -> nn.Module:
    """Five linear layers: 2 stages (one per rank) or 4 (two per rank)."""
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(4)], nn.Linear(WIDTH, 4))


def split_points(schedule: str) -> list[str]:
    return ["2"] if schedule in ("GPipe", "1F1B") else ["1", "2", "3"]


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(2 * N_MICROBATCHES, WIDTH, generator=g), torch.randn(2 * N_MICROBATCHES, 4, generator=g)


def build(schedule: str, **kwargs: Any) -> Pipeline:
    return Pipeline(small_model(), example_args=(torch.zeros(2, WIDTH),), loss_fn=nn.functional.mse_loss,
                    split_points=split_points(schedule), schedule=schedule, n_microbatches=N_MICROBATCHES, **kwargs)


def _error_text(e: BaseException) -> str:
    """The error and what caused it (torch wraps a stage's error in its own)."""
    text = f"{type(e).__name__}: {e}"
    if e.__cause__ is not None:
        text += f" <- {_error_text(e.__cause__)}"
    return text


def _arm_last_submodule(pipe: Pipeline, armed: dict, make_hook: Callable) -> None:
    """Put ``make_hook(armed)`` on the last submodule of this rank's last stage, as a forward hook."""
    stage = pipe.stage_modules[max(pipe.stage_indices)]
    submodule = list(stage.children())[-1]
    kind, hook = make_hook(armed)
    if kind == "pre":
        submodule.register_forward_pre_hook(hook)
    else:
        submodule.register_forward_hook(hook)


def _raise_in_forward(armed: dict):
    def hook(module, args):
        if armed["now"]:
            raise ValueError("injected forward failure")
    return "pre", hook


def _raise_in_backward(armed: dict):
    def fail(grad):
        raise RuntimeError("injected backward failure")

    def hook(module, args, output):
        if armed["now"]:
            output.register_hook(fail)
    return "post", hook


def failed_forward_run(rank: int, world_size: int, cases: list[tuple[str, int]]) -> dict:
    """For each (schedule, failing rank): steps 1-4, the failing rank's stage raising in its forward at step 3.

    The loop catches the error and goes on, as a training loop skipping a bad batch would.
    Returns per case, per step, the loss or the error and how long the call took; and how
    far the pipeline's final parameters are from the unsplit model trained on steps 1, 2, 4.
    """
    out = {}
    for schedule, failing_rank in cases:
        pipe = build(schedule)
        armed = {"now": False}
        if rank == failing_rank:
            _arm_last_submodule(pipe, armed, _raise_in_forward)
        opt = torch.optim.SGD(pipe.parameters(), lr=LR)
        reference = small_model()
        ref_opt = torch.optim.SGD(reference.parameters(), lr=LR)
        steps: dict[int, dict] = {}
        for step in range(1, 5):
            x, y = batch(step)
            armed["now"] = step == FAILING_STEP
            t0 = time.perf_counter()
            try:
                opt.zero_grad()
                loss = pipe.step(x, target=y)
                opt.step()
                steps[step] = {"loss": loss.item(), "seconds": time.perf_counter() - t0}
            except Exception as e:  # noqa: BLE001 - the test reads what each rank saw
                steps[step] = {"error": _error_text(e), "type": type(e).__name__,
                               "failures": getattr(e, "failures", None), "seconds": time.perf_counter() - t0,
                               "cause": f"{type(e.__cause__).__name__}: {e.__cause__}" if e.__cause__ else None}
                continue
            ref_opt.zero_grad()
            ref_loss = nn.functional.mse_loss(reference(x), y)
            ref_loss.backward()
            ref_opt.step()
            steps[step]["ref_loss"] = ref_loss.item()
        full = pipe.state_dict(full=True)
        diff = max((full[k] - v).abs().max().item() for k, v in reference.state_dict().items())
        pipe.close()
        out[f"{schedule}/{failing_rank}"] = {"steps": steps, "param_diff": diff}
    return out


def failed_backward_run(rank: int, world_size: int) -> dict:
    """1F1B; rank 1's stage raises in its backward at step 3, which cannot be played through.

    Each rank records steps 3 and 4. Rank 1 leaves right after its step 4, which ends its
    process and so unblocks rank 0, still waiting inside step 3 for rank 1's gradients.
    """
    pipe = build("1F1B")
    armed = {"now": False}
    if rank == 1:
        _arm_last_submodule(pipe, armed, _raise_in_backward)
    steps: dict[int, str] = {}
    for step in range(1, 5):
        x, y = batch(step)
        armed["now"] = step == FAILING_STEP
        try:
            pipe.zero_grad()
            pipe.step(x, target=y)
            steps[step] = "ok"
        except Exception as e:  # noqa: BLE001
            steps[step] = _error_text(e)
    return steps


def closed_on_user_group_run(rank: int, world_size: int) -> dict:
    """A pipeline on the group the harness made: close() leaves that group alone."""
    with build("1F1B") as pipe:
        x, y = batch(1)
        pipe.step(x, target=y)
    after = {"closed": pipe.closed, "group_alive": dist.is_initialized()}
    t = torch.ones(1)
    dist.all_reduce(t)  # the user's group still works
    after["all_reduce"] = t.item()
    pipe.close()  # a second time: nothing happens
    try:
        pipe.step(x, target=y)
        after["step_after_close"] = "no error"
    except RuntimeError as e:
        after["step_after_close"] = str(e)
    after["parameters_after_close"] = len(pipe.parameters())
    after["state_dict_after_close"] = sorted(pipe.state_dict())
    return after


class TiedAcrossTwoOfThree(nn.Module):
    """A weight used by stages 0 and 1 of 3: their ranks share a process group of two."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(WIDTH, WIDTH)
        self.b = nn.Linear(WIDTH, WIDTH)
        self.c = nn.Linear(WIDTH, 4)
        self.b.weight = self.a.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(self.b(self.a(x)))


def shared_group_run(rank: int, world_size: int) -> dict:
    """Three ranks; close() destroys the group the pipeline made for the tied weight."""
    torch.manual_seed(0)
    pipe = Pipeline(TiedAcrossTwoOfThree(), example_args=(torch.zeros(2, WIDTH),), loss_fn=nn.functional.mse_loss,
                    split_points=["b", "c"], schedule="1F1B", n_microbatches=N_MICROBATCHES)
    x, y = batch(1)
    pipe.step(x, target=y)
    groups = [g for _, g in pipe._shared if g is not None]
    result: dict[str, Any] = {"groups": len(groups), "sizes_before": [dist.get_world_size(g) for g in groups]}
    pipe.close()
    gone = []
    for g in groups:
        try:
            dist.get_process_group_ranks(g)
            gone.append(False)
        except (KeyError, ValueError, RuntimeError):  # no longer registered: destroyed
            gone.append(True)
    result["destroyed"] = gone
    result["world_alive"] = dist.is_initialized()
    return result


# ---------------------------------------------------------------------- a group the pipeline creates
def own_group_worker(fn: Callable, rank: int, world_size: int, port: int, out_dir: str, args: tuple) -> None:
    """Spawned rank with torchrun's variables set but no process group: the pipeline makes it."""
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    try:
        result = ("ok", fn(rank, world_size, *args))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        result = ("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
    finish_rank(out_dir, rank, result)


def owned_group_run(rank: int, world_size: int) -> dict:
    """The pipeline creates the group; closing destroys it and frees it; a next pipeline makes a new one."""
    result: dict[str, Any] = {"group_before": dist.is_initialized()}
    with build("1F1B", timeout_s=30) as pipe:
        group = weakref.ref(dist.group.WORLD)
        x, y = batch(1)
        result["loss_inside"] = pipe.step(x, target=y).item()
    gc.collect()
    # The group object itself is gone: gloo joined its threads, which is what a clean exit needs.
    result.update(closed=pipe.closed, group_after=dist.is_initialized(), group_freed=group() is None)
    pipe.close()  # a second time: nothing happens
    # The user's own group after autopipe's is gone: it must not meet its leftovers.
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=20))
    total = torch.ones(1)
    dist.all_reduce(total)
    result["user_group_after"] = total.item()
    dist.destroy_process_group()

    second = build("1F1B", timeout_s=30)  # a new group, created the same way
    x, y = batch(2)
    result["second_loss"] = second.step(x, target=y).item()
    held_by_two = build("1F1B", timeout_s=30)  # shares the second pipeline's group
    second.close()
    result["group_after_first_of_two_closed"] = dist.is_initialized()
    x, y = batch(3)
    result["third_still_steps"] = held_by_two.step(x, target=y).item()
    collected = weakref.ref(held_by_two)
    del held_by_two
    gc.collect()
    # The exit hook holds the pipeline weakly: an unreferenced pipeline is collected.
    result["garbage_collected"] = collected() is None
    return result


def agent_store_worker(fn: Callable, rank: int, world_size: int, port: int, out_dir: str, args: tuple) -> None:
    """Spawned rank as torchrun starts it: the store is the launcher's, and it outlives every group."""
    os.environ.update(TORCHELASTIC_USE_AGENT_STORE="True", TORCHELASTIC_RESTART_COUNT="0")
    own_group_worker(fn, rank, world_size, port, out_dir, args)


def user_group_after_close_run(rank: int, world_size: int) -> float:
    """The pipeline's group is closed; then the user makes one, rank 1 a little after rank 0."""
    with build("1F1B", timeout_s=20) as pipe:
        x, y = batch(1)
        pipe.step(x, target=y)
    if rank == 1:  # rank 0 reads rank 1's address first: an old one, if the store still has it
        time.sleep(2)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=15))
    total = torch.ones(1)
    dist.all_reduce(total)
    dist.destroy_process_group()
    return total.item()
