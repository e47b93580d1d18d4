"""A training layout: every choice a user makes for a Transformer on ``tp * pp * dp`` GPUs.

The degrees, batch sizes, schedule, checkpointing, sequence parallelism, data-parallel state
and precision; :mod:`.step` charges it, :mod:`.search` ranks them, :mod:`.exports` words one.

Example:
    >>> Layout(tp=8, pp=2, dp=4, micro_batch=1, global_batch=64).n_microbatches
    16
"""

from __future__ import annotations

from dataclasses import dataclass

from .._checks import check_choice, check_int
from .blocks import RECOMPUTE_MODES

LAYOUT_SCHEDULES = ("1F1B", "GPipe", "Interleaved1F1B")
DP_MODES = ("replicate", "zero1", "fsdp")


@dataclass(frozen=True)
class Layout:
    """Every choice of a training layout on ``tp * pp * dp`` GPUs.

    Args:
        tp, pp, dp: tensor-, pipeline- and data-parallel degrees.
        micro_batch: sequences per micro-batch.
        global_batch: sequences per step, over all data-parallel ranks.
        schedule: one of :data:`LAYOUT_SCHEDULES`.
        virtual_stages: stages per pipeline rank (Interleaved1F1B; 1 otherwise).
        recompute: checkpointed blocks' mode (:data:`~autopipe.layouts.blocks.RECOMPUTE_MODES`).
        recompute_layers: blocks per rank that checkpoint (``--recompute-num-layers``); None: all.
        sequence_parallel: norms and dropouts sharded along the sequence over tp.
        sp_regather: the backward gathers the column-parallel inputs again instead of keeping
            them whole (Megatron-LM does, overlapped with the input gradient's GEMM; torch's
            tensor-parallel API, which torchtitan and autopipe run, keeps them).
        dp_mode: ``"replicate"``, ``"zero1"`` (optimizer state sharded) or ``"fsdp"`` (all state).
        overlap_dp: the runtime overlaps gradient reduction with the backward.
        flash: a fused attention kernel (no ``seq x seq`` scores kept).
        float8: GEMMs of the blocks in float8.
        compiled: stages compiled (element-wise chains fused).
        async_tp: tensor-parallel collectives micro-pipelined with the GEMMs.

    Raises:
        ValueError: a degree or size that is not a positive integer, or an unknown choice.
    """

    tp: int = 1
    pp: int = 1
    dp: int = 1
    micro_batch: int = 1
    global_batch: int = 1
    schedule: str = "1F1B"
    virtual_stages: int = 1
    recompute: str = "none"
    recompute_layers: int | None = None
    sequence_parallel: bool = False
    sp_regather: bool = False
    dp_mode: str = "replicate"
    overlap_dp: bool = True
    flash: bool = True
    float8: bool = False
    compiled: bool = False
    async_tp: bool = False

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp", "micro_batch", "global_batch", "virtual_stages"):
            check_int(f"Layout {name}", getattr(self, name))
        check_choice("Layout schedule", self.schedule, LAYOUT_SCHEDULES)
        check_choice("Layout recompute", self.recompute, RECOMPUTE_MODES)
        check_choice("Layout dp_mode", self.dp_mode, DP_MODES)
        if self.recompute_layers is not None:
            check_int("Layout recompute_layers", self.recompute_layers, minimum=0)
        if self.virtual_stages > 1 and self.schedule != "Interleaved1F1B":
            raise ValueError(f"Layout virtual_stages={self.virtual_stages} needs schedule='Interleaved1F1B', "
                             f"not {self.schedule!r}")
        if self.global_batch % (self.dp * self.micro_batch):
            raise ValueError(f"Layout global_batch={self.global_batch} must divide by dp x micro_batch = "
                             f"{self.dp} x {self.micro_batch}")

    @property
    def n_gpus(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def n_microbatches(self) -> int:
        return self.global_batch // (self.dp * self.micro_batch)

    def blocks_per_rank(self, layers: int) -> int:
        """Blocks on the fullest pipeline rank: ``virtual_stages`` stages of ``ceil(layers / (pp *
        virtual_stages))`` blocks each."""
        return -(-layers // (self.pp * self.virtual_stages)) * self.virtual_stages

    def describe(self) -> str:
        """One line: ``tp 8 x pp 2 x dp 4, micro-batch 1 x 64, 1F1B, full AC``."""
        parts = [f"tp {self.tp} x pp {self.pp} x dp {self.dp}" + (f" ({self.dp_mode})" if self.dp > 1 else ""),
                 f"micro-batch {self.micro_batch} x {self.n_microbatches}",
                 self.schedule + (f" v{self.virtual_stages}" if self.virtual_stages > 1 else "")]
        if self.recompute != "none" and self.recompute_layers != 0:
            some = "" if self.recompute_layers is None else f" on {self.recompute_layers} blocks/rank"
            parts.append(f"{self.recompute} AC{some}")
        sp = "SP, regathered" if self.sp_regather else "SP"
        parts += [flag for flag, on in ((sp, self.sequence_parallel), ("fp8", self.float8),
                                        ("compiled", self.compiled), ("async TP", self.async_tp)) if on]
        return ", ".join(parts)
