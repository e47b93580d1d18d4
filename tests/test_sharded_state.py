"""Specification of checkpoints that reshard (autopipe.runtime.sharded_state).

A checkpoint written with ``torch.distributed.checkpoint`` by a pipeline with one split,
schedule and world size loads into a pipeline with another, or into the unsplit model
with torch's own ``get_state_dict`` / ``set_state_dict``, and training goes on as if it
had never stopped: model and AdamW state keyed by the original names. The distributed
scenario runs once (``_sharded_state_workers.py``); the unit tests check the state dicts'
form and errors on a stand-in for a pipeline that holds part of a model, with no processes.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

import _sharded_state_workers as workers
from _dist_utils import run_world
from autopipe.runtime.params import model_state_names
from autopipe.runtime.sharded_state import (RankState, load_model_state_dict, load_optimizer_state_dict, model_state_dict,
                                            optimizer_state_dict)

TOL = 1e-5
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


# ---------------------------------------------------------------------------- 2 gloo ranks
@functools.lru_cache(maxsize=None)
def resharding(tmp: str) -> list[dict]:
    return run_world(workers.resharding_run, 2, tmp, timeout_s=420)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    return resharding(str(tmp_path_factory.mktemp("dcp")))


@pytest.mark.parametrize("case", ["four_stage", "unsplit", "from_unsplit_2", "from_unsplit_4"])
def test_a_resumed_step_equals_the_unsplit_models_third(results, case):
    # four_stage: 2-stage 1F1B checkpoint -> 4-stage Interleaved1F1B on 2 ranks;
    # unsplit: the same checkpoint -> the unsplit model + AdamW via torch's set_state_dict;
    # from_unsplit_*: torch's get_state_dict checkpoint of the unsplit model -> pipelines.
    for rank, result in enumerate(results):
        worst = max(result[case].items(), key=lambda kv: kv[1])
        assert worst[1] <= TOL, f"rank {rank}, {case}: {worst[0]} differs by {worst[1]:.3g}"
        assert result["before_save"] <= TOL, f"rank {rank}: the run that saved already differs"


def test_every_entry_is_written_by_one_rank(results):
    # The tied embedding (held by both ranks) and the buffer no stage reads (kept by every
    # rank) are in both ranks' dicts; DCP's save planner writes each once.
    written = results[0]["written"]
    assert not set(written[0]) & set(written[1])
    everything = set(written[0]) | set(written[1])
    assert {"model.embedding.weight", "model.out_linear.weight", "model.unread",
            "optim.state.embedding.weight.exp_avg"} <= everything
    assert "unread" in results[0]["model_keys"] and "unread" in results[1]["model_keys"]


def test_the_tied_parameter_gets_the_same_optimizer_state_on_both_ranks(results):
    first, second = results[0]["tied_state"]
    assert set(first) == {"step", "exp_avg", "exp_avg_sq"}
    for key in first:
        assert torch.equal(first[key], second[key]), key
    assert first["step"].item() == 2


def test_tensors_no_stage_reads_are_restored(results):
    for rank, result in enumerate(results):
        for unread in result["unread"]:
            assert torch.equal(unread, torch.arange(5.0)), rank
        assert torch.equal(result["unread_unsplit"], torch.arange(5.0))


# ---------------------------------------------------------------------------- one process
class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(6, 4)
        self.mid = nn.Linear(4, 4)
        self.head = nn.Linear(4, 6, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("table", torch.arange(3.0))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mid(self.embed(ids))))


def stand_in(model: nn.Module, held: list[str], unheld: tuple[str, ...] = ("table",), rank: int = 0) -> RankState:
    """A rank holding ``held`` (canonical names) of ``model``, as a Pipeline hands it to sharded_state."""
    names = model_state_names(model)
    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    return RankState(names, {n: tensors[n] for n in held}, {n: tensors[n].detach().clone() for n in unheld},
                     rank=rank, world_size=2)


def trained(model: nn.Module, steps: int = 2) -> torch.optim.Optimizer:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(steps):
        opt.zero_grad()
        model(torch.tensor([[1, 2, 3], [step, 4, 5]])).square().mean().backward()
        opt.step()
    return opt


def test_the_model_dict_names_every_alias_and_the_unheld_tensors():
    model = Tied()
    last = stand_in(model, ["mid.weight", "mid.bias", "embed.weight"])
    assert sorted(model_state_dict(last)) == ["embed.weight", "head.weight", "mid.bias", "mid.weight", "table"]
    assert model_state_dict(last)["head.weight"].data_ptr() == model.embed.weight.data_ptr()  # live: dcp.load fills it
    first = stand_in(model, ["embed.weight"])
    assert sorted(model_state_dict(first)) == ["embed.weight", "head.weight", "table"]


def test_loading_the_model_takes_this_ranks_part_of_a_full_dict():
    source, target = Tied(), Tied()
    rank = stand_in(target, ["mid.weight", "mid.bias"])
    load_model_state_dict(rank, source.state_dict())
    assert torch.equal(target.mid.weight, source.mid.weight)
    assert not torch.equal(target.embed.weight, source.embed.weight)  # another rank's
    partial = {k: v for k, v in source.state_dict().items() if k != "mid.bias"}
    with pytest.raises(KeyError, match=r"missing names \['mid.bias'\]"):
        load_model_state_dict(rank, partial)
    with pytest.raises(KeyError, match=r"names the model does not have \['encoder.weight'\]"):
        load_model_state_dict(rank, {**source.state_dict(), "encoder.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match=r"'mid.weight' has shape \(4, 5\)"):
        load_model_state_dict(rank, {**source.state_dict(), "mid.weight": torch.zeros(4, 5)})
    with pytest.raises(TypeError, match="state_dict must be a mapping"):
        load_model_state_dict(rank, [1, 2])


def test_the_optimizer_dict_is_torchs_flattened_form():
    model = Tied()
    opt = trained(model)
    ours = optimizer_state_dict(stand_in(model, ["embed.weight", "mid.weight", "mid.bias"]), opt)
    theirs = get_optimizer_state_dict(model, opt, options=FLAT)
    assert sorted(ours) == sorted(theirs)
    for key, value in theirs.items():
        assert torch.equal(ours[key], value) if isinstance(value, torch.Tensor) else ours[key] == value, key


def test_a_fresh_optimizer_loads_a_part_of_torchs_dict_and_keeps_its_gradients():
    source = Tied()
    flat = get_optimizer_state_dict(source, trained(source), options=FLAT)
    target = Tied()
    rank = stand_in(target, ["mid.weight", "mid.bias"])
    opt = torch.optim.AdamW([target.mid.weight, target.mid.bias], lr=0.5)
    target.mid.bias.grad = torch.ones(4)
    before = target.mid.weight.detach().clone()
    load_optimizer_state_dict(rank, opt, flat)
    assert torch.equal(target.mid.weight, before) and torch.equal(target.mid.bias.grad, torch.ones(4))
    assert opt.param_groups[0]["lr"] == 1e-2  # the checkpoint's hyperparameters
    assert torch.equal(opt.state[target.mid.weight]["exp_avg"], flat["state.mid.weight.exp_avg"])
    assert opt.state[target.mid.bias]["step"].item() == 2


def test_optimizer_errors_name_what_is_wrong():
    model = Tied()
    rank = stand_in(model, ["mid.weight", "mid.bias"])
    stranger = nn.Parameter(torch.zeros(7))
    with pytest.raises(ValueError, match=r"not this pipeline's \(rank 0\).*shape \(7,\).*pipe.parameters\(\)"):
        optimizer_state_dict(rank, torch.optim.AdamW([model.mid.weight, stranger]))
    opt = torch.optim.AdamW([model.mid.weight, model.mid.bias])
    flat = optimizer_state_dict(rank, opt)
    with pytest.raises(KeyError, match=r"missing keys \['state.mid.bias.exp_avg'\]"):
        load_optimizer_state_dict(rank, opt, {k: v for k, v in flat.items() if k != "state.mid.bias.exp_avg"})
    with pytest.raises(KeyError, match=r"naming no parameter of the model \['state.decoder.w.exp_avg'\]"):
        load_optimizer_state_dict(rank, opt, {**flat, "state.decoder.w.exp_avg": torch.zeros(1)})
    with pytest.raises(ValueError, match=r"share a parameter group but were saved with lr=0.001 and lr=0.5"):
        load_optimizer_state_dict(rank, opt, {**flat, "param_groups.mid.bias.lr": 0.5})
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer"):
        optimizer_state_dict(rank, [model.mid.weight])
