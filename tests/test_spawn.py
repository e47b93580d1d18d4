"""Ranks started by ``autopipe._spawn`` run where and as the caller is at the call.

They start from a fork server that was started once, earlier, with the environment and
working directory of that moment; each rank must still see the caller's current ones.
"""

from __future__ import annotations

import os

import pytest
from _dist_utils import run_world


def _where_am_i(rank: int, world_size: int) -> tuple[str | None, str, bool]:
    return os.environ.get("AUTOPIPE_SPAWN_PROBE"), os.getcwd(), "AUTOPIPE_SPAWN_GONE" in os.environ


@pytest.mark.distributed
def test_ranks_see_the_callers_environment_and_directory_as_they_are_now(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOPIPE_SPAWN_GONE", "1")
    before = run_world(_where_am_i, 2, timeout_s=60)  # starts the fork server, if not already running
    assert before == [(None, os.getcwd(), True)] * 2
    monkeypatch.setenv("AUTOPIPE_SPAWN_PROBE", "set after the server started")
    monkeypatch.delenv("AUTOPIPE_SPAWN_GONE")
    monkeypatch.chdir(tmp_path)
    after = run_world(_where_am_i, 2, timeout_s=60)
    assert after == [("set after the server started", str(tmp_path), False)] * 2
