"""Loading ``file.py:factory`` runs the file, and its folder must not shadow installed modules."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from autopipe.cli.modelspec import load_model_spec

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MODEL_FILE = textwrap.dedent("""
    import torch
    from torch import nn

    def make():
        from neighbour_layers import WIDTH  # a module beside this file, imported late
        return nn.Linear(WIDTH, WIDTH), (torch.zeros(2, WIDTH),)
""")


def _model_folder(tmp_path):
    folder = tmp_path / "model_dir"
    folder.mkdir()
    (folder / "model.py").write_text(MODEL_FILE)
    (folder / "neighbour_layers.py").write_text("WIDTH = 3\n")
    # A stray file named like an installed module: importing it would be the failure.
    (folder / "networkx.py").write_text("raise ImportError('the networkx.py beside the model was imported')\n")
    return folder


def test_a_module_beside_the_model_does_not_shadow_an_installed_one(tmp_path):
    folder = _model_folder(tmp_path)
    # A fresh interpreter: networkx must not be imported yet, as in `autopipe plan`, where
    # the planner imports it after the model was loaded.
    check = textwrap.dedent(f"""
        import sys
        assert "networkx" not in sys.modules
        from autopipe.cli.modelspec import load_model_spec
        loaded = load_model_spec({str(folder / "model.py") + ":make"!r})
        import autopipe.planning.costgraph  # the planner's graph module: imports networkx
        import networkx
        print(networkx.__file__)
    """)
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=300, env=env,
                          cwd=str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    assert not done.stdout.strip().startswith(str(folder)), done.stdout


def test_the_model_file_still_imports_its_neighbours(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))  # restored afterwards
    monkeypatch.delitem(sys.modules, "neighbour_layers", raising=False)
    folder = _model_folder(tmp_path)
    loaded = load_model_spec(f"{folder / 'model.py'}:make")
    assert loaded.model.in_features == 3
    assert str(folder) in sys.path and sys.path.index(str(folder)) > 0


def test_the_cli_docs_say_that_loading_a_model_runs_its_code_and_what_trust_remote_code_does():
    with open(os.path.join(REPO, "docs", "cli.md"), encoding="utf-8") as f:
        text = f.read()
    assert "Loading a model runs its code" in text
    assert "as `python file.py` would" in text
    assert "trust_remote_code=true" in text and "runs the Python code" in text
