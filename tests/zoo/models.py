"""Small models with uneven layers, for autopipe's examples, tests and benchmarks.

Every factory here is keyword-only and returns ``(model, example_args)``: the model (in
training mode, seeded, built on the CPU) and a tuple holding one micro-batch of input, the
convention of :func:`autopipe.models.seed_transformer`. Module names say what a piece is
(``blocks.3``, ``down.1``, ``mid``, ``up.2``, ``head``), so split points read naturally.

:data:`ZOO` maps a short name to each factory; :func:`build` looks one up by name. Their
default sizes keep one forward + backward of a micro-batch to milliseconds on a CPU, so tests
and benchmarks run on a laptop.

Example:
    >>> from zoo import build
    >>> model, (x,) = build("mlp", widths=(8, 80, 8), batch=4)
    >>> tuple(model(x).shape)
    (4, 10)
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import hf
from autopipe.models import SeedTransformer

__all__ = [
    "ZOO",
    "build",
    "shrinking_cnn",
    "unet",
    "varying_mlp",
    "seed_transformer_lm",
    "ShrinkingCNN",
    "UNet",
    "VaryingMLP",
]

#: A zoo factory: keyword-only sizes, ``batch`` and ``seed`` -> ``(model, example_args)``.
Factory = Callable[..., "tuple[nn.Module, tuple[Any, ...]]"]


def _seeded(seed: int, build_model: Callable[[], nn.Module]) -> nn.Module:
    """Builds a model under ``torch.manual_seed(seed)`` without touching the caller's RNG."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build_model()


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------- CNN
class ConvBlock(nn.Module):
    """3x3 convolution, batch norm, ReLU, then 2x2 max-pooling: channels up, size halved."""

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size=3, padding=1, bias=False)
        self.norm = nn.BatchNorm2d(out_channels)
        self.act = nn.ReLU()
        self.pool = nn.MaxPool2d(2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pool(self.act(self.norm(self.conv(x))))


class ShrinkingCNN(nn.Module):
    """A classifier CNN whose feature maps shrink as its channels grow.

    Early blocks hold few parameters but large activations (full-resolution maps); late
    blocks the reverse. A split balanced by parameter count therefore overloads the first
    stage with compute and activation memory.

    Modules: ``blocks.0`` .. ``blocks.{n-1}`` (:class:`ConvBlock`), ``head`` (flatten,
    ``head.fc1``, ReLU, ``head.fc2``).
    """

    def __init__(self, *, in_channels: int, image_size: int, widths: Sequence[int],
                 hidden: int, num_classes: int) -> None:
        super().__init__()
        channels = [in_channels, *widths]
        self.blocks = nn.ModuleList(ConvBlock(c_in, c_out) for c_in, c_out in zip(channels, channels[1:]))
        final_size = image_size >> len(widths)
        self.head = nn.Sequential(OrderedDict(
            flatten=nn.Flatten(),
            fc1=nn.Linear(widths[-1] * final_size * final_size, hidden),
            act=nn.ReLU(),
            fc2=nn.Linear(hidden, num_classes),
        ))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def shrinking_cnn(
    *,
    in_channels: int = 3,
    image_size: int = 64,
    widths: Sequence[int] = (16, 32, 64, 128, 256),
    hidden: int = 512,
    num_classes: int = 10,
    batch: int = 8,
    seed: int = 0,
) -> tuple[ShrinkingCNN, tuple[torch.Tensor]]:
    """A :class:`ShrinkingCNN` and one micro-batch of images.

    Keyword Args:
        in_channels, image_size: Input images are (batch, in_channels, image_size, image_size).
        widths: Output channels of each block; each block halves the spatial size, so
            ``image_size`` must be divisible by ``2 ** len(widths)``.
        hidden, num_classes: Sizes of the classifier head.
        batch: Images in the example micro-batch.
        seed: Seeds the weights and the example input; the global RNG is left untouched.

    Returns:
        ``(model, (images,))``; ``model(images)`` is a (batch, num_classes) tensor.

    Example:
        >>> model, (x,) = shrinking_cnn(image_size=16, widths=(4, 8), batch=2)
        >>> tuple(model(x).shape)
        (2, 10)
    """
    if not widths:
        raise ValueError("widths must name at least one block, got an empty sequence")
    if image_size % (1 << len(widths)):
        raise ValueError(
            f"image_size={image_size} must be divisible by 2**len(widths)={1 << len(widths)} "
            f"(each of the {len(widths)} blocks halves it)"
        )
    model = _seeded(seed, lambda: ShrinkingCNN(
        in_channels=in_channels, image_size=image_size, widths=widths, hidden=hidden,
        num_classes=num_classes,
    ))
    return model, (_randn(batch, in_channels, image_size, image_size, seed=seed),)


# ---------------------------------------------------------------------------- U-Net
class DoubleConv(nn.Module):
    """Two (3x3 convolution, batch norm, ReLU) layers at constant spatial size."""

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, kernel_size=3, padding=1, bias=False)
        self.norm1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, kernel_size=3, padding=1, bias=False)
        self.norm2 = nn.BatchNorm2d(out_channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.norm1(self.conv1(x)))
        return F.relu(self.norm2(self.conv2(x)))


