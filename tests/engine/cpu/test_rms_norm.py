"""RMSNorm modules run as one C call (csrc/rms_norm.c) inside the engine's eager forward, with the module's own results;
look-alike norms that compute something else keep their own forward."""

import threading

import pytest
import torch
from transformers import GenerationConfig
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

import rollout.engine.cpu.rms_norm as fused
from rollout import ContinuousBatchingConfig, generate_batch
from rollout.engine.cpu.kernel import load_kernel, norm_sum_order, rms_norm
from rollout.engine.cpu.rms_norm import FusedNorms, bf16_ulps, eps_name, is_rms_norm
from rollout.engine.worker import model_runner
from tests.helpers.models import random_prompts, tiny_model

pytestmark = pytest.mark.skipif(load_kernel() is None, reason="no C kernel library on this machine")
DTYPES = [torch.float32, torch.bfloat16]


def formula(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3RMSNorm.forward / LlamaRMSNorm.forward, written out."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def assert_same(out: torch.Tensor, expected: torch.Tensor) -> None:
    """torch's bits where the kernel sums in torch's order (norm_sum_order), else within what another order allows:
    fp32 within 1e-6, bf16 equal on 99.9% of the elements and at most one ulp apart."""
    assert out.shape == expected.shape and out.dtype == expected.dtype and out.is_contiguous()
    if norm_sum_order()[1]:
        assert torch.equal(out, expected)
    elif out.dtype == torch.float32:
        torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    else:
        ulps = bf16_ulps(out, expected)
        assert ulps.max() <= 1 and ulps.count_nonzero() <= 1e-3 * ulps.numel()


def _views():
    """(name, input maker): contiguous rows, views of a projection's output, and layouts rms_norm must copy."""
    def plain(rows, dim):
        return lambda dtype: torch.randn(rows, dim).to(dtype) * 3
    return [
        ("1x64", plain(1, 64)),
        ("5x128", plain(5, 128)),
        ("300x1024", plain(300, 1024)),  # split over threads
        ("17x2048", plain(17, 2048)),
        ("3x100", plain(3, 100)),  # a tail after the last full vector
        ("1x20003", plain(1, 20003)),  # long enough for the sum's cascade
        ("heads-of-2x3x1024", lambda dtype: (torch.randn(2, 3, 1024).to(dtype)).view(2, 3, 8, 128)),
        # q of a fused qkv projection: rows 3072 apart, then split into heads
        ("q-of-qkv", lambda dtype: torch.randn(2, 3, 3072).to(dtype)[..., :1024].view(2, 3, 8, 128)),
        ("transposed", lambda dtype: torch.randn(4, 6, 64).to(dtype).transpose(0, 1)),
        ("strided-last-dim", lambda dtype: torch.randn(7, 256).to(dtype)[:, ::2]),
        ("no-rows", lambda dtype: torch.randn(0, 64).to(dtype)),
    ]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name,make", _views())
def test_kernel_equals_the_formula(dtype, name, make):
    torch.manual_seed(0)
    x = make(dtype)
    weight = (torch.randn(x.shape[-1]) + 1).to(dtype)
    before = x.clone()
    out = rms_norm(x, weight, 1e-6)
    assert torch.equal(x, before), "the input was written to"
    assert_same(out, formula(x, weight, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_and_inf_rows_as_torch(dtype):
    x = torch.randn(6, 64).to(dtype)
    x[0, 3], x[1, 5], x[2], x[3] = float("nan"), float("inf"), 0.0, x[3] * 1e30
    weight = torch.randn(64).to(dtype)
    out, expected = rms_norm(x, weight, 1e-6), formula(x, weight, 1e-6)
    assert torch.equal(out.isnan(), expected.isnan())
    assert torch.equal(out.nan_to_num(), expected.nan_to_num())


def test_rows_do_not_depend_on_threads_or_neighbours():
    x, weight = torch.randn(300, 1024).to(torch.bfloat16), torch.randn(1024).to(torch.bfloat16)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        together = rms_norm(x, weight, 1e-5)
        torch.set_num_threads(1)
        alone = torch.cat([rms_norm(x[i:i + 1], weight, 1e-5) for i in range(0, 300, 37)])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(together[::37], alone)


@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() not in ("AVX512", "AVX2"),
                    reason="the sum order is known for torch's x86 kernels")
def test_the_sum_order_is_torchs():
    lanes, matches = norm_sum_order()
    assert matches, "no vector width gave torch's sums: the kernel's norms differ from the modules' in the last bits"
    assert lanes in (8, 16)


class Fp32ProductNorm(torch.nn.Module):
    """The weight multiplied in fp32, then cast: the same as Llama's in fp32, not in bf16."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(dim))
        self.variance_epsilon = eps

    def forward(self, x):
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (self.weight.float() * h).to(x.dtype)


class MeanAbsNorm(Fp32ProductNorm):
    """Same attributes, another formula."""

    def forward(self, x):
        h = x.to(torch.float32)
        return self.weight * (h / (h.abs().mean(-1, keepdim=True) + self.variance_epsilon)).to(x.dtype)


class TwoArgNorm(Fp32ProductNorm):
    def forward(self, x, scale):
        return formula(x, self.weight, self.variance_epsilon) * scale


@pytest.mark.parametrize("dtype", DTYPES)
def test_transformers_norms_are_recognized(dtype):
    for cls in (Qwen3RMSNorm, LlamaRMSNorm):
        norm = cls(128, eps=1e-5).to(dtype)
        assert eps_name(norm) == "variance_epsilon"
        assert is_rms_norm(norm, dtype), cls.__name__
        assert fused._checked[(cls, dtype)] is True


@pytest.mark.parametrize("dtype", DTYPES)
def test_other_formulas_are_not_recognized(dtype):
    gemma = GemmaRMSNorm(128).to(dtype)  # weight * (1 + w), its weights all zeros as built: the check uses its own
    assert eps_name(gemma) == "eps"
    assert not is_rms_norm(gemma, dtype), "Gemma's norm multiplies by 1 + weight"
    assert not is_rms_norm(MeanAbsNorm(128).to(dtype), dtype)
    assert not is_rms_norm(TwoArgNorm(128).to(dtype), dtype)
    assert not is_rms_norm(torch.nn.LayerNorm(128).to(dtype), dtype), "a bias: not an RMSNorm"
    assert not is_rms_norm(Qwen3RMSNorm(128).half(), torch.float16), "no fp16 kernel"


def test_a_weight_product_in_fp32_is_told_apart_in_bf16_only():
    assert is_rms_norm(Fp32ProductNorm(128), torch.float32), "in fp32 it is the same formula"
    assert not is_rms_norm(Fp32ProductNorm(128).to(torch.bfloat16), torch.bfloat16), \
        "in bf16 it rounds once where Llama rounds twice"


class TwoNorms(torch.nn.Module):
    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.qwen = Qwen3RMSNorm(64, eps=1e-6).to(dtype)
        self.gemma = GemmaRMSNorm(64).to(dtype)
        self.fp32_product = Fp32ProductNorm(64).to(dtype)
        with torch.no_grad():
            for p in self.parameters():
                p.normal_()

    def forward(self, x):
        return self.qwen(x), self.gemma(x), self.fp32_product(x)


@pytest.mark.parametrize("dtype", DTYPES)
def test_inside_the_context_only_recognized_norms_run_the_kernel(dtype, monkeypatch):
    model = TwoNorms(dtype)
    x = torch.randn(3, 5, 64).to(dtype)
    expected = model(x)
    calls = []
    kernel = fused.rms_norm
    monkeypatch.setattr(fused, "rms_norm", lambda *a: calls.append(1) or kernel(*a))
    norms = FusedNorms(model)
    with torch.inference_mode(), norms:
        assert "forward" in model.qwen.__dict__
        assert "forward" not in model.gemma.__dict__
        assert ("forward" in model.fp32_product.__dict__) == (dtype == torch.float32)
        out = model(x)
    assert len(calls) == (2 if dtype == torch.float32 else 1)
    assert not any("forward" in m.__dict__ for m in model.modules()), "the modules must be left as they were"
    for got, want in zip(out, expected):
        assert_same(got, want)


def test_calls_the_kernel_cannot_serve_keep_the_modules_forward(monkeypatch):
    norm = Qwen3RMSNorm(64)
    calls = []
    kernel = fused.rms_norm
    monkeypatch.setattr(fused, "rms_norm", lambda *a: calls.append(1) or kernel(*a))
    norms = FusedNorms(norm)
    with norms:
        x = torch.randn(4, 64, requires_grad=True)
        norm(x).sum().backward()  # autograd: its own forward
        assert x.grad is not None and norm.weight.grad is not None
        norm(torch.randn(4, 64).half())  # no fp16 kernel
        norm(torch.randn(4, 64).to(torch.bfloat16))  # another dtype than the weight's
        result = {}
        worker = threading.Thread(target=lambda: result.setdefault("out", norm(torch.randn(4, 64))))
        worker.start()
        worker.join()
        assert isinstance(result["out"], torch.Tensor)
        assert not calls, "the kernel served a call it must leave to the module"
        with torch.inference_mode():
            norm(torch.randn(4, 64))
        assert calls == [1]
    norm(torch.randn(4, 64))
    assert calls == [1], "outside the context the module runs its own forward"


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_engine_runs_the_kernel_with_the_same_tokens(dtype, monkeypatch):
    model = tiny_model("qwen3", lm_head_scale=2.0).to(dtype)
    norms = sum(isinstance(m, Qwen3RMSNorm) for m in model.modules())
    prompts = random_prompts([5, 17, 9], seed=3)
    config = ContinuousBatchingConfig(page_size=8, num_blocks=64)
    gen = GenerationConfig(max_new_tokens=8, do_sample=False)
    calls = []
    kernel = fused.rms_norm
    monkeypatch.setattr(fused, "rms_norm", lambda *a: calls.append(1) or kernel(*a))

    def run():
        outs = generate_batch(model, prompts, gen, config, progress_bar=False)
        return [(o.generated_tokens, o.policy_logprobs) for o in outs.values()]

    with_kernel = run()
    assert len(calls) >= norms * 8, f"{len(calls)} kernel calls for {norms} norms over 8+ steps"
    calls.clear()
    monkeypatch.setattr(model_runner, "load_kernel", lambda: None)  # as without the library: the norms' own forward
    without = run()
    assert not calls
    for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(with_kernel, without):
        assert len(tokens) == 8 and tokens == ref_tokens
        if norm_sum_order()[1]:
            assert logprobs == ref_logprobs, "the norms' bits are the modules': so are the logits"
