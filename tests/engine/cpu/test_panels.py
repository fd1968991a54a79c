"""The panel kernel (csrc/panel_matmul.c) and the bf16 panels that serve a bf16 model's linears where the route says:
each output is the fused multiply-add chain over k in order, then the bias, then one rounding; a row's outputs depend on
neither the other rows nor the weights stacked beside its own, nor on the ISA the library was built for."""

import os
import platform
import subprocess
import sys
import tempfile

import pytest
import torch
import torch.nn.functional as F

from rollout.engine.cpu import features
from rollout.engine.cpu.features import ENV_BF16_PANELS, ENV_BF16_VIA_FP32, cpu_features, isa_flags
from rollout.engine.cpu.kernel import load_kernel
from rollout.engine.cpu.matmuls import PANEL, pack_panels, panel_matmul
from rollout.engine.cpu.packed_linear import PackedLinears
from rollout.engine.cpu.panel_packed import PanelWeight
from tests.helpers.models import tiny_model
from tests.helpers.paths import REPO_ROOT

pytestmark = pytest.mark.skipif(load_kernel() is None, reason="the C kernels do not build here")

DTYPES = [torch.float32, torch.bfloat16]


def _reference_layout(weight: torch.Tensor) -> torch.Tensor:
    """The documented layout: panel p, then k, then the 32 columns in order (each panel the transpose of 32 rows)."""
    n, k = weight.shape
    count = -(-n // PANEL)
    padded = torch.zeros(count * PANEL, k, dtype=weight.dtype)
    padded[:n] = weight
    return padded.view(count, PANEL, k).transpose(1, 2).contiguous()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)


