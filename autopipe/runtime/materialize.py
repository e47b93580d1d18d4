"""Giving a model built on the meta device real tensors: this rank's only, initialized or loaded."""

from __future__ import annotations

import copy
import os
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Union

import torch
import torch.nn as nn

from .._checks import listed
from .params import StateNames, set_tensor, used_attribute_names
from .checkpoint_files import checkpoint_errors

#: What ``weights=`` accepts: a state dict, or the path of a ``.safetensors`` file or a DCP directory.
WeightSource = Union[Mapping[str, torch.Tensor], str, os.PathLike]


class UnwrittenTensorsError(RuntimeError):
    """Tensors of a meta-device model that neither the init nor the weights gave a value."""


def on_meta(model: nn.Module) -> bool:
    """Whether ``model`` holds any parameter or buffer on the meta device.

    Example:
        >>> with torch.device("meta"):
        ...     lin = nn.Linear(2, 2)
        >>> on_meta(lin), on_meta(nn.Linear(2, 2))
        (True, False)
    """
    return any(t.is_meta for t in (*model.parameters(), *model.buffers()))


def to_meta(value: Any) -> Any:
    """``value`` with every tensor in it replaced by a meta tensor of the same shape and dtype.

    Example:
        >>> to_meta(({"x": torch.ones(2, 3)}, 4))[0]["x"].device.type
        'meta'
    """
    from torch.utils._pytree import tree_map

    return tree_map(lambda t: torch.empty(t.shape, dtype=t.dtype, device="meta")
                    if isinstance(t, torch.Tensor) else t, value)


def check_weight_arguments(model: nn.Module, init_weights: Any, weights: Any) -> None:
    """Check ``Pipeline(weights=)`` before any work: ``init_weights`` when it is a function, else ``weights``.

    Example:
        >>> check_weight_arguments(nn.Linear(2, 2), None, {"weight": torch.ones(2, 2)})
        >>> check_weight_arguments(nn.Linear(2, 2), print, None)
        Traceback (most recent call last):
        ...
        ValueError: weights=<built-in function print> initializes a model built on the meta device, but this model holds values already; initialize it yourself before building the Pipeline, or build it under `with torch.device("meta"):`
    """
    if init_weights is not None:
        if not callable(init_weights):
            raise TypeError(f"weights={init_weights!r} as an init function must be callable as init(model), "
                            f"initializing the model's parameters and buffers in place")
        if not on_meta(model):
            raise ValueError(f"weights={init_weights!r} initializes a model built on the meta device, but "
                             f"this model holds values already; initialize it yourself before building the "
                             f"Pipeline, or build it under `with torch.device(\"meta\"):`")
    if weights is None or isinstance(weights, Mapping):
        return
    if not isinstance(weights, (str, os.PathLike)):
        raise TypeError(f"weights must be a state dict (name -> tensor), the path of a .safetensors file or of "
                        f"a torch.distributed.checkpoint directory, a function init(model), or None; got "
                        f"{type(weights).__name__}")
    if not os.path.exists(weights):
        raise FileNotFoundError(f"weights={os.fspath(weights)!r}: no such file or directory (a .safetensors "
                                f"file or a torch.distributed.checkpoint directory)")


def module_seed(name: str, base: int = 0) -> int:
    """The random seed the default init uses for the submodule ``name``: the same on every rank.

    Example:
        >>> module_seed("layers.0.attention") == module_seed("layers.0.attention"), module_seed("") >= 0
        (True, True)
    """
    return (zlib.crc32(name.encode()) + base) % (2 ** 63)


@torch.no_grad()
def fill_sentinel(tensors: Iterable[torch.Tensor]) -> None:
    """Fill each tensor with the value :func:`unwritten` looks for: NaN, or an integer type's smallest value.

    Example:
        >>> t, i = torch.zeros(2), torch.zeros(2, dtype=torch.long)
        >>> fill_sentinel([t, i]); t.isnan().all().item(), (i == torch.iinfo(torch.long).min).all().item()
        (True, True)
    """
    for t in tensors:
        if t.is_floating_point() or t.is_complex():
            t.fill_(float("nan"))
        elif t.dtype != torch.bool:
            t.fill_(torch.iinfo(t.dtype).min)


