"""Third-party model tests: a model whose package cannot be imported here is skipped, with the reason.

Every test in this folder that is parametrized by ``name`` (a key of
:data:`zoo.thirdparty.REGISTRY`) is skipped when the model's package is
missing or fails to import (torchvision built for another torch, say); the skip message
is :func:`zoo.thirdparty.package_missing`'s one line.
"""

from __future__ import annotations

import pytest

from zoo.thirdparty import get, package_missing


@pytest.fixture(autouse=True)
def _skip_without_package(request: pytest.FixtureRequest) -> None:
    callspec = getattr(request.node, "callspec", None)
    name = callspec.params.get("name") if callspec is not None else None
    if name is None:
        return
    reason = package_missing(get(name).package)
    if reason is not None:
        pytest.skip(reason)
