"""Load the model a command line names: ``file.py:factory``, ``package.module:factory`` or a
Hugging Face config.

Example:
    >>> from autopipe.cli.modelspec import load_model_spec
    >>> loaded = load_model_spec("autopipe.models:seed_transformer",
    ...                          options={"vocab_size": 100, "num_layers": 1, "seq_len": 8})
    >>> type(loaded.model).__name__, tuple(loaded.example_args[0].shape)
    ('SeedTransformer', (4, 8))
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import AutopipeError
from ..layouts.shapes import NAMED_SHAPES

#: Options of a Hugging Face spec that shape the example input rather than the config.
HF_INPUT_OPTIONS = ("batch", "seq_len", "seed")

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_DOTTED = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")

_FORMS = (
    "use path/to/file.py:factory, package.module:factory or a Hugging Face config folder / model type"
)


class ModelSpecError(AutopipeError, ValueError):
    """A MODEL spec that cannot be turned into a model and its example inputs."""


@dataclass
class LoadedModel:
    """A model built from a MODEL spec, with one micro-batch of example inputs."""

    model: Any  # torch.nn.Module
    example_args: tuple[Any, ...] | None  # None when the model carries its own inputs
    example_kwargs: dict[str, Any] | None
    spec: str  # the spec as given
    source: str  # where it came from, in words ("factory make in net.py")
    options: dict[str, Any] = field(default_factory=dict)  # what was passed to the factory/config


def parse_option_value(text: str) -> Any:
    """A ``--set KEY=VALUE`` value as Python: JSON when it parses (``4``, ``0.1``, ``true``,
    ``[1, 2]``), else the string itself.

    Example:
        >>> parse_option_value("4"), parse_option_value("true"), parse_option_value("sdpa")
        (4, True, 'sdpa')
    """
    try:
        return json.loads(text)
    except ValueError:
        return text


def load_model_spec(spec: str, *, options: Mapping[str, Any] | None = None) -> LoadedModel:
    """Build the model a MODEL spec names, with its example inputs.

    Example:
        >>> loaded = load_model_spec("autopipe.models:seed_transformer", options={"num_layers": 1})
        >>> loaded.source
        'factory seed_transformer in autopipe.models'
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ModelSpecError(f"MODEL={spec!r} is empty; {_FORMS}")
    options = dict(options or {})
    for key in options:
        if not isinstance(key, str) or not _IDENTIFIER.fullmatch(key):
            raise ModelSpecError(f"option name {key!r} is not a Python identifier (expected KEY=VALUE)")
    spec = spec.strip()
    where, sep, factory_name = spec.rpartition(":")
    # "C:\\model.py" has a colon too, but no factory after it: treat as a path without one.
    if sep and factory_name and not re.fullmatch(r"[\\/].*", factory_name):
        if where.endswith(".py") or os.sep in where or "/" in where:
            module = _import_file(spec, where)
            return _call_factory(spec, module, factory_name, options, where)
        if _DOTTED.fullmatch(where):
            module = _import_module(spec, where)
            return _call_factory(spec, module, factory_name, options, where)
        raise ModelSpecError(f"MODEL={spec!r}: {where!r} is neither a .py file nor a module name; {_FORMS}")
    if spec.endswith(".py"):
        raise ModelSpecError(
            f"MODEL={spec!r} names a file but no factory; write {spec}:FACTORY, where FACTORY "
            "returns (model, example_args)"
        )
    if sep:  # "module:" with nothing after the colon
        raise ModelSpecError(f"MODEL={spec!r} has no factory name after ':'; {_FORMS}")
    return _load_hugging_face(spec, options)


# --------------------------------------------------------------------------- imports