@torch.no_grad()
def unwritten(tensors: Mapping[str, torch.Tensor]) -> list[str]:
    """The names of tensors that still hold a sentinel of :func:`fill_sentinel` somewhere.

    Example:
        >>> t = torch.zeros(3); fill_sentinel([t]); t[:2] = 1.0
        >>> unwritten({"a": t, "b": torch.ones(2)})
        ['a']
    """
    found = []
    for name, t in tensors.items():
        if t.is_floating_point() or t.is_complex():
            bad = bool(torch.isnan(t).any())
        elif t.dtype != torch.bool:
            bad = bool((t == torch.iinfo(t.dtype).min).any())
        else:
            bad = False
        if bad:
            found.append(name)
    return sorted(found)


def _own_tensors(module: nn.Module) -> list[torch.Tensor]:
    return [t for t in (*module._parameters.values(), *module._buffers.values()) if t is not None]


@torch.no_grad()
def default_init(model: nn.Module, real: Iterable[torch.Tensor] | None = None, *, seed: int = 0) -> list[str]:
    """Initialize ``model``'s submodules the way their own code does, each under its own seed.

    Example:
        >>> a, b = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), nn.Sequential(nn.Linear(2, 2))
        >>> default_init(a), default_init(b)
        (['0', '1'], ['0'])
        >>> torch.equal(a[0].weight, b[0].weight)
        True
    """
    real_ids = {id(t) for t in (real if real is not None else
                                (t for t in (*model.parameters(), *model.buffers()) if not t.is_meta))}
    hf_init = getattr(model, "_init_weights", None) if _is_hf_model(model) else None
    devices = sorted({t.device.index or 0 for t in (*model.parameters(), *model.buffers()) if t.device.type == "cuda"})
    done = []
    for name, module in model.named_modules():
        if not any(id(t) in real_ids for t in _own_tensors(module)):
            continue
        reset = getattr(module, "reset_parameters", None)
        if hf_init is None and not callable(reset):
            continue  # a submodule with no init of its own: unwritten() reports its tensors
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(module_seed(name, seed))
            if hf_init is not None:
                hf_init(module)
            # A submodule Hugging Face's init does not know (a model's own class) keeps its own init.
            own = {str(i): t for i, t in enumerate(_own_tensors(module)) if id(t) in real_ids}
            if callable(reset) and (hf_init is None or unwritten(own)):
                reset()
        done.append(name)
    return done


def _is_hf_model(model: nn.Module) -> bool:
    return any(c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers")
               for c in type(model).__mro__)


def _materialize_in(model: nn.Module, names: StateNames, canonical: Iterable[str],
                    device_of: Callable[[str], torch.device]) -> dict[str, torch.Tensor]:
    """Replace the meta tensors ``canonical`` of ``model`` by empty real ones, every alias pointing at one."""
    made: dict[str, torch.Tensor] = {}
    for canon in canonical:
        old = model.get_parameter(canon) if canon in names.parameter_names else model.get_buffer(canon)
        new = torch.empty(old.shape, dtype=old.dtype, device=device_of(canon))
        if isinstance(old, nn.Parameter):
            new = nn.Parameter(new, requires_grad=old.requires_grad)
        for alias in names.aliases.get(canon, [canon]):
            set_tensor(model, alias, new)
        made[canon] = new
    return made


def _canonical_of(model: nn.Module, names: StateNames) -> dict[int, str]:
    out: dict[int, str] = {}
    for named in (model.named_parameters(remove_duplicate=False), model.named_buffers(remove_duplicate=False)):
        for name, t in named:
            out.setdefault(id(t), names.canonical.get(name, name))
    return out


