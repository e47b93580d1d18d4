"""Every tensor crossing a cut is a message: counted in the cost graph, charged its latency each.

torch's pipeline stages send each boundary tensor on its own and a gradient back for every
floating-point one; a cut where a mask and position tensors cross beside the hidden state
costs several latencies, not one (docs/design.md, finding 14). Costs are injected or
counted: nothing here is timed.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autopipe.machine.device import CPU_STEP_MESSAGE_S, default_link, step_message_s
from autopipe.planning import costmodel
from autopipe.planning.costgraph import build_cost_graph
from autopipe.planning.partitioner import PartitionProblem
from autopipe.planning.simulator import simulate
from autopipe.planning.tracing import trace

pytestmark = pytest.mark.unit


class SideTensors(nn.Module):
    """A block whose later half reads the hidden state, a float mask and integer positions."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(8, 8)
        self.second = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = torch.ones(x.shape[0], 8, dtype=torch.float64)  # floating, needs no gradient
        positions = torch.arange(8).expand(x.shape[0], 8)  # integer
        h = self.first(x)
        return self.second(h) * mask.float() + positions.float()


def test_the_cost_graph_counts_each_tensor_crossing_and_each_gradient_sent_back():
    traced = trace(SideTensors(), (torch.randn(2, 8),))
    graph = build_cost_graph(traced)
    k = graph.segment_index("second")
    crossing = graph.cut_tensors[k]
    assert graph.cut_fwd_messages[k] == len(crossing) >= 3  # the hidden state, the mask, the positions
    # torch sends a gradient back for every floating-point tensor, the mask included.
    floating = sum(1 for n in traced.exported.graph.nodes if n.name in crossing
                   and n.meta["val"].is_floating_point())
    assert graph.cut_bwd_messages[k] == floating < graph.cut_fwd_messages[k]
    assert graph.cut_fwd_messages[0] == graph.cut_fwd_messages[-1] == 0


def test_each_message_pays_the_latency():
    one = costmodel.cut_time_s(4096, 4096, bandwidth=1e9, latency_s=5e-4)
    four = costmodel.cut_time_s(4096, 4096, bandwidth=1e9, latency_s=5e-4, messages=4)
    assert four - one == pytest.approx(3 * 5e-4)
    assert costmodel.cut_time_s(0, 0, bandwidth=1e9, latency_s=5e-4, messages=4) == 0.0
    busy = costmodel.link_busy_s(4096.0, 4096.0, 1e9, 5e-4, fwd_messages=3, bwd_messages=2)
    assert busy == pytest.approx(8192 / 1e9 + 5 * 5e-4)


def test_a_cut_sending_more_tensors_costs_its_stages_more_link_time():
    # Two cuts balance the compute alike; the first sends 4 tensors, the second 1.
    problem = PartitionProblem.uniform([1e-3] * 4, 2, cut_bytes=[0, 10, 1024, 1024, 0], bandwidth=2e9,
                                       latency_s=CPU_STEP_MESSAGE_S)
    problem = PartitionProblem(**{**problem.__dict__, "compute_s": [1e-3, 1e-3, 1e-3, 1e-3],
                                  "cut_fwd_messages": [0, 1, 4, 1, 0], "cut_bwd_messages": [0, 1, 4, 1, 0]})
    assert problem.link_s(0)[2] > problem.link_s(0)[3]
    assert problem.link_at_s(0, 2) == pytest.approx(problem.link_s(0)[2])


def test_a_measured_idle_latency_is_raised_to_a_cpu_message_inside_a_step():
    assert default_link("cpu")[1] == CPU_STEP_MESSAGE_S
    assert step_message_s("cpu", 1e-4) == CPU_STEP_MESSAGE_S and step_message_s("cpu", 2e-3) == 2e-3
    assert step_message_s("cuda", 1e-5) == 1e-5


def test_lazy_sends_are_continuous_in_the_link_time():
    # A receive posted at the very instant the sender's next action starts finds the sender
    # waiting in the library: no link time must not cost more than a tiny one.
    def step(comm: float) -> float:
        return simulate([2e-4, 2e-4], [4e-4, 4e-4], schedule="1F1B", n_microbatches=4, comm_s=comm,
                        action_overhead_s=7e-4, lazy_sends=True).step_s

    assert step(0.0) == pytest.approx(step(1e-9), abs=1e-8)
