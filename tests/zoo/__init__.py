"""The models autopipe's tests and benchmarks plan and run; not part of the library.

- :mod:`zoo.models`: CNN, U-Net, MLP with uneven layers and a seed-Transformer LM, and
  :data:`ZOO`, a short name for each factory (:func:`build`);
- :mod:`zoo.hf`: small GPT-2 and Llama from a config (needs transformers);
- :mod:`zoo.thirdparty`: the third-party model suite (Hugging Face, timm, torchvision, ...)
  with what each family is expected to do, and :mod:`zoo.thirdparty_checks`, the checks.

Every factory returns ``(model, example_args)``, the convention of
:func:`autopipe.models.seed_transformer`. Benchmarks put ``tests/`` on ``sys.path`` to import it.

Example:
    >>> from zoo import ZOO, build
    >>> model, (x,) = build("unet", base_width=4, depth=2, image_size=8, batch=1)
    >>> "seed_transformer" in ZOO
    True
"""

from .hf import HF_AVAILABLE, gpt2_from_config, llama_from_config
from .models import ZOO, build, seed_transformer_lm, shrinking_cnn, unet, varying_mlp

__all__ = ["HF_AVAILABLE", "gpt2_from_config", "llama_from_config", "ZOO", "build", "seed_transformer_lm",
           "shrinking_cnn", "unet", "varying_mlp"]
