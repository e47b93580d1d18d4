"""Make Hugging Face models traceable and trainable as they come.

Example:
    >>> import torch
    >>> from types import SimpleNamespace
    >>> model = torch.nn.Linear(2, 2)
    >>> model.config = SimpleNamespace(use_cache=True)  # what a Hugging Face model carries
    >>> with training_config(model) as changes:
    ...     model.config.use_cache, [str(c) for c in changes]
    (False, ['config.use_cache: True -> False'])
    >>> model.config.use_cache
    True
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

#: The start of the plan note that says the KV cache was turned off.
CACHE_NOTE = "use_cache turned off for tracing and training (Hugging Face KV cache)"

# How deep to look for configs nested in configs (text_config, decoder, encoder, ...): real
# models nest one or two levels; the bound guards against configs that refer to each other.
_MAX_CONFIG_DEPTH = 4


@dataclass(frozen=True)
class ConfigChange:
    """One setting autopipe changed so the model traces and trains.

    Example:
        >>> str(ConfigChange("decoder.config.use_cache", True, False))
        'decoder.config.use_cache: True -> False'
    """

    where: str
    before: Any
    after: Any
    # The config object the value lives on (None for a keyword argument): what restore() writes to.
    target: Any = field(default=None, repr=False, compare=False)
    # Whether the value was the object's own attribute rather than a class default, so that
    # restoring it leaves the object exactly as it was.
    own: bool = field(default=True, repr=False, compare=False)
    attribute: str = field(default="use_cache", repr=False, compare=False)

    def __str__(self) -> str:
        return f"{self.where}: {self.before!r} -> {self.after!r}"


def _looks_like_config(obj: Any) -> bool:
    """A config object as transformers makes them: a ``use_cache`` setting, not a module or tensor."""
    return (
        obj is not None
        and not isinstance(obj, (torch.nn.Module, torch.Tensor, bool, int, float, str, Mapping))
        and hasattr(obj, "use_cache")
    )


def _nested_configs(config: Any, path: str, depth: int) -> Iterator[tuple[str, Any]]:
    """Configs held as attributes of ``config`` (``text_config``, ``decoder``), with their paths."""
    if depth >= _MAX_CONFIG_DEPTH:
        return
    try:
        attrs = vars(config)
    except TypeError:  # an object without __dict__ (slots): nothing nested to find
        return
    for name, value in attrs.items():
        if not name.startswith("_") and _looks_like_config(value):
            yield f"{path}.{name}", value
            yield from _nested_configs(value, f"{path}.{name}", depth + 1)


def cache_configs(model: torch.nn.Module) -> list[tuple[str, Any]]:
    """Every distinct config object with a ``use_cache`` setting that the model's modules hold.

    Example:
        >>> from types import SimpleNamespace
        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2))
        >>> model[0].config = SimpleNamespace(use_cache=True)
        >>> [path for path, _ in cache_configs(model)]
        ['0.config']
    """
    found: list[tuple[str, Any]] = []
    seen: set[int] = set()
    for name, module in model.named_modules():
        config = getattr(module, "config", None)
        if not _looks_like_config(config):
            continue
        path = f"{name}.config" if name else "config"
        for where, cfg in [(path, config), *_nested_configs(config, path, 0)]:
            if id(cfg) not in seen:
                seen.add(id(cfg))
                found.append((where, cfg))
    return found


def is_hf_model(model: torch.nn.Module) -> bool:
    """Whether any module of ``model`` carries a config with a ``use_cache`` setting.

    Example:
        >>> is_hf_model(torch.nn.Linear(2, 2))
        False
    """
    return bool(cache_configs(model))


def turn_off_cache(model: torch.nn.Module) -> list[ConfigChange]:
    """Set ``use_cache = False`` on every config of ``model`` that has it on; return the changes.

    Example:
        >>> from types import SimpleNamespace
        >>> model = torch.nn.Linear(2, 2)
        >>> model.config = SimpleNamespace(use_cache=True)
        >>> [c.where for c in turn_off_cache(model)], model.config.use_cache
        (['config.use_cache'], False)
    """
    changes = []
    for path, config in cache_configs(model):
        before = getattr(config, "use_cache")
        if not before:  # False or None: forward() builds no cache
            continue
        own = "use_cache" in getattr(config, "__dict__", {})
        setattr(config, "use_cache", False)
        changes.append(ConfigChange(f"{path}.use_cache", before, False, target=config, own=own))
    return changes


def restore(changes: list[ConfigChange]) -> None:
    """Undo :func:`turn_off_cache`'s changes, last first.

    Example:
        >>> from types import SimpleNamespace
        >>> model = torch.nn.Linear(2, 2)
        >>> model.config = SimpleNamespace(use_cache=True)
        >>> restore(turn_off_cache(model)); model.config.use_cache
        True
    """
    for change in reversed(changes):
        if change.target is None:
            continue  # a keyword argument: the caller's dict was never changed
        if change.own:
            setattr(change.target, change.attribute, change.before)
        else:  # the value came from the class: drop the instance attribute turn_off_cache added
            with contextlib.suppress(AttributeError):
                delattr(change.target, change.attribute)


@contextlib.contextmanager
def training_config(model: torch.nn.Module) -> Iterator[list[ConfigChange]]:
    """Turn the KV cache off on every config of ``model`` for the ``with`` block, then restore it.

    Example:
        >>> with training_config(torch.nn.Linear(2, 2)) as changes:
        ...     changes
        []
    """
    changes = turn_off_cache(model)
    try:
        yield changes
    finally:
        restore(changes)


def training_kwargs(
    model: torch.nn.Module, kwargs: Mapping[str, Any] | None
) -> tuple[dict[str, Any], list[ConfigChange]]:
    """``kwargs`` with an explicit ``use_cache=True`` made False, for a Hugging Face model.

    Example:
        >>> from types import SimpleNamespace
        >>> model = torch.nn.Linear(2, 2)
        >>> model.config = SimpleNamespace(use_cache=True)
        >>> kwargs, changes = training_kwargs(model, {"use_cache": True})
        >>> kwargs, [str(c) for c in changes]
        ({'use_cache': False}, ["example_kwargs['use_cache']: True -> False"])
    """
    kwargs = dict(kwargs or {})
    if kwargs.get("use_cache") is True and is_hf_model(model):
        kwargs["use_cache"] = False
        return kwargs, [ConfigChange("example_kwargs['use_cache']", True, False)]
    return kwargs, []


def cache_note(changes: list[ConfigChange]) -> str | None:
    """The one line a plan's report shows for these changes, or None when there were none.

    Example:
        >>> cache_note([ConfigChange("config.use_cache", True, False)])  # doctest: +ELLIPSIS
        'use_cache turned off for tracing and training (Hugging Face KV cache): config.use_cache; ...'
        >>> cache_note([]) is None
        True
    """
    if not changes:
        return None
    where = ", ".join(dict.fromkeys(c.where for c in changes))  # in order, each once
    return (f"{CACHE_NOTE}: {where}; a cache only serves generation, and torch.export cannot return "
            "one; the settings on the model passed in are restored afterwards.")
