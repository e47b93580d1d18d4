"""The seed tutorial's Transformer, the model of ``autopipe demo`` and the examples in the docs.

:func:`seed_transformer` returns ``(model, example_args)``: the model and a tuple holding one
micro-batch of input, ready for ``autopipe.partition(model, n, example_args=example_args)`` or
``torch.distributed.pipelining.pipeline(model, example_args, split_spec=...)``.

Example:
    >>> from autopipe.models import seed_transformer
    >>> model, (ids,) = seed_transformer(vocab_size=100, num_layers=2, seq_len=8)
    >>> [name for name, _ in model.named_children()][:2]
    ['embedding', 'pos_encoding']
"""

from .transformer import SeedTransformer, seed_transformer

__all__ = ["SeedTransformer", "seed_transformer"]