def _fma_chain(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The kernel's arithmetic, spelled out: per output, acc = fma(x[k], w[k], acc) for k in order from 0 (in fp64,
    where the product is exact, rounded once to fp32), then plus the bias in fp32, then rounded to the dtype."""
    xs, ws = x.double(), weight.double()
    acc = torch.zeros(x.shape[0], weight.shape[0], dtype=torch.float32)
    for k in range(x.shape[1]):
        acc = (acc.double() + xs[:, k, None] * ws[None, :, k]).float()
    if bias is not None:
        acc = acc + bias.float()
    return acc.to(x.dtype)


def _panel_cases() -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
    """Output counts off the 32-column panels, widths with no vector-friendly size, row counts across every tile size
    (tiles of up to 12 rows on AVX-512, 3 on AVX2, 1 elsewhere, split evenly), with and without a bias, both dtypes."""
    g = torch.Generator().manual_seed(0)
    cases = []
    for out_features, in_features, rows, bias in [(70, 33, 13, True), (32, 16, 1, False), (5, 7, 3, True),
                                                   (97, 64, 25, False), (64, 129, 64, True)]:
        x, w = torch.randn(rows, in_features, generator=g), torch.randn(out_features, in_features, generator=g)
        b = torch.randn(out_features, generator=g) if bias else None
        cases.append((x, w, b))
        cases.append((x.bfloat16(), w.bfloat16(), None if b is None else b.bfloat16()))
    return cases


def _run_case(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return panel_matmul(x, pack_panels(weight), weight.shape[0], bias)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(70, 33), (32, 1), (1, 5), (95, 64)])
def test_pack_panels_lays_out_the_documented_layout(dtype, shape):
    weight = torch.randn(*shape).to(dtype)
    panels = pack_panels(weight)
    assert panels.shape == (-(-shape[0] // PANEL), shape[1], PANEL) and panels.dtype == dtype
    assert torch.equal(_bits(panels), _bits(_reference_layout(weight)))


@pytest.mark.parametrize("case", range(10))
def test_panel_matmul_is_the_fma_chain_over_k_in_order(case):
    """Bit for bit the spelled-out chain, for every row count of the case; within fp32 (bf16) rounding of F.linear."""
    x, weight, bias = _panel_cases()[case]
    panels = pack_panels(weight)
    for rows in sorted({r for r in (1, 2, 3, x.shape[0] // 2 or 1, x.shape[0]) if r <= x.shape[0]}):
        out = panel_matmul(x[:rows], panels, weight.shape[0], bias)
        assert out.dtype == x.dtype and out.shape == (rows, weight.shape[0])
        assert torch.equal(_bits(out), _bits(_fma_chain(x[:rows], weight, bias))), rows
        exact = F.linear(x[:rows].double(), weight.double(), None if bias is None else bias.double())
        tol = 1e-5 if x.dtype == torch.float32 else 1e-2
        assert torch.allclose(out.double(), exact, atol=tol * x.shape[1] ** 0.5, rtol=tol), rows


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_rows_outputs_depend_on_neither_the_other_rows_nor_the_weights_stacked_beside(dtype):
    torch.manual_seed(3)
    q, k, v = (torch.randn(n, 48).to(dtype) for n in (40, 24, 9))
    x = torch.randn(30, 48).to(dtype)
    stacked = panel_matmul(x, pack_panels(torch.cat([q, k, v])), 73, None)
    apart = torch.cat([_run_case(x, w, None) for w in (q, k, v)], dim=-1)
    assert torch.equal(_bits(stacked), _bits(apart))
    for row in (0, 11, 29):
        assert torch.equal(_bits(_run_case(x[row:row + 1], q, None)), _bits(stacked[row:row + 1, :40]))
    strided = torch.randn(6, 96).to(dtype)[:, 48:]  # rows further apart than they are wide
    assert torch.equal(_run_case(strided, q, None), _run_case(strided.contiguous(), q, None))


@pytest.mark.parametrize("march", ["x86-64-v3", "x86-64-v2"])
def test_panel_matmul_has_the_same_bits_on_every_target(march):
    """A build for AVX2 with FMA, or SSE without FMA (C's fmaf), gives this build's results bit for bit, in a child
    process built for that target."""
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("needs an x86-64 CPU")
    if march == "x86-64-v3" and not {"avx2", "fma3"} <= set(isa_flags()):
        pytest.skip("an x86-64-v3 build needs an AVX2 + FMA CPU")
    code = ("import sys, torch; from rollout.engine.cpu.kernel import kernel_build; "
            "from tests.engine.cpu.test_panels import _panel_cases, _run_case; "
            "torch.save([_run_case(*case) for case in _panel_cases()], sys.argv[1]); print(kernel_build().march)")
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "out.pt")
        child = subprocess.run([sys.executable, "-c", code, path], env={**os.environ, "ROLLOUT_KERNEL_MARCH": march},
                               capture_output=True, text=True, timeout=300, cwd=str(REPO_ROOT))
        assert child.returncode == 0, child.stderr
        assert child.stdout.split()[-1] == march
        theirs = torch.load(path)
    for case, other in zip(_panel_cases(), theirs, strict=True):
        assert torch.equal(_bits(other), _bits(_run_case(*case))), tuple(case[1].shape)


def test_bad_inputs_are_clear_errors():
    weight = torch.randn(40, 16).bfloat16()
    panels = pack_panels(weight)
    with pytest.raises(ValueError, match="panel_matmul takes fp32 or bf16 input, weight and bias of one dtype"):
        panel_matmul(torch.randn(2, 16), panels, 40, None)
    with pytest.raises(ValueError, match="the panels must come from pack_panels of a weight"):
        panel_matmul(torch.randn(2, 17).bfloat16(), panels, 40, None)
    with pytest.raises(ValueError, match="the panels must come from pack_panels of a weight"):
        panel_matmul(torch.randn(2, 16).bfloat16(), panels, 65, None)  # more outputs than the panels hold
    with pytest.raises(ValueError, match="pack_panels takes a 2-D fp32 or bf16 CPU weight"):
        pack_panels(weight.half())
    with pytest.raises(ValueError, match=r"into torch.bfloat16 panels \(2, 16, 32\): they must be contiguous"):
        pack_panels(weight[:8], out=panels, row0=36, total_rows=40)  # rows past the total
    with pytest.raises(ValueError, match=r"panel_matmul's bias must be a 1-D CPU tensor of its 40 outputs"):
        panel_matmul(torch.randn(2, 16).bfloat16(), panels, 40, torch.randn(3).bfloat16())  # would read past it
    with pytest.raises(ValueError, match="pack_panels takes a weight of at least one row and column"):
        pack_panels(weight[:0])
    with pytest.raises(ValueError, match="only into panels of its own"):
        pack_panels(weight, row0=8)  # the rows before it would be left unwritten
    with pytest.raises(ValueError, match="panels hold 2-D bf16 CPU weights"):
        PanelWeight(weight.float())
    with pytest.raises(ValueError, match=r"repack of torch\.bfloat16 panels of"):
        PanelWeight(weight).repack(weight[:, :8])


@pytest.mark.parametrize("sizes", [(40, 33), (32, 64), (7, 9, 70)], ids=lambda s: "+".join(map(str, s)))
def test_a_stack_member_repacks_its_own_rows_in_place(sizes):
    """`repack(member, row0)` writes that member's rows of a stacked copy (the others untouched), in the same buffer,
    and with `plain` the live weight in the same pass; with every member written the panels equal a fresh pack of the
    stack. Members start mid-panel, on a panel, and span several."""
    torch.manual_seed(4)
    old = [torch.randn(n, 24).bfloat16() for n in sizes]
    stack = PanelWeight(torch.cat(old))
    address = stack.panels.data_ptr()
    new = [torch.randn(n, 24).bfloat16() for n in sizes]
    live = [w.clone() for w in old]
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    stack.repack(new[-1], row0=starts[-1], plain=live[-1])
    assert torch.equal(live[-1], new[-1])
    x = torch.randn(3, 24).bfloat16()
    assert torch.equal(stack.linear(x)[:, :starts[-1]], PanelWeight(torch.cat(old[:-1])).linear(x))  # others kept
    for member, start in list(zip(new, starts))[:-1]:
        stack.repack(member, row0=start)
    assert stack.panels.data_ptr() == address
    assert torch.equal(_bits(stack.panels), _bits(pack_panels(torch.cat(new))))
    assert torch.equal(_bits(stack.panels), _bits(_reference_layout(torch.cat(new))))


@pytest.fixture
def panels_route(fresh_detection, monkeypatch):
    monkeypatch.setenv(ENV_BF16_PANELS, "1")
    route = cpu_features().bf16_route
    assert route.panels and not route.via_fp32 and "on bf16 panels" in route.describe()
    return route


def test_a_weight_update_writes_every_stack_that_holds_the_weight(panels_route):
    """A weight in two stacked copies (as a gated MLP's gate and up stacked for the eager forward and again, in
    another order, for a compiled one): `load` writes both, so neither is left with the old values by `clear`."""
    torch.manual_seed(6)
    model = torch.nn.ModuleDict({"a": torch.nn.Linear(24, 40, bias=False), "b": torch.nn.Linear(24, 33, bias=False)})
    model = model.to(torch.bfloat16)
    a, b = model["a"].weight, model["b"].weight
    linears = PackedLinears(model)
    x = torch.randn(3, 24).bfloat16()
    with torch.inference_mode(), linears:
        linears.stacked_for(x, (a, b)), linears.stacked_for(x, (b, a))
    assert len(linears._stacks) == 2
    new_a, new_b = torch.randn(40, 24).bfloat16(), torch.randn(33, 24).bfloat16()
    assert linears.load(a, new_a) and linears.load(b, new_b)
    linears.clear({id(a), id(b)})
    with torch.inference_mode(), linears:
        ab, ba = linears.stacked_for(x, (a, b)), linears.stacked_for(x, (b, a))
    expected = torch.cat([PanelWeight(new_a).linear(x), PanelWeight(new_b).linear(x)], -1)
    assert torch.equal(ab.linear(x), expected)
    assert torch.equal(ba.linear(x), torch.cat([expected[:, 40:], expected[:, :40]], -1))


def test_the_panels_switch(fresh_detection, monkeypatch):
    """ROLLOUT_BF16_PANELS=0 never takes the panels (nor times them), 1 takes them wherever the library is built; a
    bad value says what it expects."""
    monkeypatch.setenv(ENV_BF16_VIA_FP32, "1")
    monkeypatch.setenv(ENV_BF16_PANELS, "0")
    assert not cpu_features().bf16_route.panels
    features.clear_detection()
    monkeypatch.setenv(ENV_BF16_PANELS, "yes")
    with pytest.raises(ValueError, match=r"ROLLOUT_BF16_PANELS='yes': expected 0 .*, 1 .* or unset"):
        features.bf16_route(frozenset({torch.float32}))


def test_bf16_linears_on_panels_round_where_eager_rounds(panels_route):
    """Inside the engine's forward: every bf16 linear on its panels, a gated MLP's gate and up as one stacked copy
    (then the SiLU and product on bf16 values, as eager computes them), the same bits as the panels apart; outside
    it, F.linear and autograd."""
    model = tiny_model("qwen3").to(torch.bfloat16)
    mlp = model.model.layers[0].mlp
    linears = PackedLinears(model)
    assert linears.panels == {torch.bfloat16} and torch.bfloat16 in linears.gate_dtypes
    x = torch.randn(1, 7, mlp.gate_proj.in_features).bfloat16()
    gate, up, down = (PanelWeight(m.weight) for m in (mlp.gate_proj, mlp.up_proj, mlp.down_proj))
    expected = down.linear(F.silu(gate.linear(x)) * up.linear(x))
    with torch.inference_mode(), linears:
        assert torch.equal(mlp(x), expected)
        assert len(linears._stacks) == 1 and isinstance(next(iter(linears._stacks.values())).packed, PanelWeight)
        q = model.model.layers[0].self_attn.q_proj
        assert isinstance(linears.packed_for(x, q.weight), PanelWeight)
    out = mlp.down_proj(torch.randn(2, mlp.down_proj.in_features).bfloat16().requires_grad_())
    assert out.requires_grad
