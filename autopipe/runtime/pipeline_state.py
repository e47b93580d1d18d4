"""A pipeline's state: state dicts, optimizer state and ``torch.distributed.checkpoint`` files."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch

from .data_parallel import full_tensor
from .distributed import raise_on_every_rank
from .model_state import full_state_dict
from .sharded_state import (load_model_state_dict, load_optimizer_state_dict, model_state_dict, optimizer_state_dict,
                            read_checkpoint, save_checkpoint)


class PipelineStateDicts:
    """The model's and the optimizer's state under the original model's names, as a Pipeline holds them."""

    # ------------------------------------------------------------------ state dicts
    def state_dict(self, *, full: bool = False) -> dict[str, torch.Tensor]:
        """The parameters and persistent buffers under the original model's names.

        Args:
            full: False: this rank's part, every key of the unsplit model's ``state_dict()``
                it holds (tied aliases included) and the tensors no stage reads - what
                ``torch.distributed.checkpoint`` saves and loads, resharding by name
                (:func:`~autopipe.runtime.sharded_state.model_state_dict`). True: the whole
                model, gathered to every rank on the CPU - load it with
                ``model.load_state_dict``. Collective: every rank must call it.

        Returns:
            ``{name: tensor}``; the local form holds detached views of the live tensors (a
            fused matrix's strided shard as a contiguous copy: give what ``dcp.load`` filled to
            :meth:`load_state_dict`), the full form CPU copies.

        Example:
            >>> dcp.save({"model": pipe.state_dict(), "optim": pipe.optimizer_state_dict(opt)},
            ...          checkpoint_id="ckpt/100")  # doctest: +SKIP
            >>> model.load_state_dict(pipe.state_dict(full=True))  # doctest: +SKIP
        """
        if not full:
            return model_state_dict(self._local)
        self._inputs.refuse_placeholders("gather the full state dict", rank=self.rank, world_size=self.world_size)
        local = {n: full_tensor(t.detach()) for n, t in self._state.items() if n in self._names.canonical}
        # Gathered from dp rank 0's replica only: the others hold the same model.
        return full_state_dict(local, self._unheld_state, self._names, self.world_size,
                               sends=self.dp_rank == 0 and self.tp_rank == 0)

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """``optimizer``'s state by parameter name, for ``torch.distributed.checkpoint``.

        The flattened form of torch's ``get_optimizer_state_dict`` (``state.<name>.exp_avg``,
        ``param_groups.<name>.lr``; :func:`~autopipe.runtime.sharded_state.optimizer_state_dict`),
        so the checkpoint reshards and the unsplit model resumes from it with torch's
        ``set_state_dict``. A fresh optimizer is given its state first. No communication.

        Example:
            >>> pipe.load_optimizer_state_dict(opt, pipe.optimizer_state_dict(opt))  # doctest: +SKIP
        """
        return optimizer_state_dict(self._local, optimizer)

    def load_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, state: Mapping[str, Any]) -> None:
        """Load :meth:`optimizer_state_dict`'s form into ``optimizer``; other ranks' entries are ignored.

        Raises:
            KeyError: entries missing or naming no parameter. ValueError: foreign parameters.
        """
        load_optimizer_state_dict(self._local, optimizer, state)

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor], *, strict: bool = True) -> None:
        """Copy values into this rank's tensors from a full or per-rank state dict, or a DCP load.

        Keys are the original model's names; any alias of a tied tensor will do. Each rank
        takes what it holds (and the tensors no stage reads) and ignores the rest, so the same
        full dict can be given to every rank. Non-persistent buffers (Llama's rotary
        ``inv_freq``) are never required: the model computes them. Collective: every rank
        checks its names and shapes before writing anything, and if one rank's dict does not
        fit, every rank raises.

        Args:
            state_dict: ``model.state_dict()`` of the unsplit model, ``pipe.state_dict(full=True)``,
                this rank's ``pipe.state_dict()``, or what ``dcp.load`` filled.
            strict: raise if a tensor of this rank is missing or a key is not a name of the model.

        Raises:
            KeyError: (strict) names missing or unknown, listed. ValueError: a shape differs.
            RuntimeError: on the other ranks, naming the rank whose dict did not fit.

        Example:
            >>> pipe.load_state_dict(torch.load("model.pt"))  # doctest: +SKIP
        """
        self._check_usable()
        error: Exception | None = None
        try:
            load_model_state_dict(self._local, state_dict, strict=strict)
        except Exception as e:  # noqa: BLE001 - raised below, on every rank
            error = e
        raise_on_every_rank(error, rank=self.rank, world_size=self.world_size, what="load the state dict")

    def save_checkpoint(self, checkpoint_id: str | os.PathLike, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Save the model (and ``optimizer``) as one ``torch.distributed.checkpoint`` directory.

        Every rank writes its own tensors (``{"model": state_dict(), "optim":
        optimizer_state_dict(optimizer)}``); any split, schedule or world size resumes from
        it with :meth:`load_checkpoint`, and the unsplit model with torch's ``set_state_dict``.
        Written beside ``checkpoint_id`` and moved there once every rank has written, so a failed
        save leaves the previous checkpoint whole (:mod:`~autopipe.runtime.checkpoint_files`). Collective.

        Raises:
            CheckpointError: a rank could not write its part (on every rank; the previous
                checkpoint stays). UnwrittenTensorsError: a meta tensor was never written.

        Example:
            >>> pipe.save_checkpoint("ckpt/100", opt)  # doctest: +SKIP
        """
        self._inputs.refuse_placeholders("save a checkpoint", rank=self.rank, world_size=self.world_size)
        save_checkpoint(self._local, checkpoint_id, optimizer)

    def load_checkpoint(self, checkpoint_id: str | os.PathLike, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Resume the model (and ``optimizer``) from a checkpoint of :meth:`save_checkpoint`.

        Before anything is read, every rank checks the checkpoint's list of tensors against
        the whole model: a name the model does not have (another model's checkpoint), a
        tensor it lacks or another shape is refused on every rank. Collective.

        Args:
            checkpoint_id: the checkpoint's directory.
            optimizer: an optimizer over :meth:`parameters` to resume too (a fresh one is fine).

        Raises:
            KeyError / ValueError: the checkpoint does not fit the model (named); on the other
                ranks a RuntimeError.
            CheckpointError: the checkpoint is incomplete or damaged (a shard missing or short,
                an unreadable ``.metadata``), or a rank could not read its part.

        Example:
            >>> opt = torch.optim.AdamW(pipe.parameters())  # doctest: +SKIP
            >>> pipe.load_checkpoint("ckpt/100", opt)  # doctest: +SKIP
        """
        state = read_checkpoint(self._local, checkpoint_id, optimizer)
        self.load_state_dict(state["model"])
        if optimizer is not None:
            self.load_optimizer_state_dict(optimizer, state["optim"])
