"""What the profile charges for activations equals what autograd really keeps alive.

The saved bytes of a segment are the storages autograd holds for its backward; a tensor
saved by two segments (a ReLU's output that the max-pool after it saves as its input) is
one storage, charged once. The reference here is independent of the profiler: every storage
that a whole-model forward saves, found by storage identity through
``torch.autograd.graph.saved_tensors_hooks``, parameters and buffers excluded.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from autopipe.machine.passes import SavedBytes
from autopipe.planning.profile import profile_segments
from autopipe.planning.tracing import trace


def _storages_saved(model: nn.Module, *args: torch.Tensor) -> int:
    """Bytes of the distinct storages a forward of ``model`` saves for backward, parameters and buffers excluded."""
    state = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    kept: dict[int, torch.UntypedStorage] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in state:
            kept[st.data_ptr()] = st  # kept alive here, so no address is reused while counting
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(*args).sum()
    return sum(st.nbytes() for st in kept.values())


class _ReluPoolCNN(nn.Module):
    """Convolution, batch norm, ReLU (in place or not), max-pool, twice; then a linear head."""

    def __init__(self, inplace: bool) -> None:
        super().__init__()
        layers = []
        for c_in, c_out in ((3, 8), (8, 16)):
            layers += [nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out),
                       nn.ReLU(inplace=inplace), nn.MaxPool2d(2)]
        self.features = nn.Sequential(*layers)
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(16 * 4 * 4, 32), nn.ReLU(inplace=inplace), nn.Linear(32, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def _profiled_act_bytes(model: nn.Module, x: torch.Tensor) -> int:
    costs = profile_segments(trace(model, (x,)), device="cpu", cost="flops", progress=False)
    return sum(c.act_bytes for c in costs)


def test_segment_saved_bytes_add_up_to_what_autograd_keeps_for_relu_cnn() -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 3, 16, 16)
    for inplace in (False, True):
        model = _ReluPoolCNN(inplace).train()
        expected = _storages_saved(model, x)
        assert _profiled_act_bytes(model, x) == expected, f"inplace={inplace}"


def test_tensor_saved_by_two_segments_is_charged_to_the_first() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.MaxPool1d(2)).train()
    x = torch.randn(4, 2, 8)
    costs = profile_segments(trace(model, (x,)), device="cpu", cost="flops", progress=False)
    relu_out = 4 * 2 * 8 * 4
    # The linear saves its input, the ReLU its output; the max-pool saves that same output
    # (charged to the ReLU already) and its int64 indices (its own).
    pool_indices = 4 * 2 * 4 * 8
    assert [c.act_bytes for c in costs] == [4 * 2 * 8 * 4, relu_out, pool_indices]


def test_saved_bytes_counts_a_storage_once_however_many_views_are_saved() -> None:
    x = torch.randn(4, 8, requires_grad=True)
    counter = SavedBytes(set())
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t):
        y = x.exp()           # saves its result y
        y.view(32).sin()      # saves a view of y: the same storage
    assert counter.total == 4 * 8 * 4


def test_saved_bytes_charges_an_expanded_tensor_the_storage_it_holds() -> None:
    row = torch.randn(1, 8, requires_grad=True)
    other = torch.randn(4, 8, requires_grad=True)
    counter = SavedBytes(set())
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t):
        row.expand(4, 8) * other  # saves both factors; the expanded one holds one row
    assert counter.total == 8 * 4 + 4 * 8 * 4


# --------------------------------------------------------------------------- the backward's working set


def test_backward_working_set_is_the_gradients_the_backward_holds_at_once() -> None:
    """Bias-free linear layers make the count exact by hand: while a layer's backward runs, the
    gradient arriving at its output, its input's gradient and (accumulating into ``.grad``) the
    fresh weight gradient are alive together; the input gradients alone leave out the last."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32, bias=False), nn.Tanh(), nn.Linear(32, 64, bias=False))
    costs = profile_segments(trace(model, (torch.randn(8, 16),)), cost="flops", progress=False)
    f32 = 4
    head = costs[-1]  # Linear(32, 64) on an input that carries a gradient
    assert head.bwd_peak_bytes == f32 * (8 * 64 + 8 * 32 + 32 * 64)
    assert head.bwd_input_peak_bytes == f32 * (8 * 64 + 8 * 32)
    tanh = costs[1]  # no weights: the arriving gradient and the input's
    assert tanh.bwd_peak_bytes == tanh.bwd_input_peak_bytes == f32 * (8 * 32 + 8 * 32)
    first = costs[0]  # the model's input carries no gradient: no input gradient is made
    assert first.bwd_peak_bytes == f32 * (8 * 32 + 16 * 32)
    assert first.bwd_input_peak_bytes == f32 * 8 * 32


