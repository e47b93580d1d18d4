"""build_cost_graph(): every tensor live across a cut is counted, skip connections included."""

from __future__ import annotations

import networkx as nx
import torch
import torch.nn as nn

from autopipe.planning.costgraph import build_cost_graph
from autopipe.planning.tracing import trace


class Skip(nn.Module):
    """a -> b -> c, with a's output also added after c: a long skip connection."""

    def __init__(self, d=8):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(d, d), nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x):
        h = self.a(x)
        return self.c(self.b(h)) + h


def test_residual_stream_crossing_bytes(small_traced):
    cg = build_cost_graph(small_traced)
    k = cg.segment_index("layers.1")
    assert cg.cut_fwd_bytes[k] == 2 * 8 * 32 * 4  # batch x seq x d_model float32


def test_skip_connection_counts_at_every_cut_it_spans():
    x = torch.randn(3, 8)
    cg = build_cost_graph(trace(Skip(), (x,)))
    k_b, k_c = cg.segment_index("b"), cg.segment_index("c")
    h = 3 * 8 * 4
    assert cg.cut_fwd_bytes[k_b] == h  # only h crosses before b
    assert cg.cut_fwd_bytes[k_c] == h + 3 * 16 * 4  # b's output and the skipped h
    assert "linear" in cg.cut_tensors[k_c]  # a's output, by graph name


def test_gradients_cross_back_only_for_tensors_that_need_them():
    class IntPath(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.head = nn.Embedding(10, 4), nn.Linear(4, 10)

        def forward(self, ids):
            return self.head(self.emb(ids)) + ids.unsqueeze(-1).float()

    ids = torch.randint(0, 10, (2, 5))
    cg = build_cost_graph(trace(IntPath(), (ids,)))
    k = cg.segment_index("head")
    # The embedding output (float, needs grad) and the int ids cross forward; only the former back.
    assert cg.cut_fwd_bytes[k] == 2 * 5 * 4 * 4 + 2 * 5 * 8
    assert cg.cut_bwd_bytes[k] == 2 * 5 * 4 * 4


def test_graph_nodes_are_segments_and_edges_carry_bytes(small_traced):
    cg = build_cost_graph(small_traced)
    assert isinstance(cg.graph, nx.DiGraph)
    assert list(cg.graph.nodes) == list(range(small_traced.num_segments))
    assert all(d["bytes"] > 0 for _, _, d in cg.graph.edges(data=True))
    assert nx.is_directed_acyclic_graph(cg.graph)
