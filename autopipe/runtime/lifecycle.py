"""A pipeline's lifecycle: failed steps, ``close()`` and the ``with`` block."""

from __future__ import annotations

import atexit
from typing import Any

from .distributed import close_at_exit, destroy_groups, hold_process_group, release_process_group
from .step_failures import StepFailures

class PipelineLifecycle:
    """Failed-step state, :meth:`close` and the context manager of a pipeline."""

    # ------------------------------------------------------------------ failed steps and closing
    def _start_lifecycle(self) -> None:
        """State for failed steps and :meth:`close`; makes interpreter exit call :meth:`close`."""
        self._closed = False
        self._failures = StepFailures()
        # The default process group, when autopipe created it, is destroyed when the last
        # pipeline holding it closes.
        self._holds_group = hold_process_group(self)
        self._close_at_exit = close_at_exit(self)

    def close(self) -> None:
        """Release what the pipeline holds for communication; safe to call again.

        Example:
            >>> with Pipeline(model, example_args=(x_mb,), loss_fn=loss_fn) as pipe:  # doctest: +SKIP
            ...     for x, y in loader:
            ...         opt.zero_grad(); pipe.step(x, target=y); opt.step()
            >>> pipe.close()  # closed already: nothing happens  # doctest: +SKIP
        """
        if getattr(self, "_closed", True):
            return
        self._closed = True
        atexit.unregister(self._close_at_exit)
        # The schedules and stages hold the process group and the step's buffers; a gloo
        # group joins its threads only once nothing refers to it any more.
        self._train_schedule = None
        inference = getattr(self, "_inference", None)
        if inference is not None:
            inference.close()
        self._train_stages = []
        shapes = getattr(self, "_shapes", None)
        if shapes is not None:
            shapes.close()
        # getattr: a constructor that raised after joining the job leaves no _shared behind.
        shared = getattr(self, "_shared", [])
        self._shared = [(names, None) for names, _ in shared]
        destroy_groups([group for _, group in shared if group is not None])
        if self._holds_group:
            self._holds_group = False
            release_process_group(self)

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran."""
        return getattr(self, "_closed", False)

    def __enter__(self) -> "PipelineLifecycle":
        """``with Pipeline(...) as pipe:`` closes the pipeline when the block ends.

        Example:
            >>> with Pipeline(model, example_args=(x_mb,), loss_fn=loss_fn) as pipe:  # doctest: +SKIP
            ...     loss = pipe.step(x, target=y)
        """
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def _check_usable(self) -> None:
        """Raise if the pipeline was closed, or a failed step left it unable to run."""
        if self.closed:
            raise RuntimeError("the pipeline is closed (close() or the end of its with-block): build a new "
                               "Pipeline to run more steps")
        if self._failures.broken is not None:
            raise RuntimeError(self._failures.broken)
