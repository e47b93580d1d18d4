"""trace(): legal split points are module boundaries where SplitPoint.BEGINNING works."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from autopipe.errors import MissingExampleInputsError, ModelExportError
from autopipe.planning.tracing import trace


def test_block_boundaries_are_split_points(small_traced):
    names = small_traced.split_point_names
    assert "layers.1" in names and "out_linear" in names and "pos_encoding" in names


def test_split_points_at_any_depth(small_traced):
    assert "layers.0.ffn.fc2" in small_traced.split_point_names


def test_module_starting_the_graph_is_not_a_split_point(small_traced):
    # A cut before the very first node would leave an empty first stage.
    assert "embedding" not in small_traced.split_point_names


def test_nested_modules_starting_at_the_same_node_merge_into_the_outermost(small_traced):
    cand = next(c for c in small_traced.candidates if c.name == "layers.1")
    assert "layers.1.attention" in cand.aliases
    assert "layers.1.attention" not in small_traced.split_point_names


def test_module_called_twice_is_not_a_split_point():
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.shared, self.b = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x):
            return self.b(self.shared(self.a(self.shared(x))))

    t = trace(Twice(), (torch.randn(2, 4),))
    assert "shared" not in t.split_point_names
    assert "a" in t.split_point_names and "b" in t.split_point_names


def test_segments_cover_every_node_once(small_traced):
    segs = small_traced.segments
    assert segs[0].start == 0 and segs[-1].end == len(small_traced.nodes)
    assert all(a.end == b.start for a, b in zip(segs, segs[1:]))
    assert len(segs) == len(small_traced.candidates) + 1


def test_inputs_carried_by_the_model_are_used():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    model.example_input_array = torch.randn(3, 4)
    t = trace(model)
    assert t.split_point_names == ["1", "2"]


def test_hugging_face_style_dummy_inputs_are_used_as_kwargs():
    class WithDummy(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
            self.dummy_inputs = {"x": torch.randn(2, 4)}

        def forward(self, x):
            return self.b(self.a(x))

    assert trace(WithDummy()).split_point_names == ["b"]


def test_missing_example_inputs_is_a_clear_error():
    with pytest.raises(MissingExampleInputsError, match="example_args"):
        trace(nn.Linear(2, 2))


def test_model_that_does_not_export_names_the_reason_and_what_to_try():
    class DataDependent(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            if x.sum() > 0:  # data-dependent Python control flow: export cannot capture it
                return self.lin(x)
            return x

    with pytest.raises(ModelExportError, match="torch.export could not capture DataDependent") as info:
        trace(DataDependent(), (torch.randn(2, 4),))
    assert "What to try" in str(info.value)


def test_non_module_is_rejected():
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        trace(lambda x: x, (torch.randn(1),))


def test_a_finished_trace_leaves_no_graph_alive():
    # torch's export keeps its last graph in a module-level map until the next export
    # (autopipe.planning.tracing.release_last_export); a trace must not pin it.
    import gc
    import weakref

    from torch.fx.experimental import proxy_tensor

    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    traced = trace(model, (torch.randn(3, 4),))
    graph = weakref.ref(traced.exported.graph)
    del traced
    gc.collect()
    assert graph() is None
    assert not getattr(proxy_tensor, "_FAKE_TENSOR_ID_TO_PROXY_MAP_FOR_EXPORT", {})


def test_random_numbers_drawn_with_numpy_while_tracing_are_named_as_frozen():
    import numpy as np

    from autopipe.planning.tracing import FrozenRandomnessWarning

    class NumpyMask(nn.Module):
        def forward(self, x):
            mask = torch.from_numpy(np.random.rand(*x.shape) < 0.5)  # SpecAugment draws its mask so
            return x.masked_fill(mask, 0.0)

    with pytest.warns(FrozenRandomnessWarning, match="NumpyMask's forward drew random numbers with NumPy"):
        trace(NumpyMask(), (torch.randn(2, 3),))


def test_layerdrop_in_a_hugging_face_config_is_named_with_the_line_to_change():
    class Config:  # as a transformers config holds it: an attribute of the instance
        def __init__(self):
            self.layerdrop = 0.1

    class LayerDrop(nn.Module):
        config = Config()

        def __init__(self):
            super().__init__()
            self.layer = nn.Linear(3, 3)

        def forward(self, x):
            if torch.rand([]) < self.config.layerdrop:  # Hugging Face's LayerDrop
                return x
            return self.layer(x)

    with pytest.raises(ModelExportError, match=r"LayerDrop.*set model.config.layerdrop = 0.0"):
        trace(LayerDrop().train(), (torch.randn(2, 3),))