class _CountStorages(TorchDispatchMode):
    """The reference count: every storage an operator makes, alive until Python frees it (weak references)."""

    def __init__(self) -> None:
        super().__init__()
        self.now = self.peak = 0
        self.refs: list[weakref.ref] = []

    def _drop(self, n: int) -> None:
        self.now -= n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        res = func(*args, **(kwargs or {}))
        ins = {a.untyped_storage().data_ptr() for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)}
        for t in tree_leaves(res):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in ins:
                n = t.untyped_storage().nbytes()
                self.now += n
                self.peak = max(self.peak, self.now)
                self.refs.append(weakref.ref(t.untyped_storage(), lambda _r, n=n: self._drop(n)))
        return res


def test_backward_working_set_matches_storage_accounting_of_a_stage_backward() -> None:
    """Each segment's figure against a stage-like backward of its module alone (``.grad`` already
    there, ``Tensor.backward`` from an output gradient made inside the count): these modules
    save only their input, which outlives the backward, so nothing is credited back."""
    torch.manual_seed(0)
    seg = nn.Sequential(nn.Linear(32, 48), nn.GELU(), nn.Linear(48, 24))
    model = nn.Sequential(nn.Linear(32, 32), seg)
    costs = profile_segments(trace(model, (torch.randn(6, 32),)), cost="flops", progress=False)
    reference = []
    width = 32
    for module in seg:
        inp = torch.randn(6, width, requires_grad=True)
        out = module(inp)
        width = out.shape[-1]
        for p in module.parameters():
            p.grad = torch.zeros_like(p)
        with _CountStorages() as count:
            out.backward(torch.ones_like(out))
        reference.append(count.peak)
    assert [c.bwd_peak_bytes for c in costs[1:]] == reference


def test_rank_peak_bytes_charges_a_stage_backward_working_set_once() -> None:
    """1F1B, 2 stages: rank 0 runs F0 F1 B0 F2 B1 F3 B2 B3, rank 1 F0 B0 F1 B1 ...; each backward's
    working set comes on top of what is held as it starts; the stage's first backward of the
    step uses the input-gradient figure (its weight gradients become the .grad)."""
    from autopipe.planning.costmodel import rank_peak_bytes, simulate_step

    def peaks(m: int, work: tuple[list[int], list[int]] | None) -> list[float]:
        t = simulate_step([1.0, 1.0], [2.0, 2.0], [], schedule="1F1B", n_microbatches=m, stages_per_rank=1)
        return rank_peak_bytes(t, stage_static_bytes=[1000, 1000], stage_act_bytes=[100, 100], cut_fwd_bytes=[0],
                               cut_bwd_bytes=[0], split_backward=False, stage_work_bytes=work)

    assert peaks(4, None) == [1200.0, 1100.0]
    assert peaks(4, ([50, 70], [50, 70])) == [1250.0, 1170.0]
    assert peaks(8, ([50, 70], [50, 70])) == [1250.0, 1170.0]  # once, not per micro-batch
    assert peaks(4, ([50, 70], [10, 20])) == [1250.0, 1170.0]  # later backwards accumulate
    assert peaks(4, ([0, 0], [300, 20])) == [1500.0, 1120.0]  # the first backward of rank 0: 200 held


