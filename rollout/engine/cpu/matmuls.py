"""The C library's matmul entry points (csrc/small_matmul.c, csrc/panel_matmul.c), for the engine's CPU linears: the
small-rows kernel over weights as stored, and the panel kernel over weights packed in its own layout. Both sum in fp32
in an order their source fixes (kernel.SOURCE_FLAGS keeps the compiler from changing it), so a build for any x86-64
target gives the same bits. The library is built and loaded by kernel.py; callers check `load_kernel()` first."""

from __future__ import annotations

import torch

from rollout.engine.cpu.kernel import load_kernel, transpose_blocks

PANEL = 32  # output columns per panel (csrc/panel_matmul.c)


def _check_matmul_dtypes(name: str, x: torch.Tensor, weight_dtype: torch.dtype, bias: torch.Tensor | None) -> None:
    if x.dtype != weight_dtype or x.dtype not in (torch.float32, torch.bfloat16) or (
            bias is not None and bias.dtype != x.dtype):
        raise ValueError(f"{name} takes fp32 or bf16 input, weight and bias of one dtype, got {x.dtype}, "
                         f"{weight_dtype} and {None if bias is None else bias.dtype}")


def _rows(x: torch.Tensor) -> torch.Tensor:
    flat = x.reshape(-1, x.shape[-1])
    return flat if flat.stride(-1) == 1 else flat.contiguous()


def small_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for CPU tensors of a few rows (csrc/small_matmul.c), with the weight read as stored
    (`[N, K]`, contiguous), all fp32 or all bf16 (summed in fp32, each output rounded to bf16, as a bf16 matmul rounds
    its fp32 sums); no autograd. For the engine's forward only, at the rows cpu_features chose (`small_matmul_rows`,
    `Bf16Route.kernel_max_rows`)."""
    _check_matmul_dtypes("small_matmul", x, weight.dtype, bias)
    lib = load_kernel()
    flat = _rows(x)
    rows, width = flat.shape
    out = torch.empty(rows, weight.shape[0], dtype=x.dtype)
    run = lib.rollout_small_matmul_bf16 if x.dtype == torch.bfloat16 else lib.rollout_small_matmul
    status = run(flat.data_ptr(), flat.stride(0), weight.data_ptr(), None if bias is None else bias.data_ptr(),
                 out.data_ptr(), out.stride(0), rows, weight.shape[0], width, torch.get_num_threads())
    if status:
        raise MemoryError(f"the small-rows kernel could not allocate {rows} x {width} floats of scratch")
    return out.view(*x.shape[:-1], weight.shape[0])


def pack_panels(weight: torch.Tensor, out: torch.Tensor | None = None, row0: int = 0, total_rows: int | None = None,
                plain: torch.Tensor | None = None) -> torch.Tensor:
    """`weight` [N, K] (fp32 or bf16, CPU) in panel_matmul's layout, `[ceil(N / 32), K, 32]` of its dtype: each panel
    the transpose of 32 rows (zeros past N), written by the weight-sync transpose (kernel.transpose_blocks). Into `out`
    where given (a repack in place: compiled graphs and callers keep the buffer), and there as rows `row0` onwards of
    a weight of `total_rows` rows (default: up to its end): a member of weights stacked into one copy. `plain` (the
    live weight, `weight`'s shape): also copy `weight` there in the same pass."""
    if weight.dim() != 2 or weight.dtype not in (torch.float32, torch.bfloat16) or weight.device.type != "cpu":
        raise ValueError(f"pack_panels takes a 2-D fp32 or bf16 CPU weight, got {weight.dtype} "
                         f"{tuple(weight.shape)} on {weight.device}")
    rows, k = weight.shape
    if rows == 0 or k == 0 or (out is None and (row0 or total_rows is not None)):
        raise ValueError(f"pack_panels takes a weight of at least one row and column ({tuple(weight.shape)} given), "
                         "and packs rows from `row0` or up to `total_rows` only into panels of its own (`out`)")
    total = row0 + rows if total_rows is None else total_rows
    shape = (-(-total // PANEL), k, PANEL)
    if out is None:
        out = torch.empty(shape, dtype=weight.dtype)
        out[-1, :, total - (shape[0] - 1) * PANEL:] = 0  # the last panel's rows past N (if any): never written again
    if tuple(out.shape) != shape or out.dtype != weight.dtype or not out.is_contiguous() or not (
            row0 >= 0 and row0 + rows <= total):
        raise ValueError(f"pack_panels of a {weight.dtype} {tuple(weight.shape)} weight as rows {row0} onwards of "
                         f"{total} into {out.dtype} panels {tuple(out.shape)}: they must be contiguous {shape} of its "
                         "dtype, and the rows within the total")
    if plain is not None and (plain.shape != weight.shape or plain.dtype != weight.dtype or not plain.is_contiguous()):
        raise ValueError(f"pack_panels copies the weight into a contiguous {weight.dtype} {tuple(weight.shape)} "
                         f"tensor, got a {plain.dtype} {tuple(plain.shape)} one")
    weight, flat, panel_size = weight.detach().contiguous(), out.view(-1), k * PANEL
    done = 0
    while done < rows:  # a partial first panel, the full panels, a partial last one
        first, in_panel = divmod(row0 + done, PANEL)
        group = min(PANEL - in_panel, rows - done)
        blocks = (rows - done) // PANEL if in_panel == 0 and group == PANEL else 1
        transpose_blocks(weight[done:], flat, first * panel_size + in_panel, blocks, group, panel_size, PANEL,
                         None if plain is None else plain[done:])
        done += blocks * group
    return out


def panel_matmul(x: torch.Tensor, panels: torch.Tensor, out_features: int, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` over `panels = pack_panels(weight)` (csrc/panel_matmul.c), any row count, all fp32
    or all bf16 (summed in fp32 in k order, each output rounded to bf16); no autograd. A row's outputs do not depend
    on the call's other rows."""
    _check_matmul_dtypes("panel_matmul", x, panels.dtype, bias)
    if bias is not None and (bias.dim() != 1 or bias.numel() != out_features or bias.device.type != "cpu"):
        raise ValueError(f"panel_matmul's bias must be a 1-D CPU tensor of its {out_features} outputs, got "
                         f"{tuple(bias.shape)} on {bias.device}")
    if x.device.type != "cpu" or panels.device.type != "cpu":
        raise ValueError(f"panel_matmul runs on CPU tensors, got x on {x.device} and panels on {panels.device}")
    if panels.dim() != 3 or panels.shape[2] != PANEL or x.shape[-1] != panels.shape[1] or not (
            0 < out_features <= panels.shape[0] * PANEL) or not panels.is_contiguous():
        raise ValueError(f"panel_matmul of x {tuple(x.shape)} over panels {tuple(panels.shape)} for {out_features} "
                         "outputs: the panels must come from pack_panels of a weight [out_features, x.shape[-1]]")
    flat = _rows(x)
    rows, width = flat.shape
    out = torch.empty(rows, out_features, dtype=x.dtype)
    lib = load_kernel()
    run = lib.rollout_panel_matmul_bf16 if x.dtype == torch.bfloat16 else lib.rollout_panel_matmul
    bias = None if bias is None else bias.contiguous()  # held until the call returns
    status = run(flat.data_ptr(), flat.stride(0), panels.data_ptr(), None if bias is None else bias.data_ptr(),
                 out.data_ptr(), out.stride(0), rows, out_features, width, torch.get_num_threads())
    if status:
        raise MemoryError(f"the panel kernel could not allocate {rows} x {width} floats of scratch")
    return out.view(*x.shape[:-1], out_features)
