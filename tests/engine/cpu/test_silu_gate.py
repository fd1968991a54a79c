"""SiLU-gated MLPs run their gate and up projections as one fused pair of packed matmuls, in the eager forward and in
the compiled graph, with the same results as the model's own forward; look-alike modules keep theirs."""

import threading

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, Qwen3Config
from transformers.models.llama.modeling_llama import LlamaMLP
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP

from rollout.engine.cpu import mkl_packed, silu_gate
from rollout.engine.cpu.features import cpu_features, probe_silu_gate
from rollout.engine.cpu.packed_linear import PackedLinears, packing_available
from rollout.engine.cpu.packed_linear_op import active_linears, use_packed_linears, use_silu_gates

fuses_fp32 = pytest.mark.skipif(torch.float32 not in cpu_features().silu_gate_dtypes,
                                reason="this CPU's oneDNN does not fuse the fp32 SiLU gate (the linears run apart)")
# who packs the fp32 copies: oneDNN (its fused pair of matmuls) or MKL (one matmul over gate and up stacked)
PACKERS = [pytest.param(False, id="onednn", marks=fuses_fp32),
           pytest.param(True, id="mkl", marks=pytest.mark.skipif(
               not mkl_packed.available(), reason=f"MKL's packed sgemm: {mkl_packed.unavailable_reason()}"))]


def _qwen3_mlp(hidden: int = 48, intermediate: int = 80) -> torch.nn.Module:
    torch.manual_seed(0)
    return Qwen3MLP(Qwen3Config(hidden_size=hidden, intermediate_size=intermediate)).eval()


def _llama_mlp_with_bias() -> torch.nn.Module:
    torch.manual_seed(1)
    mlp = LlamaMLP(LlamaConfig(hidden_size=32, intermediate_size=64, mlp_bias=True)).eval()
    with torch.no_grad():
        for linear in (mlp.gate_proj, mlp.up_proj, mlp.down_proj):
            linear.bias.normal_()
    return mlp


class ScaledMLP(torch.nn.Module):
    """gate_proj/up_proj/down_proj/act_fn like a gated MLP, but its forward is something else."""

    def __init__(self) -> None:
        super().__init__()
        self.gate_proj, self.up_proj = torch.nn.Linear(16, 24, bias=False), torch.nn.Linear(16, 24, bias=False)
        self.down_proj, self.act_fn = torch.nn.Linear(24, 16, bias=False), torch.nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x) * 2.0)


class GeluMLP(ScaledMLP):
    def __init__(self) -> None:
        super().__init__()
        self.act_fn = torch.nn.GELU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def test_gated_mlps_are_recognized_and_look_alikes_are_not():
    assert silu_gate.is_silu_gated_mlp(_qwen3_mlp())
    assert silu_gate.is_silu_gated_mlp(_llama_mlp_with_bias())
    assert not silu_gate.is_silu_gated_mlp(ScaledMLP()), "same names, another forward: must keep its own"
    assert not silu_gate.is_silu_gated_mlp(GeluMLP()), "another activation: must keep its own forward"
    assert not silu_gate.is_silu_gated_mlp(torch.nn.Linear(4, 4))


def test_all_zero_weights_prove_nothing_and_are_not_remembered():
    class ZeroMLP(ScaledMLP):  # a class of its own: nothing is known about it yet
        pass

    mlp = ZeroMLP()
    for p in mlp.parameters():
        torch.nn.init.zeros_(p)
    assert not silu_gate.is_silu_gated_mlp(mlp)
    assert not any(key[0] is ZeroMLP for key in silu_gate._checked), "a check that proved nothing was remembered"
    torch.nn.init.normal_(mlp.gate_proj.weight)
    torch.nn.init.normal_(mlp.up_proj.weight)
    torch.nn.init.normal_(mlp.down_proj.weight)
    assert not silu_gate.is_silu_gated_mlp(mlp), "with real weights the scaled forward is told apart"


@pytest.mark.skipif(not packing_available(torch.float32), reason="torch built without oneDNN")
def test_the_probe_passes_for_fp32_where_it_is_fused():
    assert (probe_silu_gate(torch.float32) == "") == (torch.float32 in cpu_features().silu_gate_dtypes)
    assert "fused SiLU gate" in cpu_features().describe()