def read_weights(source: WeightSource, wanted: Mapping[str, Sequence[str]],
                 into: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Read only the tensors ``wanted`` from a state dict, a ``.safetensors`` file or a DCP directory.

    Example:
        >>> read_weights({"b.weight": torch.ones(1)}, {"a.weight": ["a.weight", "b.weight"]})
        {'a.weight': tensor([1.])}
    """
    if isinstance(source, Mapping):
        found = {c: next((k for k in keys if k in source), None) for c, keys in wanted.items()}
        return {c: source[k] for c, k in found.items() if k is not None}
    path = Path(source)
    if path.is_dir():
        return _read_dcp(path, wanted, into or {})
    if path.suffix == ".safetensors":
        return _read_safetensors(path, wanted)
    raise ValueError(f"weights={os.fspath(source)!r} is neither a .safetensors file nor a "
                     f"torch.distributed.checkpoint directory")


def _read_safetensors(path: Path, wanted: Mapping[str, Sequence[str]]) -> dict[str, torch.Tensor]:
    try:
        from safetensors import safe_open
    except ImportError as e:
        raise ImportError(f"weights={os.fspath(path)!r} is a .safetensors file, which needs the safetensors "
                          f"package: pip install safetensors") from e
    out: dict[str, torch.Tensor] = {}
    with safe_open(os.fspath(path), framework="pt", device="cpu") as f:
        keys = set(f.keys())
        for canon, names in wanted.items():
            key = next((k for k in names if k in keys), None)
            if key is not None:
                out[canon] = f.get_tensor(key)
    return out


def _read_dcp(path: Path, wanted: Mapping[str, Sequence[str]],
              into: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(os.fspath(path))
    stored = read_dcp_metadata(path, "weights").state_dict_metadata
    request: dict[str, torch.Tensor] = {}
    key_of: dict[str, str] = {}
    for canon, names in wanted.items():
        key = next((k for k in names if isinstance(stored.get(k), TensorStorageMetadata)), None)
        if key is not None:
            meta = stored[key]
            target = into.get(canon)
            if target is not None and tuple(target.shape) == tuple(meta.size) and target.dtype == meta.properties.dtype:
                request[key] = target.detach()
            else:
                request[key] = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
            key_of[canon] = key
    if request:
        # no_dist: each rank reads its own keys on its own, with no collective among the ranks.
        with checkpoint_errors(f"read weights from {os.fspath(path)!r}"):
            dcp.load(request, storage_reader=reader, no_dist=True)
    return {canon: request[key] for canon, key in key_of.items()}


def read_dcp_metadata(path: str | os.PathLike, argument: str) -> Any:
    """The ``Metadata`` of a ``torch.distributed.checkpoint`` directory; a ValueError naming ``argument`` if unreadable."""
    import torch.distributed.checkpoint as dcp

    try:
        return dcp.FileSystemReader(os.fspath(path)).read_metadata()
    except FileNotFoundError as e:
        raise ValueError(f"{argument}={os.fspath(path)!r} is a directory but no torch.distributed.checkpoint "
                         f"(no .metadata file): {e}") from e
    except Exception as e:  # noqa: BLE001 - unpickling a damaged file raises many kinds
        raise ValueError(f"{argument}={os.fspath(path)!r}: the checkpoint's .metadata cannot be read "
                         f"({type(e).__name__}: {e}); the checkpoint is incomplete or damaged (was its writing "
                         f"cut short?)") from e


def stored_shapes(source: WeightSource) -> dict[str, tuple[int, ...]]:
    """Every tensor name in a state dict, ``.safetensors`` file or DCP directory, with its shape; no value is read.

    Example:
        >>> stored_shapes({"w": torch.ones(2, 3)})
        {'w': (2, 3)}
    """
    if isinstance(source, Mapping):
        return {k: tuple(v.shape) if isinstance(v, torch.Tensor) else () for k, v in source.items()}
    path = Path(source)
    if path.is_dir():
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        stored = read_dcp_metadata(path, "weights").state_dict_metadata
        return {k: tuple(m.size) for k, m in stored.items() if isinstance(m, TensorStorageMetadata)}
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(os.fspath(path), framework="pt", device="cpu") as f:
            return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    raise ValueError(f"weights={os.fspath(source)!r} is neither a .safetensors file nor a "
                     f"torch.distributed.checkpoint directory")


def check_state_fits(stored: Mapping[str, tuple[int, ...]], names: StateNames, what: str) -> None:
    """Raise unless ``stored`` (name -> shape) holds exactly the model's saved tensors, shaped as the model's.

    Example:
        >>> from autopipe.runtime.params import model_state_names
        >>> lin = nn.Linear(2, 2)
        >>> check_state_fits({"weight": (2, 2), "bias": (2,), "extra": (1,)}, model_state_names(lin), "w")
        Traceback (most recent call last):
        ...
        KeyError: "w does not fit the model: names the model does not have ['extra'] (another model's checkpoint?)"
    """
    unknown = sorted(k for k in stored if k not in names.canonical)
    held = {names.canonical[k] for k in stored if k in names.canonical}
    missing = [c for c in names.saved if c not in held]
    problems = []
    if unknown:
        problems.append(f"names the model does not have {listed(unknown)} (another model's checkpoint?)")
    if missing:
        problems.append(f"missing names {listed(missing)}")
    if problems:
        raise KeyError(f"{what} does not fit the model: {'; '.join(problems)}")
    for key, shape in stored.items():
        expected = names.shapes.get(key, names.shapes.get(names.canonical[key]))
        if expected is not None and tuple(shape) != tuple(expected):
            raise ValueError(f"{key!r} has shape {tuple(shape)} in {what} but {tuple(expected)} in the model")


@torch.no_grad()
def materialize_rank(model: nn.Module, names: StateNames, local: Iterable[str], *, device: torch.device,
                     extra: Iterable[str] = (), init_weights: Callable[[nn.Module], Any] | None = None,
                     weights: WeightSource | None = None, unwritten_out: dict[str, torch.Tensor] | None = None
                     ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Real, initialized or loaded tensors for this rank's canonical names of a meta-device ``model``."""
    local, extra = list(local), [c for c in extra if c not in set(local)]
    work = copy.deepcopy(model)
    made = _materialize_in(work, names, [*local, *extra],
                           lambda c, loc=set(local): device if c in loc else torch.device("cpu"))
    persistent = set(names.saved)
    fill_sentinel(made.values())
    if init_weights is not None:
        init_weights(work)
    else:
        targets = [t for c, t in made.items() if weights is None or c not in persistent]
        if targets:
            default_init(work, targets)
    loaded: set[str] = set()
    if weights is not None:
        loaded = load_weights(made, names, weights)
    # A tensor read from weights= is written, whatever its value (NaN included).
    left = {c: t for c, t in made.items() if c not in loaded}
    if unwritten_out is not None:
        unwritten_out.update(left)
    else:
        check_written(left)
    return {c: made[c] for c in local}, {c: made[c] for c in extra}


def check_written(tensors: Mapping[str, torch.Tensor], before: str = "the first step") -> None:
    """Raise :class:`UnwrittenTensorsError` if some of ``tensors`` still hold :func:`fill_sentinel`'s value
    (``before``: what they must be written before).

    Example:
        >>> check_written({"w": torch.ones(2)})
    """
    missing = unwritten(tensors)
    if missing:
        raise UnwrittenTensorsError(
            f"{len(missing)} tensors of this rank were left without a value after materializing the meta-device "
            f"model: {listed(missing, most=20)}. The default init runs each submodule's reset_parameters() (or "
            f"Hugging Face's _init_weights), and no such init wrote these: give weights= (a function init(model) "
            f"that initializes the model in place, a state dict, a .safetensors file or a "
            f"torch.distributed.checkpoint directory), or load them (load_state_dict, load_checkpoint) before "
            f"{before}")


@torch.no_grad()
def load_weights(targets: Mapping[str, torch.Tensor], names: StateNames, weights: WeightSource) -> set[str]:
    """Copy into ``targets`` (canonical name -> tensor) their values from ``weights``, reading only their keys.

    Example:
        >>> from autopipe.runtime.params import model_state_names
        >>> lin = nn.Linear(2, 2); targets = dict(lin.named_parameters())
        >>> sorted(load_weights(targets, model_state_names(lin), {"weight": torch.ones(2, 2), "bias": torch.zeros(2)}))
        ['bias', 'weight']
        >>> lin.weight.sum().item()
        4.0
    """
    persistent = set(names.saved)
    wanted = {c: names.aliases.get(c, [c]) for c in targets if c in persistent}
    found = read_weights(weights, wanted, into=targets)
    missing = sorted(c for c in wanted if c not in found)
    if missing:
        raise KeyError(f"weights={describe_weights(weights)} lacks {len(missing)} tensors this rank holds: "
                       f"{missing[:20]}{' ...' if len(missing) > 20 else ''} (keys are the unsplit model's "
                       f"state_dict() names; any alias of a tied tensor will do)")
    for canon, value in found.items():
        target = targets[canon]
        if value.data_ptr() == target.data_ptr() and value.device == target.device:
            continue  # read in place
        if tuple(value.shape) != tuple(target.shape):
            raise ValueError(f"{canon!r} has shape {tuple(value.shape)} in weights={describe_weights(weights)} but "
                             f"{tuple(target.shape)} in the model")
        target.copy_(value)
    return set(found)


def describe_weights(weights: WeightSource) -> str:
    """``weights=`` in a message: a path as given, a state dict by its size."""
    return f"<state dict of {len(weights)} tensors>" if isinstance(weights, Mapping) else repr(os.fspath(weights))


def materialize_leftovers(module: nn.Module, used: set[str]) -> list[str]:
    """Replace the meta tensors a stage module holds but never reads with placeholders that take no memory.

    Example:
        >>> with torch.device("meta"):
        ...     lin = nn.Linear(2, 2)
        >>> materialize_leftovers(lin, set()), lin.weight.device.type
        (['weight', 'bias'], 'cpu')
    """
    replaced, read = [], []
    for named in (module.named_parameters(remove_duplicate=False), module.named_buffers(remove_duplicate=False)):
        for name, t in list(named):
            if not t.is_meta:
                continue
            if name in used:
                read.append(name)
                continue
            # A zero-stride view of one element: the right shape, no memory.
            placeholder = torch.zeros((), dtype=t.dtype).expand(t.shape)
            if isinstance(t, nn.Parameter):
                placeholder = nn.Parameter(placeholder, requires_grad=False)
            set_tensor(module, name, placeholder)
            replaced.append(name)
    if read:
        raise UnwrittenTensorsError(
            f"a stage reads tensors that are still on the meta device and are no parameter or buffer of the "
            f"original model (constants made while tracing): {sorted(read)}; build this model on a real device")
    return replaced


def meta_twin(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers are on the meta device: its structure, no memory.

    Example:
        >>> twin = meta_twin(nn.Linear(2, 2))
        >>> twin.weight.device.type, isinstance(twin.weight, nn.Parameter)
        ('meta', True)
    """
    memo: dict[int, Any] = {}
    for t in (*model.parameters(), *model.buffers()):  # a tied tensor once: the twin ties it too
        meta = torch.empty_like(t, device="meta")
        memo[id(t)] = nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else meta
    return copy.deepcopy(model, memo)


def take_constants(module: nn.Module, like: nn.Module) -> list[str]:
    """Give the meta tensors ``module``'s code reads the values ``like`` holds under the same names.

    A stage traced again from a meta twin (:mod:`~autopipe.runtime.shapes`) holds meta copies
    of what is no parameter of the model (constants made while tracing); the stage first
    traced holds their values.

    Example:
        >>> m = torch.fx.symbolic_trace(nn.Linear(2, 2)); m.weight = nn.Parameter(m.weight.to("meta"))
        >>> take_constants(m, nn.Linear(2, 2)), m.weight.device.type
        (['weight'], 'cpu')
    """
    taken = []
    for name in sorted(used_attribute_names(module)):
        prefix, _, leaf = name.rpartition(".")
        try:
            parent = module.get_submodule(prefix) if prefix else module
            mine = getattr(parent, leaf)
            theirs = like.get_submodule(prefix) if prefix else like
            value = getattr(theirs, leaf)
        except AttributeError:
            continue
        if not (isinstance(mine, torch.Tensor) and mine.is_meta and isinstance(value, torch.Tensor)
                and value.shape == mine.shape and value.dtype == mine.dtype and not value.is_meta):
            continue
        if leaf in parent._parameters or leaf in parent._buffers:
            set_tensor(parent, leaf, value)
        else:
            setattr(parent, leaf, value)
        taken.append(name)
    return taken
