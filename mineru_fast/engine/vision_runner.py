"""How the vision encoder runs: eager, TorchScript-traced per grid, or ``torch.compile``d.

- ``eager``: the module as is; images are packed into one sequence.
- ``trace``: ``torch.jit.trace`` + ``torch.jit.freeze`` of the encoder for one image grid,
  cached per grid (the shape bucket); each image runs alone through its grid's trace.
- ``compile``: ``torch.compile(dynamic=True)`` of the encoder; packing as in eager.

Measured on the full-size layout pass (benchmarks/README.md): steady-state times within 2% of each
other, tracing's first call 2.8x a pass and 22.6 GB; eager is the default.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import torch
from torch import nn

from mineru_fast.engine.vision import VisionEncoder

Runner = Callable[[torch.Tensor, list[tuple[int, int, int]]], torch.Tensor]


class _OneGrid(nn.Module):
    """The encoder specialised to one grid: ``forward(pixel_values)`` only (traceable)."""

    def __init__(self, vision: VisionEncoder, grid: tuple[int, int, int]) -> None:
        super().__init__()
        self.vision, self.grid = vision, grid

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.vision(pixel_values, [self.grid])


class TracedVision:
    """Runs each image through a frozen TorchScript trace of its grid (LRU cache of ``capacity``)."""

    def __init__(self, vision: VisionEncoder, capacity: int = 8) -> None:
        self.vision, self.capacity = vision, capacity
        self.traces: OrderedDict[tuple[int, int, int], torch.jit.ScriptModule] = OrderedDict()

    def trace(self, grid: tuple[int, int, int], pixel_values: torch.Tensor) -> torch.jit.ScriptModule:
        if grid not in self.traces:
            module = _OneGrid(self.vision, grid).eval()
            with torch.inference_mode(False), torch.no_grad():
                traced = torch.jit.freeze(torch.jit.trace(module, (pixel_values,), check_trace=False))
            self.traces[grid] = traced
            if len(self.traces) > self.capacity:
                self.traces.popitem(last=False)
        self.traces.move_to_end(grid)
        return self.traces[grid]

    def __call__(self, pixel_values: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        outputs, offset = [], 0
        for grid in grids:
            n = grid[0] * grid[1] * grid[2]
            pixels = pixel_values[offset : offset + n]
            module = self.trace(grid, pixels)
            with torch.inference_mode(False), torch.no_grad():
                outputs.append(module(pixels))
            offset += n
        return torch.cat(outputs)


def make_vision_runner(vision: VisionEncoder, mode: str) -> Runner:
    """A callable ``(pixel_values [N, patch_dim], grids) -> [N / 4, hidden]`` for ``mode``.

    Raises:
        ValueError: unknown mode.
    """
    if mode == "eager":
        return vision
    if mode == "trace":
        return TracedVision(vision)
    if mode == "compile":
        return torch.compile(vision, dynamic=True)
    raise ValueError(f"vision mode must be eager, trace or compile, got {mode!r}")
