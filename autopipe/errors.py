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
    "PlanFileError",
    "PipelineStepError",
    "CheckpointError",
]


class AutopipeError(Exception):
    """Base class of every error autopipe raises on purpose."""


class MissingExampleInputsError(AutopipeError, ValueError):
    """No example micro-batch was given and the model carries none."""


class ModelExportError(AutopipeError, RuntimeError):
    """torch.export could not capture the model as one graph.

    ``kind`` says which failure it was, as :func:`autopipe.planning.tracing.export_failure_kind` tells
    them apart: ``"data-dependent"``, ``"output-type"``, ``"cache-output"``,
    ``"input-type"``, ``"parameter-change"`` or ``"other"``.
    """

    def __init__(self, message: str, *, kind: str = "other") -> None:
        super().__init__(message)
        self.kind = kind


class InfeasibleMemoryError(AutopipeError, ValueError):
    """No split fits the given device memory; the message says a memory that fits.

    ``min_memory_bytes``: that memory, where known: the least the search found among the
    splits it tries (exact for one stage per rank; with several, another split may fit in a
    little less). ``factorizations``: when pipeline x data
    parallel was planned, every (pp, dp) layout tried, each with its own least memory
    (:class:`autopipe.planning.plan_records.Factorization`); empty otherwise.
    """

    def __init__(self, message: str, *, min_memory_bytes: int | None = None,
                 factorizations: list | None = None) -> None:
        super().__init__(message)
        self.min_memory_bytes = min_memory_bytes
        self.factorizations = list(factorizations or [])


class PlanFileError(AutopipeError, ValueError):
    """A plan file (or the data given to ``Plan.from_dict``) is not a plan this autopipe can run.

    Raised by :meth:`autopipe.Plan.load`, :meth:`autopipe.Plan.from_dict` and
    :meth:`autopipe.Plan.check_model` for any malformed content: not JSON, too large, too
    deeply nested, a missing or unknown field, a wrong type, a value out of range, or fields
    that disagree with each other. ``field`` is the field at fault, as a path into the file
    (``"n_microbatches"``, ``"stages[2].fwd_s"``, ``"machine.links[0].bandwidth"``), or ``""``
    when the file as a whole is unreadable; ``path`` is the file, or None for data given
    directly.

    Example:
        >>> err = PlanFileError("stages[0].fwd_s=-1.0 must be a finite number >= 0", field="stages[0].fwd_s")
        >>> err.field, isinstance(err, ValueError)
        ('stages[0].fwd_s', True)
    """

    def __init__(self, message: str, *, field: str = "", path: str | None = None) -> None:
        super().__init__(message)
        self.field = field
        self.path = path


class PipelineStepError(AutopipeError, RuntimeError):
    """A stage's forward or the loss raised during a pipeline step; every rank raises this.

    The failing rank did not stop: it handed zeros on for the rest of the step, so no rank
    was left waiting for it, and every rank then learned of the failure at the step's end.
    ``failures`` maps each rank that failed to its error, in words; on a failing rank the
    original exception is this one's ``__cause__``. The pipeline stays usable: the next
    batch can be stepped (zero the gradients first: this step's are partial).

    Example:
        >>> err = PipelineStepError("step() failed on rank 1", failures={1: "ValueError: bad row"})
        >>> err.failures, isinstance(err, RuntimeError)
        ({1: 'ValueError: bad row'}, True)
    """

    def __init__(self, message: str, *, failures: dict[int, str] | None = None) -> None:
        super().__init__(message)
        self.failures = dict(failures or {})


class CheckpointError(AutopipeError, RuntimeError):
    """A checkpoint could not be saved or loaded: some rank failed to write or read its part, or the
    folder is incomplete. Raised on every rank, with torch's own exception (a
    ``CheckpointException``, which is no ``Exception``) as the cause. A failed save leaves the
    previous checkpoint in place (:mod:`autopipe.runtime.checkpoint_files`).

    Example:
        >>> isinstance(CheckpointError("could not save"), RuntimeError)
        True
    """