class UpBlock(nn.Module):
    """Doubles the size with a transposed convolution, concatenates the skip, convolves."""

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        self.upsample = nn.ConvTranspose2d(in_channels, out_channels, kernel_size=2, stride=2)
        self.conv = DoubleConv(2 * out_channels, out_channels)

    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        return self.conv(torch.cat([skip, self.upsample(x)], dim=1))


class UNet(nn.Module):
    """A U-Net: an encoder, a bottleneck and a decoder joined by long skip connections.

    Each encoder level's output is kept and concatenated into the decoder level of the
    same size, so a cut anywhere between ``down.1`` and the last ``up`` must carry the
    current activation *and* every skip still waiting to be consumed.

    Modules: ``down.0`` .. ``down.{d-1}`` (:class:`DoubleConv`, each followed by 2x2
    max-pooling), ``mid`` (the bottleneck), ``up.0`` .. ``up.{d-1}`` (:class:`UpBlock`,
    deepest first), ``head`` (1x1 convolution to ``out_channels``).
    """

    def __init__(self, *, in_channels: int, out_channels: int, base_width: int, depth: int) -> None:
        super().__init__()
        widths = [base_width << level for level in range(depth + 1)]
        self.down = nn.ModuleList(
            DoubleConv(c_in, c_out) for c_in, c_out in zip([in_channels, *widths[:depth - 1]], widths[:depth])
        )
        self.mid = DoubleConv(widths[depth - 1], widths[depth])
        self.up = nn.ModuleList(UpBlock(widths[level + 1], widths[level]) for level in reversed(range(depth)))
        self.head = nn.Conv2d(widths[0], out_channels, kernel_size=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = []
        for down in self.down:
            x = down(x)
            skips.append(x)
            x = F.max_pool2d(x, 2)
        x = self.mid(x)
        for up, skip in zip(self.up, reversed(skips)):
            x = up(x, skip)
        return self.head(x)


def unet(
    *,
    in_channels: int = 3,
    out_channels: int = 2,
    base_width: int = 16,
    depth: int = 3,
    image_size: int = 64,
    batch: int = 2,
    seed: int = 0,
) -> tuple[UNet, tuple[torch.Tensor]]:
    """A :class:`UNet` segmentation model and one micro-batch of images.

    Keyword Args:
        in_channels, out_channels: Channels of the input image and of the output map.
        base_width: Channels of the first level; each deeper level doubles them.
        depth: Encoder levels (and decoder levels); ``image_size`` must be divisible by
            ``2 ** depth``.
        image_size: Side of the square example images.
        batch: Images in the example micro-batch.
        seed: Seeds the weights and the example input; the global RNG is left untouched.

    Returns:
        ``(model, (images,))``; ``model(images)`` is (batch, out_channels, image_size, image_size).

    Example:
        >>> model, (x,) = unet(base_width=4, depth=2, image_size=8, batch=1)
        >>> tuple(model(x).shape)
        (1, 2, 8, 8)
    """
    if depth < 1:
        raise ValueError(f"depth={depth} must be at least 1")
    if image_size % (1 << depth):
        raise ValueError(f"image_size={image_size} must be divisible by 2**depth={1 << depth}")
    model = _seeded(seed, lambda: UNet(
        in_channels=in_channels, out_channels=out_channels, base_width=base_width, depth=depth,
    ))
    return model, (_randn(batch, in_channels, image_size, image_size, seed=seed),)


# ---------------------------------------------------------------------------- MLP
class MLPBlock(nn.Module):
    """A linear layer followed by a ReLU."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.fc = nn.Linear(in_features, out_features)
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.fc(x))


class VaryingMLP(nn.Module):
    """An MLP whose layer widths vary widely, so its layers' costs do too.

    Modules: ``blocks.0`` .. ``blocks.{n-2}`` (:class:`MLPBlock`, ``widths[i] ->
    widths[i+1]``), ``head`` (a linear layer to ``num_classes``).
    """

    def __init__(self, *, widths: Sequence[int], num_classes: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(MLPBlock(w_in, w_out) for w_in, w_out in zip(widths, widths[1:]))
        self.head = nn.Linear(widths[-1], num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def varying_mlp(
    *,
    widths: Sequence[int] = (256, 2560, 256, 2560, 256, 1024, 128, 1280, 256),
    num_classes: int = 10,
    as_sequential: bool = False,
    batch: int = 32,
    seed: int = 0,
) -> tuple[nn.Module, tuple[torch.Tensor]]:
    """An MLP with widths varying tenfold and one micro-batch of input vectors.

    Keyword Args:
        widths: Input width, then each hidden layer's width. The default swings between
            128 and 2560, so a layer's cost varies about twentyfold.
        num_classes: Width of the output layer.
        as_sequential: Return a flat ``nn.Sequential`` of ``Linear``/``ReLU`` layers
            (module names ``"0"``, ``"1"``, ..., as torchgpipe and DeepSpeed users write
            models) instead of a :class:`VaryingMLP` with ``blocks.i`` and ``head``.
            Both have the same weights for the same seed.
        batch: Vectors in the example micro-batch.
        seed: Seeds the weights and the example input; the global RNG is left untouched.

    Returns:
        ``(model, (x,))``; ``model(x)`` is a (batch, num_classes) tensor.

    Example:
        >>> model, (x,) = varying_mlp(widths=(4, 40, 4), as_sequential=True, batch=2)
        >>> [name for name, _ in model.named_children()]
        ['0', '1', '2', '3', '4']
    """
    if len(widths) < 2:
        raise ValueError(f"widths={tuple(widths)} needs an input width and at least one layer width")
    model: nn.Module = _seeded(seed, lambda: VaryingMLP(widths=widths, num_classes=num_classes))
    if as_sequential:
        layers: list[nn.Module] = []
        for block in model.blocks:  # reuse the same modules, so the weights match
            layers += [block.fc, block.act]
        model = nn.Sequential(*layers, model.head)
    return model, (_randn(batch, widths[0], seed=seed),)


# ---------------------------------------------------------------------------- Transformers
def seed_transformer_lm(
    *,
    vocab_size: int = 8000,
    d_model: int = 128,
    num_heads: int = 4,
    d_ff: int = 512,
    num_layers: int = 4,
    batch: int = 2,
    seq_len: int = 32,
    dropout: float = 0.0,
    seed: int = 0,
) -> tuple[SeedTransformer, tuple[torch.Tensor]]:
    """The seed tutorial's Transformer with a large vocabulary, seeded by ``seed``.

    Like :func:`autopipe.models.seed_transformer`, sized for the zoo: the 8,000-token
    ``out_linear`` costs about as much as all the blocks together.

    Example:
        >>> model, (x,) = seed_transformer_lm(vocab_size=50, d_model=8, num_heads=2, d_ff=16,
        ...                                   num_layers=2, seq_len=4)
        >>> tuple(model(x).shape)
        (2, 4, 50)
    """
    model = _seeded(seed, lambda: SeedTransformer(
        vocab_size, d_model=d_model, num_heads=num_heads, d_ff=d_ff, num_layers=num_layers,
        max_len=max(seq_len, 64), dropout=dropout,
    ))
    tokens = torch.randint(0, vocab_size, (batch, seq_len), generator=torch.Generator().manual_seed(seed))
    return model, (tokens,)


#: Name -> factory. Each factory takes keyword-only sizes plus ``batch`` and ``seed`` and
#: returns ``(model, example_args)``. The Hugging Face entries raise ImportError, saying
#: what to install, when transformers is missing (see ``hf.HF_AVAILABLE``).
ZOO: dict[str, Factory] = {
    "seed_transformer": seed_transformer_lm,
    "gpt2_tied": functools.partial(hf.gpt2_from_config, tie_word_embeddings=True),
    "gpt2_untied": functools.partial(hf.gpt2_from_config, tie_word_embeddings=False),
    "llama": hf.llama_from_config,
    "cnn": shrinking_cnn,
    "unet": unet,
    "mlp": varying_mlp,
    "mlp_sequential": functools.partial(varying_mlp, as_sequential=True),
}


def build(name: str, **sizes: Any) -> tuple[nn.Module, tuple[Any, ...]]:
    """Builds the zoo model called ``name``; ``sizes`` override the factory's defaults.

    Raises:
        KeyError: ``name`` is not in :data:`ZOO` (the message lists the names that are).
        ImportError: a Hugging Face model was asked for and transformers is missing.

    Example:
        >>> model, (x,) = build("cnn", image_size=16, widths=(4, 8), batch=2, seed=1)
        >>> type(model).__name__
        'ShrinkingCNN'
    """
    try:
        factory = ZOO[name]
    except KeyError:
        raise KeyError(f"no zoo model {name!r}; choose one of {sorted(ZOO)}") from None
    return factory(**sizes)
