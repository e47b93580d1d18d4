"""Specification of ``autopipe run``: parse its arguments, start N local processes with torchrun."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from autopipe.runtime.launch import parse_run_args, torchrun_argv

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "hello.py"
    # Each rank writes its own file: the ranks' stdout would interleave.
    path.write_text(textwrap.dedent(f"""
        import os, sys
        with open(os.path.join({str(tmp_path)!r}, "rank" + os.environ["RANK"] + ".txt"), "w") as f:
            f.write(f"rank {{os.environ['RANK']}} of {{os.environ['WORLD_SIZE']}} args {{sys.argv[1:]}}")
        if "--fail-on-rank-1" in sys.argv and os.environ["RANK"] == "1":
            sys.exit(3)
    """))
    return str(path)


def test_nproc_may_follow_the_script(script):
    assert parse_run_args([script, "--nproc", "2", "--lr", "0.1"]).nproc == 2


def test_nproc_may_precede_the_script(script):
    parsed = parse_run_args(["--nproc=3", script])
    assert (parsed.script, parsed.nproc) == (script, 3)


def test_arguments_after_the_script_go_to_the_script_unchanged(script):
    parsed = parse_run_args([script, "--nproc", "2", "--steps", "5", "--nproc", "7"])
    assert parsed.script_args == ["--steps", "5", "--nproc", "7"]


@pytest.mark.parametrize("bad", ["0", "two"])
def test_nproc_must_be_a_positive_integer(script, bad):
    with pytest.raises(ValueError, match="--nproc"):
        parse_run_args([script, "--nproc", bad])


def test_missing_script_is_a_clear_error():
    with pytest.raises(ValueError, match="no script"):
        parse_run_args(["--nproc", "2"])


def test_script_that_is_not_a_file_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="not a file"):
        parse_run_args([str(tmp_path / "missing.py"), "--nproc", "2"])


def test_nnodes_and_rendezvous_may_come_before_or_after_the_script(script):
    parsed = parse_run_args(["--nnodes", "2", script, "--nproc=1", "--rdzv-endpoint", "node0:29500", "--lr", "1"])
    assert (parsed.nnodes, parsed.nproc, parsed.rdzv_endpoint, parsed.script_args) == (2, 1, "node0:29500", ["--lr", "1"])
    assert torchrun_argv(script, 1, ["--lr", "1"], nnodes=2, rdzv_endpoint="node0:29500") == [
        "--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d", "--rdzv-endpoint=node0:29500", script, "--lr", "1"]
    assert torchrun_argv(script, 2)[:2] == ["--standalone", "--nproc-per-node=2"], "one machine: standalone"


@pytest.mark.parametrize("extra, match", [
    ([], r"--nnodes 2 needs --rdzv-endpoint HOST:PORT"),
    (["--rdzv-endpoint", "node0"], r"needs --rdzv-endpoint HOST:PORT.*'node0'"),
])
def test_several_machines_need_a_rendezvous_address(script, extra, match):
    with pytest.raises(ValueError, match=match):
        parse_run_args([script, "--nnodes", "2", "--nproc", "1", *extra])


def test_nnodes_must_be_a_positive_integer(script):
    with pytest.raises(ValueError, match="--nnodes=0"):
        parse_run_args([script, "--nnodes", "0", "--nproc", "1"])


def _autopipe_run(*args: str) -> subprocess.CompletedProcess:
    # CPU ranks on gloo, also where GPUs are present (a one-GPU machine refuses --nproc 2)
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run([sys.executable, "-m", "autopipe", "run", *args], capture_output=True, text=True,
                          timeout=120, env=env, cwd=REPO)


@pytest.mark.distributed
def test_run_starts_nproc_ranks_with_the_scripts_arguments(script):
    done = _autopipe_run(script, "--nproc", "2", "--steps", "5")
    assert done.returncode == 0, done.stderr[-3000:]
    folder = os.path.dirname(script)
    lines = [open(os.path.join(folder, f"rank{r}.txt")).read() for r in range(2)]
    assert lines == ["rank 0 of 2 args ['--steps', '5']", "rank 1 of 2 args ['--steps', '5']"]


@pytest.mark.distributed
def test_two_machines_meet_at_the_rendezvous(script):
    # Two launchers on this host stand for two machines: each starts one process, and the
    # c10d rendezvous on loopback makes them one world of two ranks.
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, "-m", "autopipe", "run", script, "--nnodes", "2", "--nproc", "1",
           "--rdzv-endpoint", f"127.0.0.1:{port}", "--steps", "1"]
    nodes = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
             for _ in range(2)]
    try:
        codes = [n.wait(timeout=120) for n in nodes]
    finally:
        for n in nodes:
            n.kill()
    assert codes == [0, 0], [n.stderr.read()[-2000:] for n in nodes]
    folder = os.path.dirname(script)
    lines = sorted(open(os.path.join(folder, f"rank{r}.txt")).read() for r in range(2))
    assert lines == ["rank 0 of 2 args ['--steps', '1']", "rank 1 of 2 args ['--steps', '1']"]


@pytest.mark.distributed
def test_run_exits_with_the_failing_ranks_code(script):
    done = _autopipe_run(script, "--nproc", "2", "--fail-on-rank-1")
    assert done.returncode == 3


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("example,args", [
    ("train_seed_transformer.py", ["--schedule", "ZBVZeroBubble", "--steps", "3"]),
    ("train_gpt2.py", ["--steps", "3", "--layers", "2", "--width", "32", "--vocab", "64", "--seq-len", "8"]),
])
def test_examples_run_under_autopipe_run(example, args):
    done = _autopipe_run(os.path.join(REPO, "examples", example), "--nproc", "2", *args)
    assert done.returncode == 0, done.stderr[-3000:]


def test_nproc_beyond_what_the_cores_can_run_is_refused(script):
    import os

    too_many = 4 * (os.cpu_count() or 1) + 1
    with pytest.raises(ValueError, match=f"--nproc {too_many} is more processes than this machine can run"):
        parse_run_args([script, "--nproc", str(too_many)])


def test_ctrl_c_stops_the_ranks_with_one_line_from_the_launcher(tmp_path):
    import signal
    import time

    script = tmp_path / "sleepy.py"
    script.write_text(textwrap.dedent(f"""
        import os, time
        open(os.path.join({str(tmp_path)!r}, "started" + os.environ["RANK"]), "w").close()
        time.sleep(120)
    """))
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    # Its own session, so the interrupt reaches the launcher and the ranks as a terminal's Ctrl-C does.
    proc = subprocess.Popen([sys.executable, "-m", "autopipe", "run", str(script), "--nproc", "2"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while not all((tmp_path / f"started{r}").exists() for r in (0, 1)):
            assert proc.poll() is None and time.monotonic() < deadline, "the ranks did not start"
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, (out, err)
    assert "autopipe run: interrupted (SIGINT); the 2 processes were stopped" in err
    assert "SignalException" not in err and "autopipe/cli/main.py" not in err, err
