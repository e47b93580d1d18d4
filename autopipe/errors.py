"""Errors autopipe raises for bad input, each naming the argument, the value and what works.

They subclass the built-in exception a user would expect (``ValueError``, ``RuntimeError``)
so existing ``except ValueError`` code keeps working.
"""

from __future__ import annotations

__all__ = [
    "AutopipeError",
    "MissingExampleInputsError",
    "ModelExportError",
    "InfeasibleMemoryError",
]


class AutopipeError(Exception):
    """Base class of every error autopipe raises on purpose."""


class MissingExampleInputsError(AutopipeError, ValueError):
    """No example micro-batch was given and the model carries none."""


class ModelExportError(AutopipeError, RuntimeError):
    """torch.export could not capture the model as one graph.

    ``kind`` says which failure it was, as :func:`autopipe.trace.export_failure_kind` tells
    them apart: ``"data-dependent"``, ``"output-type"``, ``"cache-output"``,
    ``"input-type"``, ``"parameter-change"`` or ``"other"``.
    """

    def __init__(self, message: str, *, kind: str = "other") -> None:
        super().__init__(message)
        self.kind = kind


class InfeasibleMemoryError(AutopipeError, ValueError):
    """No split fits the given device memory; the message says the smallest memory that fits."""

    def __init__(self, message: str, *, min_memory_bytes: int | None = None) -> None:
        super().__init__(message)
        self.min_memory_bytes = min_memory_bytes
