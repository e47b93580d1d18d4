"""Models nobody in this project wrote, built tiny from their own configs, to see what autopipe does with them.

Each :class:`ThirdPartyModel` in :data:`REGISTRY` builds one stock model class from Hugging
Face transformers, diffusers, torchvision or timm with the class's **default** settings,
except its sizes (width 32, 2 layers, vocabulary 64, 2 heads, 32x32 images, micro-batch 2),
and random weights: nothing is downloaded. The model is returned exactly as its library
makes it - a Hugging Face model keeps its ``ModelOutput`` and its KV cache, a diffusers
UNet its ``UNet2DOutput`` - so whatever autopipe cannot yet handle shows up as a failure
instead of being patched around here.

A builder returns a :class:`Built`: ``(model, example_args, example_kwargs, target,
loss_fn)``, where ``example_args`` / ``example_kwargs`` are one batch of inputs and
``loss_fn(output, target)`` is written for what the *unsplit* model returns
(``out.logits`` for a Hugging Face model). Decoder language models get ``attention_mask``
as a keyword; encoder-decoders get ``decoder_input_ids`` as one.

``dropout=False`` sets every dropout and stochastic-depth probability to 0: a pipeline on
two processes draws different random masks than the unsplit model, so outputs can only be
compared exactly without them. Everything else stays at its default.

Entries with ``unsupported`` set are models ``torch.export`` itself cannot capture; the
reason is one line, and they are reported, not tested. This module imports none of the
third-party packages until a model is built, so it imports without them.
:mod:`zoo.thirdparty_checks` holds the checks the tests and
``benchmarks/models`` run on these models.

Example:
    >>> from zoo.thirdparty import REGISTRY, get
    >>> "gpt2" in REGISTRY and get("gpt2").family
    'decoder LM'
    >>> sorted({m.package for m in REGISTRY.values()})
    ['diffusers', 'timm', 'torchvision', 'transformers']
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = [
    "FAMILIES",
    "Built",
    "ThirdPartyModel",
    "REGISTRY",
    "get",
    "package_missing",
    "microbatch",
    "lm_loss",
    "logits_classification_loss",
    "classification_loss",
    "sample_mse_loss",
]

FAMILIES = ("decoder LM", "MoE LM", "encoder", "encoder-decoder", "vision transformer", "CNN", "diffusion UNet")

# The sizes every model shrinks to (everything else is the class's default).
WIDTH = 32
LAYERS = 2
HEADS = 2
VOCAB = 64
SEQ = 8
IMAGE = 32
CLASSES = 10  # torchvision / timm heads; Hugging Face classifiers keep their default of 2 labels


class Built(NamedTuple):
    """One built model and one batch for it.

    ``loss_fn(model(*example_args, **example_kwargs), target)`` is a scalar averaged over
    the batch, so it is also the right per-micro-batch loss for a pipeline.
    """

    model: nn.Module
    example_args: tuple[Any, ...]
    example_kwargs: dict[str, Any]
    target: Any
    loss_fn: Callable[[Any, Any], torch.Tensor]


@dataclass(frozen=True)
class ThirdPartyModel:
    """A registry entry: how to build one third-party model and what it is.

    Attributes:
        name: short name (``"gpt2"``, ``"tv_resnet"``).
        family: one of :data:`FAMILIES`.
        package: the pip package the class comes from (``"transformers"``, ...).
        source: the class or factory used, as its package spells it.
        builder: ``builder(batch, dropout, seed) -> Built``.
        unsupported: why ``torch.export`` itself cannot capture it (one line), or None.
        pipeline_split: for the representative subset checked on a real 2-rank pipeline,
            the module its second stage starts at (a block boundary in mid-model, where
            masks, position tables, skip connections or shared weights cross); else None.
        features: what it exercises, in a few words (shown in ``docs/models.md``).
    """

    name: str
    family: str
    package: str
    source: str
    builder: Callable[[int, bool, int], Built]
    unsupported: str | None = None
    pipeline_split: str | None = None
    features: str = ""

    def build(self, *, batch: int = 2, dropout: bool = True, seed: int = 0) -> Built:
        """The model (weights from ``seed``, the caller's RNG untouched) and a batch of ``batch`` samples.

        Example:
            >>> built = get("bert").build(dropout=False)  # doctest: +SKIP
            >>> built.loss_fn(built.model(*built.example_args, **built.example_kwargs), built.target)  # doctest: +SKIP
        """
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return self.builder(batch, dropout, seed)


# ----------------------------------------------------------------------------- losses
# Module-level functions, so a spawned rank can rebuild the same model and loss by name.


def lm_loss(output: Any, target: torch.Tensor) -> torch.Tensor:
    """Token cross-entropy on a Hugging Face output's ``logits`` (batch, seq, vocab).

    Example:
        >>> from types import SimpleNamespace
        >>> out = SimpleNamespace(logits=torch.zeros(2, 3, 4))
        >>> round(lm_loss(out, torch.zeros(2, 3, dtype=torch.long)).item(), 4)
        1.3863
    """
    return F.cross_entropy(output.logits.flatten(0, -2), target.flatten())


def logits_classification_loss(output: Any, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy on a Hugging Face image classifier's ``logits`` (batch, labels).

    Example:
        >>> from types import SimpleNamespace
        >>> round(logits_classification_loss(SimpleNamespace(logits=torch.zeros(2, 2)), torch.tensor([0, 1])).item(), 4)
        0.6931
    """
    return F.cross_entropy(output.logits, target)


def classification_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy on a plain logits tensor (torchvision, timm).

    Example:
        >>> round(classification_loss(torch.zeros(2, 2), torch.tensor([0, 1])).item(), 4)
        0.6931
    """
    return F.cross_entropy(output, target)


def sample_mse_loss(output: Any, target: torch.Tensor) -> torch.Tensor:
    """Mean squared error on a diffusers ``UNet2DOutput``'s ``sample``.

    Example:
        >>> from types import SimpleNamespace
        >>> sample_mse_loss(SimpleNamespace(sample=torch.ones(1, 3)), torch.zeros(1, 3)).item()
        1.0
    """
    return F.mse_loss(output.sample, target)


# ----------------------------------------------------------------------------- helpers


def microbatch(built: Built, index: int, size: int) -> tuple[tuple[Any, ...], dict[str, Any], Any]:
    """Rows ``[index * size, (index + 1) * size)`` of a built batch: ``(args, kwargs, target)``.

    Every tensor is cut along dimension 0 (the batch); anything else is passed unchanged.

    Example:
        >>> b = Built(nn.Identity(), (torch.arange(4),), {"m": torch.arange(4)}, torch.arange(4), classification_loss)
        >>> microbatch(b, 1, 2)
        ((tensor([2, 3]),), {'m': tensor([2, 3])}, tensor([2, 3]))
    """
    def cut(x: Any) -> Any:
        return x[index * size:(index + 1) * size] if isinstance(x, torch.Tensor) and x.dim() else x

    return (tuple(cut(a) for a in built.example_args), {k: cut(v) for k, v in built.example_kwargs.items()},
            cut(built.target))


def _generator(seed: int) -> torch.Generator:
    # Inputs come from their own generator: a batch of 8 starts with the batch of 2.
    return torch.Generator().manual_seed(10_000 + seed)


def _tokens(batch: int, seed: int, seq: int = SEQ, offset: int = 0) -> torch.Tensor:
    # Ids from 4 up: the small special-token ids (pad, bos, eos) stay out of the text.
    return torch.randint(4, VOCAB, (batch, seq), generator=_generator(seed + offset))


def _attention_mask(batch: int, seq: int = SEQ) -> torch.Tensor:
    # Odd rows end with one padding token, so the mask is not all ones (as in a real batch).
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[1::2, -1] = 0
    return mask


def _images(batch: int, seed: int, channels: int = 3, size: int = IMAGE) -> torch.Tensor:
    return torch.randn(batch, channels, size, size, generator=_generator(seed))


def _labels(batch: int, seed: int, classes: int) -> torch.Tensor:
    return torch.randint(0, classes, (batch,), generator=_generator(seed + 1))


_STOCHASTIC_KEYS = ("dropout", "pdrop", "drop_path", "drop_rate", "layerdrop", "mask_time_prob",
                    "mask_feature_prob")


def _hf_config(config_class: str, dropout: bool, **sizes: Any) -> Any:
    """A transformers config with only ``sizes`` changed, and token ids clamped into the small vocabulary.

    Token ids (bos, eos, pad, decoder start) index the embedding; the stock ids of a
    50k-token vocabulary would point outside a 64-token one (and transformers warns).
    """
    import transformers

    cls = getattr(transformers, config_class)
    vocab = sizes.get("vocab_size")
    if vocab:
        for key, value in cls().to_dict().items():
            if key.endswith("token_id") and isinstance(value, int) and value >= vocab and key not in sizes:
                sizes[key] = vocab - 1
    config = cls(**sizes)
    if not dropout:
        for key, value in config.to_dict().items():
            if isinstance(value, float) and any(s in key for s in _STOCHASTIC_KEYS):
                setattr(config, key, 0.0)
    return config


def _hf_model(model_class: str, config: Any) -> nn.Module:
    import transformers

    return getattr(transformers, model_class)(config).train()


def _no_dropout_modules(model: nn.Module) -> nn.Module:
    """Zero what a config field could not reach: a dropout module whose rate is hard-coded."""
    for module in model.modules():
        if isinstance(module, nn.modules.dropout._DropoutNd):
            module.p = 0.0
    return model


# ----------------------------------------------------------------------------- builders
def _causal_lm(model_class: str, config_class: str, **sizes: Any) -> Callable[[int, bool, int], Built]:
    """A decoder LM: ``model(input_ids, attention_mask=...)``, next-token loss on the logits."""

    def build(batch: int, dropout: bool, seed: int) -> Built:
        config = _hf_config(config_class, dropout, vocab_size=VOCAB, num_hidden_layers=LAYERS,
                            num_attention_heads=HEADS, hidden_size=WIDTH, intermediate_size=2 * WIDTH,
                            max_position_embeddings=64, **sizes)
        model = _hf_model(model_class, config)
        ids = _tokens(batch, seed)
        return Built(model if dropout else _no_dropout_modules(model), (ids,),
                     {"attention_mask": _attention_mask(batch)}, _tokens(batch, seed, offset=1), lm_loss)

    return build


def _gpt2(batch: int, dropout: bool, seed: int) -> Built:
    config = _hf_config("GPT2Config", dropout, vocab_size=VOCAB, n_layer=LAYERS, n_head=HEADS, n_embd=WIDTH,
                        n_positions=64)
    model = _hf_model("GPT2LMHeadModel", config)
    return Built(model if dropout else _no_dropout_modules(model), (_tokens(batch, seed),),
                 {"attention_mask": _attention_mask(batch)}, _tokens(batch, seed, offset=1), lm_loss)


def _masked_lm(model_class: str, config_class: str, **sizes: Any) -> Callable[[int, bool, int], Built]:
    """An encoder: ``model(input_ids, attention_mask=...)``, masked-LM loss over every position."""

    def build(batch: int, dropout: bool, seed: int) -> Built:
        config = _hf_config(config_class, dropout, vocab_size=VOCAB, max_position_embeddings=64, **sizes)
        model = _hf_model(model_class, config)
        return Built(model if dropout else _no_dropout_modules(model), (_tokens(batch, seed),),
                     {"attention_mask": _attention_mask(batch)}, _tokens(batch, seed, offset=1), lm_loss)

    return build


_BERT_SIZES = dict(hidden_size=WIDTH, num_hidden_layers=LAYERS, num_attention_heads=HEADS, intermediate_size=2 * WIDTH)


def _t5(batch: int, dropout: bool, seed: int) -> Built:
    config = _hf_config("T5Config", dropout, vocab_size=VOCAB, d_model=WIDTH, d_kv=WIDTH // HEADS, d_ff=2 * WIDTH,
                        num_layers=LAYERS, num_heads=HEADS)
    model = _hf_model("T5ForConditionalGeneration", config)
    return Built(model if dropout else _no_dropout_modules(model), (_tokens(batch, seed),),
                 {"attention_mask": _attention_mask(batch), "decoder_input_ids": _tokens(batch, seed, offset=2)},
                 _tokens(batch, seed, offset=1), lm_loss)


def _whisper(batch: int, dropout: bool, seed: int) -> Built:
    # The encoder insists on exactly 2 * max_source_positions input frames.
    config = _hf_config("WhisperConfig", dropout, vocab_size=VOCAB, num_mel_bins=16, d_model=WIDTH,
                        encoder_layers=LAYERS, decoder_layers=LAYERS, encoder_attention_heads=HEADS,
                        decoder_attention_heads=HEADS, encoder_ffn_dim=2 * WIDTH, decoder_ffn_dim=2 * WIDTH,
                        max_source_positions=16, max_target_positions=64)
    model = _hf_model("WhisperForConditionalGeneration", config)
    features = torch.randn(batch, 16, 32, generator=_generator(seed))
    return Built(model if dropout else _no_dropout_modules(model), (features,),
                 {"decoder_input_ids": _tokens(batch, seed, offset=2)}, _tokens(batch, seed, offset=1), lm_loss)


def _wav2vec2(batch: int, dropout: bool, seed: int) -> Built:
    # layerdrop=0.0 is the one setting changed from the stock config besides the sizes: LayerDrop
    # skips a whole layer when a random draw says so, a Python decision torch.export cannot capture.
    config = _hf_config("Wav2Vec2Config", dropout, vocab_size=VOCAB, hidden_size=WIDTH, num_hidden_layers=LAYERS,
                        num_attention_heads=HEADS, intermediate_size=2 * WIDTH, conv_dim=(WIDTH,) * 7,
                        num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=HEADS, layerdrop=0.0)
    model = _hf_model("Wav2Vec2ForCTC", config)
    samples = 4160  # 12 frames after the feature encoder (stride 320), more than SpecAugment's mask length of 10
    frames = int(model._get_feat_extract_output_lengths(samples))
    audio = torch.randn(batch, samples, generator=_generator(seed))
    return Built(model if dropout else _no_dropout_modules(model), (audio,), {}, _tokens(batch, seed, seq=frames),
                 lm_loss)


def _hf_image(model_class: str, config_class: str, **sizes: Any) -> Callable[[int, bool, int], Built]:
    """A Hugging Face image classifier: ``model(pixel_values)``, cross-entropy on the logits."""

    def build(batch: int, dropout: bool, seed: int) -> Built:
        config = _hf_config(config_class, dropout, **sizes)
        model = _hf_model(model_class, config)
        return Built(model if dropout else _no_dropout_modules(model), (_images(batch, seed),), {},
                     _labels(batch, seed, config.num_labels), logits_classification_loss)

    return build


def _unet2d(batch: int, dropout: bool, seed: int) -> Built:
    from diffusers import UNet2DModel

    # Two resolutions (one of them with attention), channel counts divisible by the groups.
    model = UNet2DModel(sample_size=IMAGE, block_out_channels=(16, WIDTH), layers_per_block=1,
                        down_block_types=("DownBlock2D", "AttnDownBlock2D"),
                        up_block_types=("AttnUpBlock2D", "UpBlock2D"), norm_num_groups=8).train()
    g = _generator(seed)
    sample = torch.randn(batch, 3, IMAGE, IMAGE, generator=g)
    timestep = torch.randint(0, 1000, (batch,), generator=g)  # one per sample, so it splits into micro-batches
    target = torch.randn(batch, 3, IMAGE, IMAGE, generator=g)
    return Built(model if dropout else _no_dropout_modules(model), (sample, timestep), {}, target, sample_mse_loss)


def _torchvision(factory: Callable[[Any, bool], nn.Module]) -> Callable[[int, bool, int], Built]:
    """A torchvision classifier: ``factory(torchvision.models, dropout)`` -> model; ``model(images)``."""

    def build(batch: int, dropout: bool, seed: int) -> Built:
        import torchvision

        model = factory(torchvision.models, dropout).train()
        return Built(model if dropout else _no_dropout_modules(model), (_images(batch, seed),), {},
                     _labels(batch, seed, CLASSES), classification_loss)

    return build


def _timm(arch: str, **sizes: Any) -> Callable[[int, bool, int], Built]:
    """A timm model from ``timm.create_model(arch, pretrained=False, ...)``: no weights are fetched."""

    def build(batch: int, dropout: bool, seed: int) -> Built:
        import timm

        model = timm.create_model(arch, pretrained=False, num_classes=CLASSES, **sizes).train()
        return Built(model if dropout else _no_dropout_modules(model), (_images(batch, seed),), {},
                     _labels(batch, seed, CLASSES), classification_loss)

    return build


def _tv_swin(tv: Any, dropout: bool) -> nn.Module:
    return tv.SwinTransformer(patch_size=[4, 4], embed_dim=16, depths=[1, 1], num_heads=[HEADS, HEADS],
                              window_size=[4, 4], num_classes=CLASSES,
                              **({} if dropout else {"stochastic_depth_prob": 0.0}))


def _tv_convnext(tv: Any, dropout: bool) -> nn.Module:
    from torchvision.models.convnext import CNBlockConfig

    return tv.ConvNeXt([CNBlockConfig(16, WIDTH, 1), CNBlockConfig(WIDTH, None, 1)], num_classes=CLASSES)


def _tv_efficientnet(tv: Any, dropout: bool) -> nn.Module:
    extra = {} if dropout else {"dropout": 0.0, "stochastic_depth_prob": 0.0}
    return tv.efficientnet_b0(num_classes=CLASSES, **extra)


def _tv_mobilenet(tv: Any, dropout: bool) -> nn.Module:
    return tv.mobilenet_v3_small(width_mult=0.25, num_classes=CLASSES, **({} if dropout else {"dropout": 0.0}))


# ----------------------------------------------------------------------------- registry
def _entries() -> list[ThirdPartyModel]:
    t = "transformers"
    lm = "decoder LM"
    moe = "MoE LM"
    enc = "encoder"
    vit = "vision transformer"
    # Key/value heads: as many as the query heads where the default config has as many
    # (multi-head attention), 1 where it has fewer (grouped-query attention). Expert counts
    # are sizes too: 4 experts, 2 per token, where the default has dozens.
    mha = {"num_key_value_heads": HEADS}
    gqa = {"num_key_value_heads": 1}
    head_dim = {"head_dim": WIDTH // HEADS}
    few_experts = {"num_experts": 4, "num_experts_per_tok": 2}
    return [
        ThirdPartyModel("gpt2", lm, t, "GPT2LMHeadModel", _gpt2, pipeline_split="transformer.h.1",
                        features="KV cache on, tied embedding/head, learned positions"),
        ThirdPartyModel("llama", lm, t, "LlamaForCausalLM",
                        _causal_lm("LlamaForCausalLM", "LlamaConfig", **mha, **head_dim),
                        pipeline_split="model.layers.1", features="rotary embedding, RMSNorm, gated MLP"),
        ThirdPartyModel("mistral", lm, t, "MistralForCausalLM",
                        _causal_lm("MistralForCausalLM", "MistralConfig", **gqa, **head_dim),
                        features="grouped-query attention, sliding window"),
        ThirdPartyModel("qwen2", lm, t, "Qwen2ForCausalLM", _causal_lm("Qwen2ForCausalLM", "Qwen2Config", **mha),
                        features="rotary, biased q/k/v"),
        ThirdPartyModel("qwen3", lm, t, "Qwen3ForCausalLM",
                        _causal_lm("Qwen3ForCausalLM", "Qwen3Config", **mha, **head_dim),
                        features="rotary, q/k norms"),
        ThirdPartyModel("phi3", lm, t, "Phi3ForCausalLM",
                        _causal_lm("Phi3ForCausalLM", "Phi3Config", **mha, original_max_position_embeddings=64),
                        features="fused qkv and gate/up projections"),
        ThirdPartyModel("gemma", lm, t, "GemmaForCausalLM",
                        _causal_lm("GemmaForCausalLM", "GemmaConfig", **mha, **head_dim),
                        features="tied embedding/head, scaled embeddings, GeLU-gated MLP"),
        ThirdPartyModel("mixtral", moe, t, "MixtralForCausalLM",
                        _causal_lm("MixtralForCausalLM", "MixtralConfig", **gqa, **head_dim),
                        pipeline_split="model.layers.1", features="8 experts, top-2 routing"),
        ThirdPartyModel("qwen2_moe", moe, t, "Qwen2MoeForCausalLM",
                        _causal_lm("Qwen2MoeForCausalLM", "Qwen2MoeConfig", **mha, **few_experts,
                                   moe_intermediate_size=WIDTH, shared_expert_intermediate_size=2 * WIDTH),
                        features="routed and shared experts"),
        ThirdPartyModel("olmoe", moe, t, "OlmoeForCausalLM",
                        _causal_lm("OlmoeForCausalLM", "OlmoeConfig", **mha, **few_experts),
                        features="top-k routing, q/k norms"),
        ThirdPartyModel("bert", enc, t, "BertForMaskedLM", _masked_lm("BertForMaskedLM", "BertConfig", **_BERT_SIZES),
                        pipeline_split="bert.encoder.layer.1",
                        features="tied embedding/decoder, token types, submodules named `self`"),
        ThirdPartyModel("roberta", enc, t, "RobertaForMaskedLM",
                        _masked_lm("RobertaForMaskedLM", "RobertaConfig", **_BERT_SIZES),
                        features="position ids computed from the padding"),
        ThirdPartyModel("electra", enc, t, "ElectraForMaskedLM",
                        _masked_lm("ElectraForMaskedLM", "ElectraConfig", embedding_size=WIDTH, **_BERT_SIZES),
                        features="generator MLM head"),
        ThirdPartyModel("distilbert", enc, t, "DistilBertForMaskedLM",
                        _masked_lm("DistilBertForMaskedLM", "DistilBertConfig", dim=WIDTH, n_layers=LAYERS,
                                   n_heads=HEADS, hidden_dim=2 * WIDTH),
                        features="tied embedding/projector"),
        ThirdPartyModel("t5", "encoder-decoder", t, "T5ForConditionalGeneration", _t5, pipeline_split="decoder",
                        features="encoder and decoder share the embedding, tied head, relative position bias"),
        ThirdPartyModel("whisper", "encoder-decoder", t, "WhisperForConditionalGeneration", _whisper,
                        features="convolutional audio encoder, cross-attention, tied head"),
        ThirdPartyModel("wav2vec2", "encoder", t, "Wav2Vec2ForCTC", _wav2vec2,
                        pipeline_split="wav2vec2.encoder.layers.1",
                        features="audio: convolutional feature encoder, SpecAugment masks drawn with NumPy (frozen "
                                 "into the traced graph; autopipe warns), in-place masking after a dropout of 0, "
                                 "config.layerdrop=0.0 (LayerDrop cannot be traced)"),
        ThirdPartyModel("switch_transformers", "encoder-decoder", t, "SwitchTransformersForConditionalGeneration",
                        _switch, unsupported=_SWITCH_REASON, features="expert-capacity routing"),
        ThirdPartyModel("vit", vit, t, "ViTForImageClassification",
                        _hf_image("ViTForImageClassification", "ViTConfig", image_size=IMAGE, patch_size=8,
                                  **_BERT_SIZES),
                        pipeline_split="vit.layers.1", features="class token, patch embedding"),
        ThirdPartyModel("swin", vit, t, "SwinForImageClassification",
                        _hf_image("SwinForImageClassification", "SwinConfig", image_size=IMAGE, embed_dim=16,
                                  depths=[1, 1], num_heads=[HEADS, HEADS], window_size=4),
                        features="shifted windows, patch merging, stochastic depth"),
        # transformers' CNN with in-place ops: its residual blocks add the shortcut with `+=`.
        ThirdPartyModel("hf_resnet", "CNN", t, "ResNetForImageClassification",
                        _hf_image("ResNetForImageClassification", "ResNetConfig", embedding_size=16,
                                  hidden_sizes=[16, WIDTH], depths=[1, 1]),
                        pipeline_split="resnet.encoder.stages.1", features="in-place residual add (`+=`), batch norm"),
        ThirdPartyModel("hf_convnext", "CNN", t, "ConvNextForImageClassification",
                        _hf_image("ConvNextForImageClassification", "ConvNextConfig", num_stages=2,
                                  hidden_sizes=[16, WIDTH], depths=[1, 1]),
                        features="depthwise convolutions, layer scale"),
        ThirdPartyModel("unet2d", "diffusion UNet", "diffusers", "UNet2DModel", _unet2d, pipeline_split="mid_block",
                        features="forward(sample, timestep), skip connections, attention blocks"),
        ThirdPartyModel("tv_resnet", "CNN", "torchvision", "models.ResNet(BasicBlock, [1, 1, 1, 1])",
                        _torchvision(lambda tv, dropout: tv.ResNet(tv.resnet.BasicBlock, [1, 1, 1, 1],
                                                                   num_classes=CLASSES)),
                        features="in-place ReLU and residual add"),
        ThirdPartyModel("tv_mobilenet_v3", "CNN", "torchvision", "models.mobilenet_v3_small",
                        _torchvision(_tv_mobilenet), features="in-place Hardswish, squeeze-excitation"),
        ThirdPartyModel("tv_efficientnet", "CNN", "torchvision", "models.efficientnet_b0",
                        _torchvision(_tv_efficientnet), features="stochastic depth, squeeze-excitation"),
        ThirdPartyModel("tv_vit", vit, "torchvision", "models.VisionTransformer",
                        _torchvision(lambda tv, dropout: tv.VisionTransformer(
                            image_size=IMAGE, patch_size=8, num_layers=LAYERS, num_heads=HEADS, hidden_dim=WIDTH,
                            mlp_dim=2 * WIDTH, num_classes=CLASSES)),
                        features="nn.MultiheadAttention encoder"),
        ThirdPartyModel("tv_swin", vit, "torchvision", "models.SwinTransformer", _torchvision(_tv_swin),
                        features="shifted windows"),
        ThirdPartyModel("tv_convnext", "CNN", "torchvision", "models.ConvNeXt", _torchvision(_tv_convnext),
                        features="depthwise convolutions, layer scale"),
        ThirdPartyModel("timm_resnet18d", "CNN", "timm", "resnet18d", _timm("resnet18d"),
                        features="deep stem, average-pool shortcut, in-place ReLU"),
        ThirdPartyModel("timm_vit", vit, "timm", "vit_tiny_patch16_224",
                        _timm("vit_tiny_patch16_224", img_size=IMAGE, patch_size=8, embed_dim=WIDTH, depth=LAYERS,
                              num_heads=HEADS),
                        features="class token, fused attention"),
    ]


# One line, shown in docs/models.md; benchmarks/models re-checks that export still fails.
_SWITCH_REASON = ("its router runs `self.classifier = self.classifier.to(self.dtype)` inside forward, replacing a "
                  "parameter while torch.export traces (RuntimeError: _apply(): Couldn't swap Linear.weight)")


def _switch(batch: int, dropout: bool, seed: int) -> Built:
    config = _hf_config("SwitchTransformersConfig", dropout, vocab_size=VOCAB, d_model=WIDTH, d_kv=WIDTH // HEADS,
                        d_ff=2 * WIDTH, num_layers=LAYERS, num_decoder_layers=LAYERS, num_heads=HEADS,
                        num_sparse_encoder_layers=1, num_sparse_decoder_layers=1, num_experts=4)
    model = _hf_model("SwitchTransformersForConditionalGeneration", config)
    return Built(model if dropout else _no_dropout_modules(model), (_tokens(batch, seed),),
                 {"attention_mask": _attention_mask(batch), "decoder_input_ids": _tokens(batch, seed, offset=2)},
                 _tokens(batch, seed, offset=1), lm_loss)


#: Every model, by name, in the order of ``docs/models.md``.
REGISTRY: dict[str, ThirdPartyModel] = {m.name: m for m in _entries()}


def get(name: str) -> ThirdPartyModel:
    """The registry entry called ``name``; the error lists the names there are.

    Example:
        >>> get("t5").family
        'encoder-decoder'
    """
    try:
        return REGISTRY[name]
    except KeyError:
        raise KeyError(f"no third-party model {name!r}; the registry has {sorted(REGISTRY)}") from None


# ----------------------------------------------------------------------------- availability
_VISION_HINT = ("install a torchvision built for this torch (the `vision` extra; CPU builds come from PyTorch's "
                "own index)")


@functools.lru_cache(maxsize=None)
def _import_failure(module: str, isolated: bool) -> str | None:
    """Why ``import module`` fails here (its last error line), or None when it imports.

    ``isolated`` imports it in a child interpreter: a torchvision built for another torch
    fails while registering its operators and leaves that half-registered state behind,
    after which even ``import transformers`` fails in the same process.
    """
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # ValueError: a module set to None in sys.modules
        found = False
    if not found:
        return f"{module} is not installed"
    if not isolated:
        try:
            importlib.import_module(module)
        except Exception as e:  # noqa: BLE001 - any failure to import is the answer
            return f"import {module} fails: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        return None
    proc = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True, timeout=300)
    if proc.returncode == 0:
        return None
    lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    return f"import {module} fails: {lines[-1].strip() if lines else f'exit code {proc.returncode}'}"


def package_missing(package: str) -> str | None:
    """Why models from ``package`` cannot be built here (one line), or None when they can.

    torchvision and timm (which imports torchvision) are imported in a child process
    first, so a broken torchvision cannot break the calling process.

    Example:
        >>> package_missing("no_such_package_here")
        'no_such_package_here is not installed'
    """
    if package in ("torchvision", "timm"):
        for module in ("torchvision", package) if package == "timm" else ("torchvision",):
            reason = _import_failure(module, True)
            if reason is not None:
                return f"{reason}; {_VISION_HINT}"
        return None
    return _import_failure(package, False)
