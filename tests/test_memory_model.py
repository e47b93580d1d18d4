"""What the profile charges for activations equals what autograd really keeps alive.

The saved bytes of a segment are the storages autograd holds for its backward; a tensor
saved by two segments (a ReLU's output that the max-pool after it saves as its input) is
one storage, charged once. The reference here is independent of the profiler: every storage
that a whole-model forward saves, found by storage identity through
``torch.autograd.graph.saved_tensors_hooks``, parameters and buffers excluded.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from autopipe.machine.passes import SavedBytes
from autopipe.planning.profile import profile_segments
from autopipe.planning.trace import trace


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
