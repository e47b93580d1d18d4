"""Layouts at scale: tensor, pipeline and data parallelism, micro-batches, schedule and per-block checkpointing planned together (see :mod:`.step`)."""