@pytest.mark.parametrize("mkl", PACKERS)
@pytest.mark.parametrize("rows", [1, 5, 17, 300, 2100])
@pytest.mark.parametrize("make", [_qwen3_mlp, _llama_mlp_with_bias])
def test_the_eager_override_equals_the_modules_forward(make, rows, mkl, monkeypatch):
    """Any row count (padded buckets, chunks over PACKED_MAX_ROWS), with and without biases; it really fuses."""
    mlp = make()
    x = torch.randn(1, rows, mlp.gate_proj.in_features)
    expected = mlp(x)
    linears = PackedLinears(mlp, mkl=mkl)
    linears.unpacked_max_rows = 0  # the fused path at every row count, whatever this CPU's small-step rule
    linears.small_matmul = False
    calls = []
    run = linears.run_silu_gate
    monkeypatch.setattr(linears, "run_silu_gate", lambda *a: calls.append(1) or run(*a))
    with torch.inference_mode(), linears:
        assert "forward" in mlp.__dict__
        out = mlp(x)
    assert calls, "the fused gate did not run"
    assert "forward" not in mlp.__dict__, "the module must be left exactly as it was"
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    weights = (id(mlp.gate_proj.weight), id(mlp.up_proj.weight))
    assert (weights in linears._stacks) == mkl, "MKL's copy stacks gate and up; oneDNN keeps one copy of each"


@fuses_fp32
def test_another_thread_keeps_the_modules_own_forward_and_its_gradients():
    mlp = _qwen3_mlp()
    linears = PackedLinears(mlp)
    x = torch.randn(3, 48)
    result = {}

    def trainer():
        mlp.zero_grad()
        mlp(x).sum().backward()
        result["grad"] = mlp.gate_proj.weight.grad is not None

    with linears:
        worker = threading.Thread(target=trainer)
        worker.start()
        worker.join()
    assert result["grad"]


def _traced(module, x):
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm
    torch._dynamo.reset()
    torch.compile(module, backend=backend, dynamic=False)(x)
    return graphs[0]


def _targets(gm):
    return [node.target for node in gm.graph.nodes if node.op == "call_function"]


@pytest.mark.parametrize("mkl", [False, True])
@pytest.mark.parametrize("make", [_qwen3_mlp, _llama_mlp_with_bias])
def test_the_graph_rewrite_fuses_the_gate_and_keeps_the_result(make, mkl):
    mlp = make()
    x = torch.randn(7, mlp.gate_proj.in_features)
    gm = _traced(mlp, x)
    assert use_silu_gates(gm, frozenset({torch.float32})) == 1
    assert use_packed_linears(gm) == 1  # down_proj
    targets = _targets(gm)
    assert torch.ops.rollout.packed_silu_gate.default in targets and F.silu not in targets
    linears = PackedLinears(mlp, mkl=mkl and mkl_packed.available()) if packing_available(torch.float32) else None
    params = {name: p for name, p in mlp.named_parameters()}
    placeholders = [node.name for node in gm.graph.nodes if node.op == "placeholder"]
    args = [x if name.startswith("l_x") else params[_param_name(name)] for name in placeholders]
    with torch.inference_mode(), active_linears(linears):
        out = gm(*args)
    out = out[0] if isinstance(out, tuple) else out
    torch.testing.assert_close(out, mlp(x), rtol=1e-5, atol=1e-5)


def _param_name(placeholder: str) -> str:
    """l_self_modules_gate_proj_parameters_weight_ -> gate_proj.weight"""
    module, _, param = placeholder.removeprefix("l_self_modules_").rstrip("_").partition("_parameters_")
    return f"{module}.{param}"


def test_the_graph_rewrite_leaves_other_dtypes_and_shared_values_alone():
    mlp = _qwen3_mlp()
    x = torch.randn(7, 48)
    assert use_silu_gates(_traced(mlp, x), frozenset()) == 0, "a dtype this CPU does not fuse"

    class Leaky(torch.nn.Module):  # the gate's value is used twice: it must stay materialized
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            gate = self.inner.gate_proj(x)
            return self.inner.down_proj(F.silu(gate) * self.inner.up_proj(x)), gate

    assert use_silu_gates(_traced(Leaky(mlp), x), frozenset({torch.float32})) == 0
