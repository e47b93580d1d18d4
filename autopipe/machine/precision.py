"""Mixed precision by name: the autocast dtype of ``"bf16"`` and ``"fp16"``, and autocast on a device."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where it is used: importing autopipe does not import it
    import torch

#: Mixed precisions a pipeline trains in (``PlannerOptions.mixed_precision``).
MIXED_PRECISIONS = ("bf16", "fp16")


def precision_dtype(precision: str) -> "torch.dtype":
    """The autocast dtype of a mixed precision's name.

    Example:
        >>> precision_dtype("bf16")
        torch.bfloat16
    """
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]


@contextlib.contextmanager
def mixed_precision_context(precision: str | None, device: "torch.device") -> Iterator[None]:
    """``torch.autocast`` on ``device``'s type in ``precision``; nothing for None.

    Example:
        >>> import torch
        >>> with mixed_precision_context("bf16", torch.device("cpu")):
        ...     torch.nn.Linear(2, 2)(torch.ones(1, 2)).dtype
        torch.bfloat16
    """
    if precision is None or precision == "":
        yield
        return
    import torch

    with torch.autocast(device.type, dtype=precision_dtype(precision)):
        yield
