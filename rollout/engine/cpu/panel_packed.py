"""A bf16 weight packed in panels for the C kernel csrc/panel_matmul.c: the engine's copies of bf16 linear weights on
CPUs whose oneDNN has no bf16 dot products, where this kernel is timed faster than oneDNN's fp32 copies.

Why: without AVX512_BF16 or AMX, oneDNN emulates bf16 arithmetic, so bf16 models ran on fp32 copies of their weights:
twice the bf16 weights' bytes in RAM again, and twice the bytes to stream per decode step. The panels hold the bf16
values as they are (a transposed layout of the same size), and the kernel widens them in registers; it keeps a tile
of rows by 32 outputs in registers for the whole sum, so it serves every row count from one decode row to a prefill
chunk (benchmarks/RESULTS.md, "bf16 panels").

Values: each output is summed in fp32 in k order and rounded to bf16 once, as a bf16 matmul rounds its fp32 sums. A
row's outputs depend on neither the other rows of the step nor the vector ISA, so weights stacked into one copy (a
layer's q, k and v; a gated MLP's gate and up) give the bits they give apart.
"""

from __future__ import annotations

import torch

from rollout.engine.cpu.matmuls import pack_panels, panel_matmul


class PanelWeight:
    """One bf16 weight `[out_features, in_features]` (or several stacked along their output rows) in panels;
    `linear(x, bias)` is `F.linear` for bf16 `x`, summed in fp32."""

    def __init__(self, weight: torch.Tensor) -> None:
        if weight.dim() != 2 or weight.dtype != torch.bfloat16 or weight.device.type != "cpu":
            raise ValueError(f"panels hold 2-D bf16 CPU weights, got {weight.dtype} {tuple(weight.shape)} on "
                             f"{weight.device}")
        self.out_features, self.in_features = weight.shape
        self.panels = pack_panels(weight)

    @property
    def shape(self) -> tuple[int, int]:
        return self.out_features, self.in_features

    @property
    def dtype(self) -> torch.dtype:
        return self.panels.dtype

    def repack(self, weight: torch.Tensor, row0: int = 0, plain: torch.Tensor | None = None) -> None:
        """Pack the current values of `weight` into these panels in place: all of it (same shape and dtype), or as
        its rows `row0` onwards (a member of the weights stacked here: same width and dtype). `plain` (a weight
        update's live weight): also copy `weight` there, in the same pass."""
        rows_fit = weight.dim() == 2 and row0 >= 0 and row0 + weight.shape[0] <= self.out_features
        if weight.dtype != self.dtype or weight.shape[-1] != self.in_features or not rows_fit:
            raise ValueError(f"repack of {self.dtype} panels of {self.shape} with a {weight.dtype} weight of shape "
                             f"{tuple(weight.shape)} as rows {row0} onwards: the whole weight, or rows within it, "
                             "of its width and dtype")
        pack_panels(weight, out=self.panels, row0=row0, total_rows=self.out_features, plain=plain)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """`x @ W.T + bias` for bf16 `x` of shape `[..., in_features]`, any number of rows."""
        return panel_matmul(x, self.panels, self.out_features, bias)
