"""Running a planned pipeline: the drop-in :class:`Pipeline` and the ``autopipe run`` launcher.

    >>> from autopipe.runtime import Pipeline  # doctest: +SKIP
    >>> pipe = Pipeline(model, example_args=(x_mb,), loss_fn=loss_fn)  # doctest: +SKIP

- ``pipeline.py``: :class:`Pipeline` - plan, build this rank's stages, step torch's schedule.
- ``distributed.py``: joining the job, picking the device (CUDA+NCCL or CPU+gloo), and
  destroying the process group autopipe created once no pipeline holds it.
- ``step_failures.py``: a stage that raises plays the step through, so no rank waits for it.
- ``params.py``: original parameter names, tied parameters shared by stages.
- ``checkpointing.py``: per-stage activation checkpointing.
- ``launch.py``: ``autopipe run script.py --nproc N``, on top of torch.distributed.run.
"""

from .pipeline import Pipeline

__all__ = ["Pipeline"]