def test_stage_work_bytes_takes_off_the_received_gradient_and_what_later_segments_freed() -> None:
    from autopipe.planning.costmodel import stage_work_bytes

    # Stage 0 = segments 0, 1; its last segment's arriving gradient (cut 2: 40) is a receive buffer.
    assert stage_work_bytes([10, 50, 30, 20], [2], [0, 5, 40, 8, 0], [0, 0, 0, 0]) == [10, 30]
    # Segment 2 runs after segment 3 freed its 25 saved bytes.
    assert stage_work_bytes([10, 50, 30, 20], [2], [0, 5, 40, 8, 0], [0, 0, 0, 25]) == [10, 20]


def test_old_plan_segments_without_working_set_load_with_zero() -> None:
    from autopipe.planning.plan_records import PlanSegment

    seg = PlanSegment(fwd_s=1e-3, bwd_s=2e-3, param_bytes=64, act_bytes=32, out_bytes=16)
    assert seg.cost().bwd_peak_bytes == seg.cost().bwd_input_peak_bytes == 0


# --------------------------------------------------------------------------- views, gradients, the loss


class _FusedQKV(nn.Module):
    """One projection split three ways (GPT-2's attention): q, k and v are views of one storage."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 24)
        self.out = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).split(8, dim=-1)
        return self.out(q * k * v)


def test_views_at_an_offset_share_their_storage_key() -> None:
    from autopipe.machine.passes import storage_key

    x = torch.randn(4, 24, requires_grad=True)
    q, k, v = x.split(8, dim=-1)
    assert storage_key(q) == storage_key(k) == storage_key(v) == storage_key(x)
    counter = SavedBytes(set())
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t):
        k * v  # saves k and v: two views of x at offsets, one storage
    assert counter.total == 4 * 24 * 4


def test_split_projection_is_charged_its_storage_once() -> None:
    torch.manual_seed(0)
    model, x = _FusedQKV().train(), torch.randn(4, 8)
    assert _profiled_act_bytes(model, x) == _storages_saved(model, x)


def test_gradients_exist_only_from_a_stage_first_backward() -> None:
    """GPipe, 2 stages, 4 micro-batches, 100 activation bytes each, static 1000 holding 300 of
    gradients: a step starts with no .grad, so the peak is at the end of the first backward
    (3 micro-batches held + the gradients), not 4 held + gradients."""
    from autopipe.planning.costmodel import rank_peak_bytes, simulate_step

    def peaks(grads: list[int] | None) -> list[float]:
        t = simulate_step([1.0, 1.0], [2.0, 2.0], [], schedule="GPipe", n_microbatches=4, stages_per_rank=1)
        return rank_peak_bytes(t, stage_static_bytes=[1000, 1000], stage_act_bytes=[100, 100], cut_fwd_bytes=[0],
                               cut_bwd_bytes=[0], split_backward=False, stage_grad_bytes=grads)

    assert peaks(None) == [1400.0, 1400.0]
    assert peaks([300, 300]) == [1300.0, 1300.0]
    assert peaks([50, 50]) == [1350.0, 1350.0]  # small gradients: the peak is the 4 held before it
    assert peaks([0, 0]) == peaks(None)


def test_first_backward_with_gradients_absent_uses_the_accumulating_working_set() -> None:
    """A stage's first backward makes fresh weight gradients just as a later one does before
    adding them in; with the gradients taken off until then, both use the same working set."""
    from autopipe.planning.costmodel import rank_peak_bytes, simulate_step

    t = simulate_step([1.0, 1.0], [2.0, 2.0], [], schedule="GPipe", n_microbatches=1, stages_per_rank=1)

    def peak(grads: list[int] | None) -> float:
        return rank_peak_bytes(t, stage_static_bytes=[1000, 1000], stage_act_bytes=[100, 100], cut_fwd_bytes=[0],
                               cut_bwd_bytes=[0], split_backward=False, stage_work_bytes=([350, 0], [0, 0]),
                               stage_grad_bytes=grads)[0]

    assert peak([300, 300]) == 1000 - 300 + 100 + 350  # its one backward: fresh gradients, none before
    assert peak(None) == 1000 + 100  # gradients held all step: the first backward makes no more


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 4)
        self.mid = nn.Linear(4, 4)
        self.head = nn.Linear(4, 16, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.mid(self.emb(ids)))


def test_stage_grad_bytes_counts_a_tied_weight_once_per_rank() -> None:
    from autopipe.planning.problem import stage_grad_bytes

    traced = trace(_Tied(), (torch.randint(0, 16, (2, 3)),))
    cut = next(c.position for c in traced.candidates if c.name == "head")
    tied, mid = 16 * 4 * 4, 4 * 4 * 4 + 4 * 4
    assert stage_grad_bytes(traced, [cut], [0, 1]) == [tied + mid, tied]  # a copy on each rank
    assert stage_grad_bytes(traced, [cut], [0, 0]) == [mid, tied]  # one .grad, made by the last stage


def test_loss_frees_what_it_saved_before_the_last_segment_backward() -> None:
    """The loss saves its log-softmax beside the logits it is handed; by the time the head's
    backward runs (working set: the logits' gradient and a fresh weight gradient) the loss has
    freed the log-softmax, so the head's working set counts less that."""
    from autopipe.planning.costgraph import SegmentCost
    from autopipe.planning.planner import _with_loss
    from autopipe.planning.profile import LossCost

    head = SegmentCost(fwd_s=0.0, bwd_s=0.0, param_bytes=4000, act_bytes=100, out_bytes=2000,
                       trainable_param_bytes=4000, bwd_peak_bytes=6000, bwd_input_peak_bytes=2100)
    loss = LossCost(fwd_s=0.0, bwd_s=0.0, act_bytes=4000, batch=1, bwd_peak_bytes=3900)
    (got,) = _with_loss([head], loss)
    assert got.act_bytes == 4100
    assert got.bwd_peak_bytes == max(6000 - 2000, 3900)
    assert got.bwd_input_peak_bytes == 3900  # the loss's own, whole: nothing of the head's is made yet


def test_weight_gradient_action_holds_fresh_gradients_of_the_stage_at_once() -> None:
    """ZBV's W (torch's stage_backward_weight) makes fresh weight gradients a group at a time
    before adding them in, so a stage after the first may hold up to all its gradients fresh
    at once beside the accumulated ones; stage 0's W is a plain backward (its working set)."""
    from autopipe.planning.costmodel import rank_peak_bytes, simulate_step

    t = simulate_step([1.0] * 4, [2.0] * 4, [0.0] * 3, schedule="ZBVZeroBubble", n_microbatches=4, stages_per_rank=2)

    def peaks(grads: list[int]) -> list[float]:
        return rank_peak_bytes(t, stage_static_bytes=[1000] * 4, stage_act_bytes=[0] * 4, cut_fwd_bytes=[0] * 3,
                               cut_bwd_bytes=[0] * 3, split_backward=True, stage_work_bytes=([10] * 4, [10] * 4),
                               stage_grad_bytes=grads)

    # Rank 0 holds stages 0 and 3, rank 1 stages 1 and 2; no activations, so the peak is a W.
    assert peaks([0, 0, 0, 0]) == [2010.0, 2010.0]
    assert peaks([500, 0, 0, 0]) == [2010.0, 2010.0]  # stage 0: its measured working set only
    assert peaks([0, 500, 0, 0]) == [2010.0, 2500.0]  # stage 1: all 500 of its gradients fresh


class _LongSkip(nn.Module):
    """``l0``'s output is read by ``l1`` and again by the add after ``l3``: ``l2`` only relays it."""

    def __init__(self) -> None:
        super().__init__()
        self.l0, self.l1, self.l2, self.l3, self.l4 = (nn.Linear(8, 8) for _ in range(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.l0(x)
        return self.l4(self.l3(self.l2(self.l1(a))) + a)


def test_a_stage_between_two_reads_of_a_tensor_relays_its_gradient() -> None:
    import numpy as np

    from autopipe.planning.costgraph import build_cost_graph
    from autopipe.planning.costmodel import relayed_gradient_bytes

    graph = build_cost_graph(trace(_LongSkip(), (torch.randn(2, 8),)))
    assert graph.segment_names == ["<input>", "l1", "l2", "l3", "l4"]
    # Made in segment 0, read in 1, then next in 3 (the add): segment 2 lies in between.
    assert graph.relay_gaps == [(1, 3, 2 * 8 * 4)]
    gaps = np.array(graph.relay_gaps, dtype=float)
    assert relayed_gradient_bytes(gaps, [1, 2, 3], 5) == [0.0, 0.0, 64.0, 0.0]
    assert relayed_gradient_bytes(gaps, [2, 3], 5) == [0.0, 64.0, 0.0]  # l2 alone: it reads nothing of it
    assert relayed_gradient_bytes(gaps, [1, 4], 5) == [0.0, 0.0, 0.0]  # l1..l3 read it in l1 and the add


def test_a_relayed_gradient_is_kept_once_under_a_split_backward_and_copied_under_a_full_one() -> None:
    """ZBV on 2 ranks: rank 1 runs stages 1 and 2. Stage 1 sends 5 bytes of input gradient back per
    micro-batch, kept until the step ends: 20 bytes by the end. If stage 1 only relays that tensor,
    a split backward (torch.autograd.grad) hands back the storage the gradient arrived in, already
    held; a full backward accumulates it into a fresh ``.grad`` (torch 2.13, measured on a U-Net)."""
    from autopipe.planning.costmodel import rank_peak_bytes, simulate_step

    timeline = simulate_step([1.0] * 4, [2.0] * 4, [], schedule="ZBVZeroBubble", n_microbatches=4, stages_per_rank=2)
    assert timeline.stage_ranks == [0, 1, 1, 0]

    def peaks(split: bool, relayed: list[float] | None) -> list[float]:
        return rank_peak_bytes(timeline, stage_static_bytes=[0] * 4, stage_act_bytes=[0] * 4, cut_fwd_bytes=[0, 0, 0],
                               cut_bwd_bytes=[5, 0, 0], split_backward=split, relayed_grad_bytes=relayed)

    assert peaks(True, None) == [0.0, 20.0]
    assert peaks(True, [0, 5, 0, 0]) == [0.0, 0.0]
    assert peaks(False, [0, 5, 0, 0]) == peaks(False, None) == [0.0, 20.0]


def test_layer_level_problem_keeps_the_relay_gaps_a_layer_can_lie_in() -> None:
    from autopipe.planning.partitioner import PartitionProblem
    from autopipe.planning.split_candidates import layer_problem

    problem = PartitionProblem.uniform([1.0] * 6, 2)
    problem = PartitionProblem(**{**problem.__dict__, "relay_gaps": [[0, 5, 8], [1, 2, 8], [-1, 6, 4]]})
    # Layers [0, 1], [2, 3], [4, 5]: segment 0 -> 5 spans layers 0 -> 2; 1 -> 2 stays within 0 -> 1;
    # a model input (-1) read by the output (6) spans all three.
    assert layer_problem(problem, [0, 2, 4]).relay_gaps.tolist() == [[0.0, 2.0, 8.0], [-1.0, 3.0, 4.0]]


def test_relay_gaps_outside_the_segments_are_refused() -> None:
    import pytest

    from autopipe.planning.partitioner import PartitionProblem

    problem = PartitionProblem.uniform([1.0] * 6, 2)
    with pytest.raises(ValueError, match="relay_gaps"):
        PartitionProblem(**{**problem.__dict__, "relay_gaps": [[0, 9, 8]]})
