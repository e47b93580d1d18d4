"""Shared fixtures: small models traced once per session, so the suite stays fast."""

from __future__ import annotations

import pytest
import torch

from autopipe.models import seed_transformer
from autopipe.planning.trace import trace


@pytest.fixture(scope="session")
def small_transformer():
    """The seed Transformer at test size: (model, args). Do not mutate it."""
    return seed_transformer(vocab_size=500, d_model=32, num_heads=4, d_ff=64, num_layers=2, batch=2, seq_len=8)


@pytest.fixture(scope="session")
def small_traced(small_transformer):
    model, args = small_transformer
    return trace(model, args)


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield


@pytest.fixture
def flushers_built(monkeypatch):
    """A list that gets one entry per ``CacheFlusher`` the profiler builds (it builds one per
    profile that empties the caches)."""
    import autopipe.planning.profile as profile

    built: list[int] = []

    class CountingFlusher(profile.CacheFlusher):
        def __init__(self, *args, **kwargs):
            built.append(1)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(profile, "CacheFlusher", CountingFlusher)
    return built


@pytest.fixture
def rounds_seen(monkeypatch):
    """A list that gets ``(whole graph given, fit)`` for every profile timed in rounds."""
    import autopipe.planning.profile as profile

    seen: list[tuple[bool, bool]] = []
    real = profile._time_in_rounds

    def spy(segments, timer, warmup, repeats, flush=None, whole=None, fit=False):
        seen.append((whole is not None, fit))
        return real(segments, timer, warmup, repeats, flush, whole, fit)

    monkeypatch.setattr(profile, "_time_in_rounds", spy)
    return seen
