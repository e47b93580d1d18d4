"""Two node agents on loopback (``torchrun --nnodes 2``), each in UTS and PID namespaces of its own
so its ranks see another host name and die with it: a pp 2 x tp 2 job keeps each tensor-parallel group on one node and
trains exactly, and killing one agent ends the other with an error within 10 s."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from autopipe._spawn import free_port

TESTS = Path(__file__).parent
TOL = 1e-5


def _uts_namespaces() -> str | None:
    """Why this host cannot give a process a host name of its own (None: it can)."""
    try:
        probe = subprocess.run(["unshare", "--uts", "--pid", "--fork", "hostname", "autopipe-probe"], capture_output=True, text=True,
                               timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unshare cannot run here: {e}"
    return None if probe.returncode == 0 else f"unshare --uts --pid is refused here: {probe.stderr.strip()}"


def _agent(node: int, port: int, out_dir: Path) -> subprocess.Popen:
    torchrun = (f"exec {sys.executable} -m torch.distributed.run --nnodes 2 --node-rank {node} "
                f"--nproc-per-node 2 --master-addr 127.0.0.1 --master-port {port} --max-restarts 0 "
                f"{TESTS / '_two_node_job.py'} {out_dir}")
    # A PID namespace too: when its first process dies, every process of the "node" dies with it.
    return subprocess.Popen(["unshare", "--uts", "--pid", "--fork", "--kill-child", "sh", "-c", f"hostname autopipe-node{node} && {torchrun}"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.mark.slow
def test_two_agents_place_each_tensor_parallel_group_on_one_node_train_exactly_and_end_together(tmp_path):
    why = _uts_namespaces()
    if why:
        pytest.skip(why)
    port = free_port()
    agents = [_agent(node, port, tmp_path) for node in (0, 1)]
    try:
        deadline = time.monotonic() + 240
        while len(list(tmp_path.glob("rank*.json"))) < 4:
            if time.monotonic() > deadline or any(a.poll() is not None for a in agents):
                pytest.fail("the job did not take its first step:\n" + "\n".join(
                    a.communicate(timeout=30)[0][-3000:] if a.poll() is not None else "(running)" for a in agents))
            time.sleep(0.2)
        time.sleep(0.5)  # the files are written whole before the next step starts
        reports = sorted((json.loads(p.read_text()) for p in tmp_path.glob("rank*.json")), key=lambda r: r["rank"])
        agents[1].kill()  # node 1 goes away, its ranks with it (its PID namespace ends)
        killed = time.monotonic()
        output, _ = agents[0].communicate(timeout=60)
        ended_after = time.monotonic() - killed
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
                agent.wait(timeout=30)
    assert [r["host"] for r in reports] == ["autopipe-node0"] * 2 + ["autopipe-node1"] * 2
    for report in reports:
        assert report["local_world_size"] == 2
        assert f"tp {report['rank'] % 2} of tp=2 on {report['host']}" in report["repr"]
        assert report["loss"] == pytest.approx(report["expected_loss"], abs=TOL)
        assert report["worst_grad"] <= TOL
        # The placement report names each rank's node; each tp group (ranks 2k, 2k + 1) is on one.
        assert [(n["node"], n["pp"], n["tp"]) for n in report["nodes"]] == [
            ("autopipe-node0", 0, 0), ("autopipe-node0", 0, 1), ("autopipe-node1", 1, 0), ("autopipe-node1", 1, 1)]
    assert ended_after <= 10, f"node 0's agent ran {ended_after:.1f} s after node 1's was killed"
    assert agents[0].returncode != 0
    # The surviving ranks name the lost peer (gloo says closed or reset, by where it was reading);
    # their agent reports them failed and exits.
    errors = [line for line in output.splitlines() if "Error" in line]
    assert re.search(r"Connection (closed|reset) by peer", output) and "ChildFailedError" in output, errors[-20:]
