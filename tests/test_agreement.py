"""Every rank agrees before it can wait: arguments that differ between ranks, and a weight file one rank
finds corrupt, end on every rank with a clear error instead of a collective's timeout."""

from __future__ import annotations

import pytest
import torch.distributed.checkpoint as dcp

from _dist_utils import run_world
from _materialize_workers import seed_model
import _agreement_workers as workers

# Far beyond what the refusals take: an error that is a timeout would say so, and the world would overrun.
PG_TIMEOUT_S = 60


@pytest.mark.parametrize("what", ["candidates", "rounds"])
def test_tune_with_other_counts_on_one_rank_is_refused_on_every_rank(what):
    results = run_world(workers.tune_with_other_counts, 2, what, timeout_s=PG_TIMEOUT_S + 60,
                        pg_timeout_s=PG_TIMEOUT_S)
    for text in results:
        assert text.startswith("ValueError: tune() was called with different candidates, rounds or plans"), text
        assert "ranks agreeing with each other: [[0], [1]]" in text


def test_other_example_inputs_on_one_rank_are_refused_on_every_rank_before_tracing():
    results = run_world(workers.pipeline_with_other_examples, 2, timeout_s=PG_TIMEOUT_S + 60,
                        pg_timeout_s=PG_TIMEOUT_S)
    for text in results:
        assert text.startswith("ValueError: the ranks were given different example inputs"), text
        assert "args[0]: torch.int64 (2, 9) on cpu on rank 0, args[0]: torch.int64 (3, 9) on cpu on rank 1" in text


def test_a_weight_file_only_one_rank_finds_corrupt_ends_every_rank_with_the_cause(tmp_path):
    folder = str(tmp_path / "weights")
    reference = seed_model(meta=False)
    dcp.save(reference.state_dict(), checkpoint_id=folder, no_dist=True)
    # Damage the stored bytes of the output layer's weight, which only the last stage (rank 1) reads.
    metadata = dcp.FileSystemReader(folder).read_metadata()
    info = next(i for k, i in metadata.storage_data.items() if k.fqn == "out_linear.weight")
    with open(f"{folder}/{info.relative_path}", "r+b") as f:
        f.seek(info.offset)
        f.write(b"\xff" * info.length)
    results = run_world(workers.weights_one_rank_finds_corrupt, 2, folder, timeout_s=PG_TIMEOUT_S + 60,
                        pg_timeout_s=PG_TIMEOUT_S)
    assert results[1].startswith("CheckpointError: could not read weights from"), results[1]
    assert results[0].startswith("RuntimeError: rank 1 could not") and "CheckpointError" in results[0], results[0]


def test_too_few_ranks_per_pipeline_under_data_parallel_names_the_degree_not_a_mesh():
    for text in run_world(workers.too_few_ranks_per_pipeline, 2, timeout_s=120):
        assert "but data_parallel=2 leaves each pipeline (2 ranks / 2) 1 processes; launch with --nproc 4, or give " \
               "data_parallel=1" in text, text
        assert "mesh" not in text
