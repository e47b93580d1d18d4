"""Running a planned pipeline: the drop-in :class:`Pipeline` and the ``autopipe run`` launcher.

    >>> from autopipe.runtime import Pipeline  # doctest: +SKIP
    >>> pipe = Pipeline(model, example_args=(x_mb,), loss_fn=loss_fn)  # doctest: +SKIP

The modules, in the order a pipeline's data flows through them:

- ``launch.py``: ``autopipe run script.py --nproc N``, on top of torch.distributed.run.
- ``pipeline.py``: :class:`Pipeline`, the user surface - plan, build this rank's stages,
  step torch's schedule, parameters and state dicts under the original names, closing.
- ``distributed.py``: joining the job, picking the device (CUDA+NCCL or CPU+gloo), small
  collectives, and destroying the process group autopipe created once no pipeline holds it.
- ``plan_setup.py``: one plan on every rank - the arguments checked, a plan loaded, split
  by hand or planned on rank 0 (after the ranks profile together), agreed across the ranks.
- ``stages.py``: ``pipeline()`` on a private copy, this rank's stages and torch's schedules.
- ``materialize.py``: a model built on the meta device gets real tensors for this rank's
  stages only, initialized (an init function as ``weights=``, or the default init) or loaded.
- ``compat.py``: every workaround for a torch release's pipelining, each naming its releases.
- ``relay.py``: skip connections relayed through the stages between producer and reader.
- ``params.py``: original parameter names, tied parameters shared by stages.
- ``checkpointing.py``: per-stage activation checkpointing.
- ``model_io.py``: the user's inputs to the first stage, the last stage's outputs to
  ``loss_fn``, a batch checked against the traced micro-batch.
- ``step_failures.py``: a stage that raises plays the step through, so no rank waits for it;
  the step's closing collective (the loss, and which ranks failed).
- ``inference.py``: forward only where torch can, else through a training step (V schedules).
- ``shapes.py``: a call of another sequence length: this rank's stages traced again at it,
  over the same tensors, and kept for the calls that come back to it.
- ``model_state.py``: gradients of shared parameters summed across ranks, the global
  gradient norm, full state dicts.
- ``stage_timer.py``: every stage timed inside running steps, for ``Plan.calibrate``.
- ``overhead_probe.py``: the runtime's own seconds per action, measured on a probe model.
"""

from __future__ import annotations

from .._lazy import lazy_exports

# Public name -> the module that defines it, loaded on first use.
_PUBLIC = {
    "Pipeline": "pipeline",
    "tune": "tuning",
    "measure_action_overhead": "overhead_probe",
    "split_model": "stages",
}

__all__ = list(_PUBLIC)
__getattr__, __dir__ = lazy_exports(__name__, _PUBLIC)