def _import_file(spec: str, path_text: str) -> Any:
    path = Path(path_text).expanduser()
    if not path.is_file():
        raise ModelSpecError(f"MODEL={spec!r}: file {path_text!r} does not exist")
    folder = str(path.resolve().parent)
    if folder not in sys.path:
        # Appended, not prepended: the file can import the modules beside it, but a file
        # there named like an installed module (a stray networkx.py) cannot replace the
        # module autopipe or torch imports later.
        sys.path.append(folder)
    module_name = f"_autopipe_model_{abs(hash(str(path.resolve())))}"
    loader_spec = importlib.util.spec_from_file_location(module_name, path)
    if loader_spec is None or loader_spec.loader is None:
        raise ModelSpecError(f"MODEL={spec!r}: {path_text!r} cannot be loaded as a Python file")
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[module_name] = module  # dataclasses and pickling look modules up by name
    try:
        loader_spec.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001 - any error in user code becomes one line
        del sys.modules[module_name]
        raise ModelSpecError(f"MODEL={spec!r}: running {path_text} raised {_one_line(e)}") from e
    return module


def _import_module(spec: str, module_name: str) -> Any:
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m` would: modules in the current folder
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and module_name.startswith(e.name):
            raise ModelSpecError(
                f"MODEL={spec!r}: no module named {e.name!r} (not installed and not in "
                f"{os.getcwd()}); for a file write path/to/file.py:factory"
            ) from e
        raise ModelSpecError(f"MODEL={spec!r}: importing {module_name} raised {_one_line(e)}") from e
    except Exception as e:  # noqa: BLE001
        raise ModelSpecError(f"MODEL={spec!r}: importing {module_name} raised {_one_line(e)}") from e


# --------------------------------------------------------------------------- factories


def _call_factory(spec: str, module: Any, name: str, options: dict[str, Any], where: str) -> LoadedModel:
    if not _IDENTIFIER.fullmatch(name):
        raise ModelSpecError(f"MODEL={spec!r}: factory name {name!r} is not a Python identifier")
    factory = getattr(module, name, None)
    if factory is None:
        functions = sorted(k for k, v in vars(module).items() if inspect.isfunction(v) and not k.startswith("_"))
        if len(functions) > 8:
            functions = functions[:8] + ["..."]
        hint = f"functions there: {', '.join(functions)}" if functions else "it defines no functions"
        raise ModelSpecError(f"MODEL={spec!r}: {where} has no factory {name!r}; {hint}")
    if not callable(factory):
        raise ModelSpecError(f"MODEL={spec!r}: {name} is a {type(factory).__name__}, not a function returning a model")
    try:  # the names are checked against the signature: an error from inside is about a value
        inspect.signature(factory).bind(**options)
    except TypeError as e:
        raise ModelSpecError(f"MODEL={spec!r}: {name}() does not accept the options {options}: {e}") from e
    except ValueError:  # no signature to read (a builtin): the call says
        pass
    try:
        result = factory(**options)
    except Exception as e:  # noqa: BLE001
        given = f" with --set {options}" if options else ""
        raise ModelSpecError(f"MODEL={spec!r}: calling {name}(){given} raised {_one_line(e)}"
                             + ("; check the values given with --set" if options else "")) from e
    return _check_result(spec, f"{name}()", result, f"factory {name} in {where}", options)


def _check_result(spec: str, what: str, result: Any, source: str, options: dict[str, Any]) -> LoadedModel:
    import torch

    expected = "(model, example_args) or (model, example_args, example_kwargs) with model a torch.nn.Module"
    if isinstance(result, torch.nn.Module):
        model, args, kwargs = result, None, None
    elif isinstance(result, (tuple, list)) and len(result) in (2, 3):
        model, args = result[0], result[1]
        kwargs = result[2] if len(result) == 3 else None
    else:
        got = f"a {len(result)}-tuple" if isinstance(result, (tuple, list)) else type(result).__name__
        raise ModelSpecError(f"MODEL={spec!r}: {what} returned {got}; expected {expected}")
    if not isinstance(model, torch.nn.Module):
        raise ModelSpecError(
            f"MODEL={spec!r}: {what} returned a {type(model).__name__} where the model should be; expected {expected}"
        )
    if args is not None and not isinstance(args, tuple):
        # A bare tensor or a list is one micro-batch of positional inputs, as in pipeline().
        args = tuple(args) if isinstance(args, list) else (args,)
    if kwargs is not None and not isinstance(kwargs, Mapping):
        raise ModelSpecError(
            f"MODEL={spec!r}: {what} returned example_kwargs of type {type(kwargs).__name__}; expected a dict"
        )
    return LoadedModel(model, args, dict(kwargs) if kwargs is not None else None, spec, source, options)


# --------------------------------------------------------------------------- Hugging Face


def _load_hugging_face(spec: str, options: dict[str, Any]) -> LoadedModel:
    input_opts = {k: options.pop(k) for k in HF_INPUT_OPTIONS if k in options}
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise ModelSpecError(
            f"MODEL={spec!r} is not a file or module, and transformers is not installed "
            f"to read it as a Hugging Face config; {_FORMS}"
        ) from None
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    path = Path(spec).expanduser()
    try:
        if path.is_dir() or (path.is_file() and path.suffix == ".json"):
            if path.is_dir() and not (path / "config.json").is_file():
                raise ModelSpecError(f"MODEL={spec!r}: folder {spec!r} has no config.json")
            config = AutoConfig.from_pretrained(str(path), **options)
            source = f"Hugging Face config {path}"
        elif spec in CONFIG_MAPPING:
            config = AutoConfig.for_model(spec, **options)
            source = f"Hugging Face model type {spec!r} (default config)"
        elif "/" in spec or _DOTTED.fullmatch(spec.replace("-", "_")):
            source = f"Hugging Face config {spec!r} (local cache)"
            try:  # a hub id: only from the local cache; autopipe never downloads anything
                config = AutoConfig.from_pretrained(spec, local_files_only=True, **options)
            except OSError:
                if spec.lower() in NAMED_SHAPES:
                    raise ModelSpecError(
                        f"MODEL={spec!r} is a named shape, which has no weights to profile; its layout on a "
                        f"cluster: autopipe layout {spec} --gpus N --global-batch B") from None
                raise ModelSpecError(
                    f"MODEL={spec!r} is no file, module or Hugging Face model type, and no "
                    f"Hugging Face config {spec!r} is in the local cache (autopipe never downloads); {_FORMS}"
                ) from None
        else:
            raise ModelSpecError(f"MODEL={spec!r} has no known form; {_FORMS}")
    except ModelSpecError:
        raise
    except (OSError, ValueError, KeyError) as e:
        raise ModelSpecError(
            f"MODEL={spec!r} is not a file:factory or module:factory, and reading it as a "
            f"Hugging Face config failed ({_one_line(e)}); {_FORMS}"
        ) from e
    model = _hf_model_from_config(spec, config)
    model.train()
    batch, seq_len, seed = int(input_opts.get("batch", 2)), int(input_opts.get("seq_len", 32)), int(input_opts.get("seed", 0))
    import torch

    vocab = int(getattr(config, "vocab_size", 0) or 0)
    if vocab < 1:
        raise ModelSpecError(f"MODEL={spec!r}: config has no vocab_size; autopipe builds token-id inputs for it")
    ids = torch.randint(0, vocab, (batch, seq_len), generator=torch.Generator().manual_seed(seed))
    return LoadedModel(model, (ids,), None, spec, source, {**options, **input_opts})


def _hf_model_from_config(spec: str, config: Any) -> Any:
    """A randomly initialised causal LM for ``config`` whose forward maps token ids to logits."""
    import torch

    model_type = getattr(config, "model_type", "")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        import transformers
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        base = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type, ""), None)
        if base is None:
            raise ModelSpecError(
                f"MODEL={spec!r}: model type {model_type!r} has no causal-LM class in transformers; "
                "write a factory (file.py:factory) that builds the model and its inputs"
            )
        cls = type(f"{base.__name__}Logits", (_CausalLMLogits, base), {})
        return cls(config)


class _CausalLMLogits:
    """Mixin: ``forward(input_ids) -> logits``, no cache, so the output is one tensor to split on."""

    def forward(self, input_ids: Any) -> Any:  # noqa: D401
        return super().forward(input_ids=input_ids, use_cache=False, return_dict=True).logits  # type: ignore[misc]


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    if len(text) > 400:
        text = text[:397] + "..."
    return f"{type(e).__name__}: {text}" if text else type(e).__name__
