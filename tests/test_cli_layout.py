"""``autopipe layout``: a named shape or a config.json, searched or predicted, printed with its exports."""

from __future__ import annotations

import json

import pytest

from autopipe.cli.main import main


def test_a_named_shape_is_searched_and_the_best_layout_printed_with_its_exports(capsys, tmp_path):
    out_json = tmp_path / "layouts.json"
    assert main(["layout", "llama3-8b", "--gpus", "16", "--global-batch", "32", "--top", "3",
                 "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    assert "Llama 3.1 8B: 32 blocks" in out and "layouts considered" in out
    assert "torchtitan: {" in out and "Megatron-LM: --tensor-model-parallel-size" in out
    assert "autopipe.Pipeline: schedule=" in out and "DataParallelOptions(" in out
    listed = json.loads(out_json.read_text())
    assert len(listed) == 3 and listed[0]["tokens_per_s_per_gpu"] >= listed[-1]["tokens_per_s_per_gpu"]
    assert all(r["layout"]["tp"] * r["layout"]["pp"] * r["layout"]["dp"] == 16 for r in listed)


def test_a_config_json_and_a_given_layout_are_predicted_without_a_search(capsys, tmp_path):
    config = {"model_type": "llama", "num_hidden_layers": 8, "hidden_size": 1024, "num_attention_heads": 16,
              "num_key_value_heads": 4, "intermediate_size": 4096, "vocab_size": 32000, "max_position_embeddings": 2048}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert main(["layout", str(tmp_path), "--gpus", "8", "--global-batch", "16", "--device", "A100",
                 "--tp", "2", "--pp", "2", "--dp", "2", "--micro-batch", "1", "--recompute", "full",
                 "--dp-mode", "zero1"]) == 0
    out = capsys.readouterr().out
    assert "layouts considered" not in out
    assert "tp 2 x pp 2 x dp 2 (zero1), micro-batch 1 x 8, 1F1B, full AC, SP" in out
    assert "--use-distributed-optimizer" in out and "no torchtitan equivalent" in out
    # Megatron-LM's sequence parallelism, which gathers the inputs again, is charged less memory.
    plain = ["layout", str(tmp_path), "--gpus", "8", "--global-batch", "16", "--device", "A100", "--tp", "2",
             "--pp", "2", "--dp", "2", "--micro-batch", "1", "--dp-mode", "zero1"]
    assert main(plain) == 0
    kept = [line for line in capsys.readouterr().out.splitlines() if line.startswith("tp 2 x pp 2")][0]
    assert main([*plain, "--sp-regather"]) == 0
    regathered = [line for line in capsys.readouterr().out.splitlines() if line.startswith("tp 2 x pp 2")][0]
    assert "SP, regathered" in regathered and "SP, regathered" not in kept
    gigabytes = [float(line.split(" GB")[0].split()[-1]) for line in (kept, regathered)]
    assert gigabytes[1] < gigabytes[0]


@pytest.mark.parametrize("argv, message", [
    (["llama9", "--gpus", "8", "--global-batch", "8"], "model='llama9' is neither a named shape"),
    (["llama3-8b", "--gpus", "8", "--global-batch", "8", "--tp", "2"], "missing: --pp, --dp, --micro-batch"),
    (["llama3-8b", "--gpus", "8", "--global-batch", "8", "--tp", "2", "--pp", "2", "--dp", "1", "--micro-batch", "1"],
     "--tp x --pp x --dp = 4, not --gpus 8"),
    (["llama3-8b", "--gpus", "16", "--global-batch", "8", "--tp", "16", "--pp", "1", "--dp", "1", "--micro-batch", "1",
      "--gpus-per-node", "16"], "8 key-value heads do not divide by tp=16"),
])
def test_bad_input_is_one_line_naming_it(capsys, argv, message):
    assert main(["layout", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("autopipe layout: error:") and message in err and len(err.strip().splitlines()) == 1


def test_a_factory_is_built_on_meta_traced_and_its_shape_read_from_the_graph(capsys):
    assert main(["layout", "autopipe.models:seed_transformer", "--gpus", "4", "--global-batch", "8", "--top", "1"]) == 0
    out = capsys.readouterr().out
    assert "autopipe.models:seed_transformer: 4 blocks, hidden 128, 4 heads (4 key-value)" in out
    assert "layouts considered" in out and "Megatron-LM: --tensor-model-parallel-size" in out
