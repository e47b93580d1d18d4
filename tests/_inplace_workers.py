"""A small CNN written like torchvision's ResNet, and what each rank runs to split it at in-place ops.

The model writes into its activations the way stock CNNs do: ``nn.ReLU(inplace=True)``,
``out += identity``, and a write through a view (``x[:, :1].mul_``). The split points in
:data:`CASES` each make a stage write into a leaf it received. The workers take ``(rank, world_size, ...)`` (spawned by
tests/_dist_utils.run_world) and return plain data; the unsplit model, run micro-batch by
micro-batch in the same process (batch norm normalises each micro-batch on its own in a
pipeline), is the reference.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from autopipe.runtime import Pipeline

from _runtime_workers import against_reference
from autopipe import PlannerOptions

MICROBATCH = 2
N_MICROBATCHES = 4
CLASSES = 5


class BasicBlock(nn.Module):
    """torchvision's BasicBlock: the shortcut is added into the branch in place, one ReLU module used twice."""

    def __init__(self, c_in: int, c_out: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.downsample = None
        if stride != 1 or c_in != c_out:
            self.downsample = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False),
                                            nn.BatchNorm2d(c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.downsample is not None:
            identity = self.downsample(x)  # a cut here leaves bn2's output to be written by +=
        out += identity
        return self.relu(out)


class Merge(nn.Module):
    """Adds a shortcut into a branch in place, then an in-place ReLU: its first op is ``+=``."""

    def forward(self, out: torch.Tensor, identity: torch.Tensor) -> torch.Tensor:
        out += identity
        return torch.relu_(out)


class Gate(nn.Module):
    """Halves the first channel through a view of its input, in place."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x[:, :1].mul_(0.5)
        return x


class Branch(nn.Module):
    """A convolution whose output :class:`Gate` writes through a view, then :class:`Merge` adds the shortcut into."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1)
        self.gate = Gate()
        self.merge = Merge()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.merge(self.gate(self.conv(x)), x)


class SmallResNet(nn.Module):
    """Stem (conv, batch norm, in-place ReLU), two BasicBlocks, a :class:`Branch` and a linear head."""

    def __init__(self, width: int = 4) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.layer1 = BasicBlock(width, width)
        self.layer2 = BasicBlock(width, 2 * width, stride=2)
        self.branch = Branch(2 * width)
        self.fc = nn.Linear(2 * width, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.layer2(self.layer1(x))
        return self.fc(self.branch(x).mean((2, 3)))


#: ``(schedule, stages_per_rank, split points)`` run on 2 ranks, against the unsplit model.
#: Each cut puts an in-place write into what a stage receives: the stem's in-place ReLU
#: first; ``+=`` first (``branch.merge``); a write through a view first (``branch.gate``);
#: ``+=`` into bn2's output a few ops after a cut before the downsample, as in torchvision's
#: BasicBlock. Every such write sits in a child module of the stage.
CASES = (
    ("1F1B", 1, ("relu",)),
    ("1F1B", 1, ("branch.merge",)),
    ("1F1B", 1, ("branch.gate",)),
    ("GPipe", 1, ("layer2.downsample",)),
    ("ZBVZeroBubble", 2, ("relu", "layer2.downsample", "branch.gate")),
)


def small_resnet(seed: int = 0) -> tuple[SmallResNet, tuple[torch.Tensor]]:
    """The model and one micro-batch of example inputs."""
    torch.manual_seed(seed)
    return SmallResNet(), (torch.randn(MICROBATCH, 3, 8, 8),)


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(output, target)


def step_against_unsplit(rank: int, world_size: int, cases: list[tuple]) -> list[dict]:
    """One training step per case, its loss and gradients beside the unsplit model's."""
    return [_case(*case) for case in cases]


def _case(schedule: str, stages_per_rank: int, split_points: tuple[str, ...]) -> dict:
    model, example = small_resnet()
    pipe = Pipeline(model, example_args=example, loss_fn=loss_fn, schedule=schedule, n_microbatches=N_MICROBATCHES,
                    split_points=list(split_points),
                    planner=PlannerOptions(stages_per_rank=stages_per_rank))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(MICROBATCH * N_MICROBATCHES, 3, 8, 8, generator=g)
    y = torch.randint(0, CLASSES, (MICROBATCH * N_MICROBATCHES,), generator=g)
    loss = pipe.step(x, target=y)
    ref = sum(loss_fn(model(xi), yi) for xi, yi in zip(x.chunk(N_MICROBATCHES), y.chunk(N_MICROBATCHES)))
    return against_reference(pipe, model, loss, ref / N_MICROBATCHES)
