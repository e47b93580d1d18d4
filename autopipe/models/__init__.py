"""Models for autopipe's examples, tests and benchmarks.

Every factory returns ``(model, example_args)``: the model and a tuple holding one
micro-batch of input, ready for ``autopipe.partition(model, example_args=example_args)``
or ``torch.distributed.pipelining.pipeline(model, example_args, split_spec=...)``.

- :func:`seed_transformer`: the seed tutorial's Transformer (``layers.1`` ...).
- :mod:`~autopipe.models.hf`: small GPT-2 and Llama from a config (needs transformers).
- :mod:`~autopipe.models.zoo`: CNN, U-Net and MLP with uneven layers, and :data:`ZOO`.

Example:
    >>> from autopipe.models import ZOO, build
    >>> model, (x,) = build("unet", base_width=4, depth=2, image_size=8, batch=1)
    >>> "seed_transformer" in ZOO
    True
"""

from .hf import HF_AVAILABLE, gpt2_from_config, llama_from_config
from .transformer import SeedTransformer, seed_transformer
from .zoo import ZOO, build, seed_transformer_lm, shrinking_cnn, unet, varying_mlp

__all__ = [
    "SeedTransformer",
    "seed_transformer",
    "HF_AVAILABLE",
    "gpt2_from_config",
    "llama_from_config",
    "ZOO",
    "build",
    "seed_transformer_lm",
    "shrinking_cnn",
    "unet",
    "varying_mlp",
]
