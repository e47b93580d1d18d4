"""The ``autopipe`` command line: every command run as a subprocess, its output and its files,
and one clear line on stderr (no traceback) for every mistake a user can make."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from PIL import Image

from autopipe.cli.main import main
from autopipe.cli.modelspec import ModelSpecError, load_model_spec
from autopipe.planning.plan import Plan
from autopipe.reporting.chrome import trace_ranks

REPO = Path(__file__).resolve().parents[1]

FACTORIES = textwrap.dedent('''
    import torch
    from autopipe.models import seed_transformer

    def make(vocab_size=500, num_layers=2):
        return seed_transformer(vocab_size=vocab_size, d_model=32, num_heads=4, d_ff=64,
                                num_layers=num_layers, batch=2, seq_len=8)

    def with_kwargs():
        model, (x,) = make()
        return model, (), {"x": x}

    def wrong_type():
        return 42

    def wrong_model():
        return "not a model", (torch.zeros(1),)

    def explodes():
        raise RuntimeError("the factory exploded")

    NOT_CALLABLE = 3
''')

FAST = ["--warmup", "0", "--repeats", "1", "--no-progress"]


def run_cli(*args: str, cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1", COLUMNS="140")
    return subprocess.run([sys.executable, "-m", "autopipe", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def assert_one_line_error(result: subprocess.CompletedProcess, *fragments: str) -> None:
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def png_ok(path: Path) -> bool:
    with Image.open(path) as im:
        im.verify()
    with Image.open(path) as im:
        return im.format == "PNG"


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("cli")
    (d / "tiny.py").write_text(FACTORIES)
    return d


@pytest.fixture(scope="module")
def planned(workdir) -> tuple[subprocess.CompletedProcess, Path]:
    """`autopipe plan` with every output, run once for the tests that read its files."""
    out = workdir / "plan_out"
    out.mkdir(exist_ok=True)
    result = run_cli("plan", "tiny.py:make", "--gpus", "2", *FAST, "--memory", "256MiB",
                     "--out", str(out / "plan.json"), "--report", str(out / "report.html"),
                     "--report", str(out / "report.md"), "--report", str(out / "report.json"),
                     "--png-dir", str(out / "png"), "--trace", str(out / "trace.json"), cwd=workdir)
    return result, out


# --------------------------------------------------------------------------- help


def test_help_lists_every_command_with_examples(workdir):
    result = run_cli("--help", cwd=workdir)
    assert result.returncode == 0
    for command in ("profile", "plan", "report", "demo", "run"):
        assert command in result.stdout
    assert "examples:" in result.stdout and "path/to/file.py:factory" in result.stdout


@pytest.mark.parametrize("command", ["profile", "plan", "report", "demo"])
def test_each_command_help_explains_it_by_example(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    assert f"autopipe {command}" in capsys.readouterr().out.split("examples:")[1]


def test_no_command_prints_usage_and_fails(capsys):
    assert main([]) == 2
    assert "COMMAND" in capsys.readouterr().out


# --------------------------------------------------------------------------- profile


def test_profile_prints_the_per_layer_table_and_writes_json_and_png(workdir):
    result = run_cli("profile", "tiny.py:make", *FAST, "--sort", "time", "--top", "3",
                     "--json", "layers.json", "--png", "layers.png", cwd=workdir)
    assert result.returncode == 0, result.stderr
    assert "largest time first, top 3" in result.stdout
    assert "fwd" in result.stdout and "bwd" in result.stdout and "activations" in result.stdout
    layers = json.loads((workdir / "layers.json").read_text())["layers"]
    assert layers[-1]["name"] == "out_linear" and layers[0]["modules"][0] == "embedding"
    assert png_ok(workdir / "layers.png")


def test_profile_in_graph_order_starts_at_the_input(workdir, capsys):
    assert main(["profile", str(workdir / "tiny.py") + ":make", *FAST, "--set", "num_layers=1"]) == 0
    out = capsys.readouterr().out
    assert out.index("<input> (embedding)") < out.index("out_linear")


# --------------------------------------------------------------------------- plan


def test_plan_prints_the_split_the_stages_and_the_baselines(planned):
    result, _ = planned
    assert result.returncode == 0, result.stderr
    assert "split_spec = {" in result.stdout and "SplitPoint.BEGINNING" in result.stdout
    assert "Stages (times per micro-batch)" in result.stdout
    assert "deepspeed_uniform" in result.stdout and "rank 1 |" in result.stdout


def test_plan_saves_a_plan_that_loads(planned):
    _, out = planned
    plan = Plan.load(out / "plan.json")
    assert plan.num_stages == 2 and plan.memory_limit_bytes == [256 * 2**20] * 2


def test_plan_html_report_parses(planned):
    _, out = planned
    html = (out / "report.html").read_text()
    ET.fromstring(html[html.index("<html"):])
    assert "<svg" in html


def test_plan_markdown_report_links_pngs_that_decode(planned):
    _, out = planned
    md = (out / "report.md").read_text()
    images = [line[line.index("](") + 2:-1] for line in md.splitlines() if line.startswith("![")]
    assert images and all(png_ok(out / image) for image in images)


def test_plan_json_report_holds_the_stages_and_the_timeline(planned):
    _, out = planned
    data = json.loads((out / "report.json").read_text())
    assert len(data["stages"]) == 2 and data["timeline"]["events"]


def test_plan_png_dir_holds_every_figure(planned):
    _, out = planned
    names = sorted(p.name for p in (out / "png").iterdir())
    assert names == ["baselines.png", "layers.png", "stages.png", "timeline.png"]
    assert all(png_ok(out / "png" / n) for n in names)


def test_plan_chrome_trace_has_one_track_per_rank(planned):
    _, out = planned
    trace = json.loads((out / "trace.json").read_text())
    assert trace_ranks(trace) == {0, 1}


def test_plan_charges_the_action_overhead_given_on_the_command_line(workdir, tmp_path):
    assert main(["plan", str(workdir / "tiny.py") + ":make", "--gpus", "2", *FAST, "--action-overhead-ms", "3",
                 "--out", str(tmp_path / "p.json")]) == 0
    assert Plan.load(tmp_path / "p.json").action_overhead_s() == [3e-3, 3e-3]


def test_plan_accepts_a_factory_with_keyword_inputs(workdir, capsys):
    assert main(["plan", str(workdir / "tiny.py") + ":with_kwargs", "--gpus", "2", *FAST]) == 0
    assert "split_spec" in capsys.readouterr().out


# --------------------------------------------------------------------------- report


def test_report_re_renders_a_saved_plan_into_every_format(planned, workdir):
    _, out = planned
    result = run_cli("report", str(out / "plan.json"), "--report", "again.html", "--report", "again.json",
                     "--trace", "again_trace.json", "--png-dir", "again_png", cwd=workdir)
    assert result.returncode == 0, result.stderr
    assert "split_spec" in result.stdout
    html = (workdir / "again.html").read_text()
    ET.fromstring(html[html.index("<html"):])
    assert json.loads((workdir / "again.json").read_text())["summary"]["num_stages"] == 2
    assert trace_ranks(json.loads((workdir / "again_trace.json").read_text())) == {0, 1}
    assert png_ok(workdir / "again_png" / "timeline.png")


def test_report_of_a_missing_file_is_one_line(tmp_path, capsys):
    assert main(["report", str(tmp_path / "nope.json")]) != 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "does not exist" in err


def test_report_of_a_json_file_that_is_not_a_plan_is_one_line(tmp_path, capsys):
    (tmp_path / "x.json").write_text('{"format_version": 2, "hello": 1}')
    assert main(["report", str(tmp_path / "x.json")]) != 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is not an autopipe plan" in err


# --------------------------------------------------------------------------- demo


@pytest.mark.distributed
def test_demo_profiles_plans_compares_trains_and_writes_every_file(tmp_path):
    out = tmp_path / "demo"
    result = run_cli("demo", "--out-dir", str(out), "--steps", "2", "--vocab-size", "3000", "--layers", "2",
                     cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr
    for heading in ("1. Profile", "2. Plan", "3. Against the hand split", "4. Train", "5. Files"):
        assert heading in result.stdout
    assert "measured step" in result.stdout and "predicted" in result.stdout
    report = json.loads((out / "report.json").read_text())
    runs = {r["name"]: r for r in report["measured"]["runs"]}
    assert sorted(runs) == ["autopipe", "hand split"]
    assert runs["autopipe"]["losses"][1] < runs["autopipe"]["losses"][0]
    assert len(runs["autopipe"]["rank_compute_s"]) == len(runs["hand split"]["predicted_rank_compute_s"]) == 2
    assert trace_ranks(json.loads((out / "trace_measured.json").read_text())) == {0, 1}
    assert trace_ranks(json.loads((out / "trace_simulated.json").read_text())) == {0, 1}
    assert "Measured run" in (out / "report.html").read_text()
    assert all(png_ok(p) for p in (out / "report_files").iterdir())


def test_demo_without_training_stops_after_the_reports(tmp_path, capsys):
    assert main(["demo", "--out-dir", str(tmp_path), "--no-train", "--vocab-size", "1000", "--layers", "2"]) == 0
    out = capsys.readouterr().out
    assert "4. Train" not in out
    assert (tmp_path / "report.html").exists() and not (tmp_path / "trace_measured.json").exists()


# --------------------------------------------------------------------------- run


def test_run_delegates_to_the_launcher_and_explains_itself(workdir):
    result = run_cli("run", "--help", cwd=workdir)
    assert result.returncode == 0 and "--nproc" in result.stdout


def test_run_with_a_missing_script_is_one_line(workdir):
    assert_one_line_error(run_cli("run", "no_such_script.py", "--nproc", "2", cwd=workdir), "no_such_script.py")


# --------------------------------------------------------------------------- mistakes: one line, no traceback


def test_bad_model_spec_is_one_line_on_stderr(workdir):
    assert_one_line_error(run_cli("plan", "not a spec!", "--gpus", "2", cwd=workdir), "MODEL='not a spec!'")


def test_missing_factory_is_one_line_naming_the_functions_there(workdir):
    assert_one_line_error(run_cli("profile", "tiny.py:nope", cwd=workdir), "has no factory 'nope'", "make")


def test_factory_returning_the_wrong_thing_is_one_line(workdir):
    assert_one_line_error(run_cli("plan", "tiny.py:wrong_type", "--gpus", "2", cwd=workdir),
                          "wrong_type() returned int", "(model, example_args)")


def test_an_output_into_a_missing_folder_is_one_line_before_any_work(workdir):
    result = run_cli("plan", "tiny.py:make", "--gpus", "2", "--out", "no_such_folder/plan.json", cwd=workdir)
    assert_one_line_error(result, "--out", "the folder 'no_such_folder' does not exist")
    assert not (workdir / "no_such_folder").exists()


def test_unwritable_output_path_is_one_line_before_any_work(workdir):
    (workdir / "a_file").write_text("x")
    result = run_cli("plan", "tiny.py:make", "--gpus", "2", "--out", "a_file/plan.json", cwd=workdir)
    assert_one_line_error(result, "--out", "is not a folder")
    assert "Stages" not in result.stdout


@pytest.mark.parametrize("argv, fragments", [
    (["profile", "missing.py:make"], ["file 'missing.py' does not exist"]),
    (["profile", "no_such_module_xyz:make"], ["no module named 'no_such_module_xyz'"]),
    (["profile", "tiny.py"], ["names a file but no factory"]),
    (["profile", "tiny.py:NOT_CALLABLE"], ["NOT_CALLABLE is a int"]),
    (["profile", "tiny.py:wrong_model"], ["returned a str where the model should be"]),
    (["profile", "tiny.py:explodes"], ["explodes() raised RuntimeError: the factory exploded"]),
    (["profile", "tiny.py:make", "--set", "bogus=1"], ["does not accept the options"]),
    (["profile", "tiny.py:make", "--set", "num_layers=two"],
     ["calling make() with --set {'num_layers': 'two'} raised TypeError", "check the values given with --set"]),
    (["plan", "tiny.py:make", "--gpus", "2", "--report", "r.pdf"], ["--report", ".html"]),
    (["plan", "tiny.py:make", "--gpus", "2", "--schedule", "fast"], ["schedule 'fast' is not known"]),
    (["plan", "tiny.py:make", "--gpus", "2", "--memory", "lots"], ["memory='lots'"]),
    (["plan", "tiny.py:make", "--gpus", "2", "--bandwidth", "fast"], ["--bandwidth 'fast' is not a rate"]),
    (["plan", "tiny.py:make", "--gpus", "2", "--action-overhead-ms", "-1"], ["--action-overhead-ms -1.0 must be"]),
    (["plan", "tiny.py:make", "--gpus", "2", "--memory", "1KiB", *FAST], ["per device fits (with 2 stages"]),
    (["plan", "llama3-70b", "--gpus", "256"], ["is a named shape", "autopipe layout llama3-70b --gpus N"]),
])
def test_user_mistakes_are_one_line_on_stderr(workdir, monkeypatch, capsys, argv, fragments):
    monkeypatch.chdir(workdir)
    assert main(argv) != 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    for fragment in fragments:
        assert fragment in err, err


@pytest.mark.parametrize("argv", [["plan", "tiny.py:make"], ["plan", "tiny.py:make", "--gpus", "zero"], ["bogus"]])
def test_bad_options_are_one_line_pointing_at_help(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--help" in err


def test_debug_shows_the_traceback_instead(workdir, monkeypatch):
    monkeypatch.chdir(workdir)
    with pytest.raises(ModelSpecError):
        main(["--debug", "profile", "tiny.py:wrong_type"])


# --------------------------------------------------------------------------- MODEL specs


def test_model_spec_reads_a_module_factory_with_options():
    loaded = load_model_spec("autopipe.models:seed_transformer", options={"vocab_size": 50, "num_layers": 1})
    assert loaded.model.vocab_size == 50 and loaded.example_args[0].dtype.is_floating_point is False


def test_a_name_of_no_known_form_lists_the_forms():
    with pytest.raises(ModelSpecError, match="path/to/file.py:factory, package.module:factory"):
        load_model_spec("mlp", options={"widths": [4, 8], "batch": 2})


def test_model_spec_wraps_a_bare_tensor_as_one_positional_input(tmp_path):
    (tmp_path / "bare.py").write_text("import torch\ndef make():\n    return torch.nn.Linear(2, 2), torch.zeros(1, 2)\n")
    loaded = load_model_spec(f"{tmp_path / 'bare.py'}:make")
    assert isinstance(loaded.example_args, tuple) and len(loaded.example_args) == 1


def test_model_spec_reads_a_hugging_face_config_folder_without_downloading(tmp_path):
    pytest.importorskip("transformers")
    config = {"model_type": "gpt2", "n_layer": 1, "n_embd": 16, "n_head": 2, "vocab_size": 64, "n_positions": 32,
              "bos_token_id": 0, "eos_token_id": 0}
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded = load_model_spec(str(tmp_path), options={"seq_len": 8, "batch": 3})
    assert tuple(loaded.example_args[0].shape) == (3, 8)
    assert tuple(loaded.model(*loaded.example_args).shape) == (3, 8, 64)


def test_model_spec_refuses_an_unknown_name_saying_nothing_is_downloaded():
    pytest.importorskip("transformers")
    with pytest.raises(ModelSpecError, match="never downloads"):
        load_model_spec("surely-not-a-model-name-xyz")


def test_no_flush_cache_keeps_the_caches_warm_while_profiling(workdir, flushers_built, capsys):
    built = flushers_built
    spec = str(workdir / "tiny.py") + ":make"
    assert main(["profile", spec, *FAST, "--device", "cpu", "--set", "num_layers=1"]) == 0
    assert built == [1]  # the default empties the caches between passes
    assert main(["profile", spec, *FAST, "--device", "cpu", "--set", "num_layers=1", "--no-flush-cache"]) == 0
    assert main(["plan", spec, "--gpus", "2", *FAST, "--device", "cpu", "--set", "num_layers=1",
                 "--no-flush-cache"]) == 0
    assert built == [1]  # neither profile nor plan built a flusher with --no-flush-cache
    capsys.readouterr()


def test_fit_to_whole_reaches_the_profile_from_the_command_line(workdir, rounds_seen, capsys):
    spec = str(workdir / "tiny.py") + ":make"
    assert main(["profile", spec, *FAST, "--device", "cpu", "--set", "num_layers=1", "--fit-to-whole", "yes"]) == 0
    assert main(["plan", spec, "--gpus", "2", *FAST, "--device", "cpu", "--set", "num_layers=1"]) == 0
    assert rounds_seen == [(True, True), (True, False)]  # the default on the CPU: not fitted
    assert "segments not scaled to it" in capsys.readouterr().out
