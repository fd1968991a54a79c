"""MKL's packed sgemm for fp32 linears: F.linear's values at any row count and input stride, biases read and never
written, repacked in its own buffer after a weight update, and used by the engine's forward where cpu_features says
so (where it was timed faster than oneDNN's copies) or where asked, with the model's tokens."""

import pytest
import torch
import torch.nn.functional as F
from transformers import GenerationConfig

from rollout import ContinuousBatchingConfig, LLMEngine
from rollout.engine.cpu import mkl_packed
from rollout.engine.cpu.features import cpu_features, mkl_packed_reason, unpacked_max_rows
from rollout.engine.cpu.linear_timing import LinearTimings
from rollout.engine.cpu.mkl_packed import MklPackedWeight
from rollout.engine.cpu.packed_linear import PackedLinears, packing_available
from tests.helpers.models import greedy_reference, random_prompts, run_engine, tiny_model

needs_mkl = pytest.mark.skipif(not mkl_packed.available(),
                               reason=f"MKL's packed sgemm is unavailable: {mkl_packed.unavailable_reason()}")


@pytest.fixture
def fresh_switch():
    """The environment switch is read again in the test, and again after it."""
    mkl_packed.unavailable_reason.cache_clear()
    yield
    mkl_packed.unavailable_reason.cache_clear()


@needs_mkl
@pytest.mark.parametrize("shape", [(80, 48), (81, 50), (7, 300), (1, 16), (1024, 512)])
@pytest.mark.parametrize("bias", [True, False])
def test_packed_linear_equals_f_linear_at_any_row_count(shape, bias):
    torch.manual_seed(shape[0])
    out_features, in_features = shape
    weight = torch.randn(out_features, in_features) / in_features ** 0.5
    b = torch.randn(out_features) if bias else None
    b_before = None if b is None else b.clone()
    packed = MklPackedWeight(weight)
    x = torch.randn(300, in_features)
    for rows in (*range(1, 18), 64, 100, 299, 300):
        out = packed.linear(x[:rows], b)
        assert out.shape == (rows, out_features)
        assert torch.allclose(out, F.linear(x[:rows], weight, b), atol=1e-5, rtol=1e-5), rows
    assert b is None or torch.equal(b, b_before), "the bias must be read, never written"
    batched = packed.linear(x[:24].view(2, 3, 4, in_features), b)  # leading dims kept
    assert batched.shape == (2, 3, 4, out_features)
    assert torch.equal(batched.reshape(24, -1), packed.linear(x[:24], b))
    strided = torch.randn(9, in_features * 2)[:, ::2]
    assert torch.allclose(packed.linear(strided, b), F.linear(strided, weight, b), atol=1e-5, rtol=1e-5)
    assert packed.linear(x[:0], b).shape == (0, out_features)


@needs_mkl
def test_repack_writes_the_new_weight_into_the_same_buffer():
    weight = torch.randn(100, 31)
    packed = MklPackedWeight(weight)
    buffer = packed.buffer.data_ptr()
    x = torch.randn(6, 31)
    new = torch.randn(100, 31)
    packed.repack(new)
    assert packed.buffer.data_ptr() == buffer
    assert torch.equal(packed.linear(x), MklPackedWeight(new).linear(x))
    packed.repack(new.t().contiguous().t())  # a transposed view: its values, whatever the strides
    assert torch.equal(packed.linear(x), MklPackedWeight(new).linear(x))
    with pytest.raises(ValueError, match=r"repack of an fp32 \(100, 31\) pack with a torch.float32 weight of shape "
                                         r"\(31, 100\)"):
        packed.repack(new.t())


@needs_mkl
def test_only_2d_fp32_cpu_weights_are_packed():
    with pytest.raises(ValueError, match=r"MKL packs 2-D fp32 CPU weights, got torch\.bfloat16"):
        MklPackedWeight(torch.randn(4, 8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"got torch\.float32 \(8,\)"):
        MklPackedWeight(torch.randn(8))


def test_the_switch_turns_it_off_or_on_for_any_cpu(monkeypatch, fresh_switch):
    monkeypatch.setenv(mkl_packed.ENV_SWITCH, "0")
    assert mkl_packed.unavailable_reason() == "ROLLOUT_MKL_PACKED=0" and not mkl_packed.available()
    fp32 = frozenset({torch.float32})
    mkl_faster = LinearTimings({"f_linear": {8: 3.0, 32: 9.0}, "onednn": {8: 2.0, 32: 6.0},
                                "mkl": {8: 1.0, 32: 3.0}})
    onednn_faster = LinearTimings({"f_linear": {8: 3.0, 32: 9.0}, "onednn": {8: 1.0, 32: 3.0},
                                   "mkl": {8: 2.0, 32: 6.0}})
    assert mkl_packed_reason(fp32, mkl_faster) == "ROLLOUT_MKL_PACKED=0"
    monkeypatch.delenv(mkl_packed.ENV_SWITCH)
    mkl_packed.unavailable_reason.cache_clear()
    assert mkl_packed_reason(fp32, onednn_faster) == mkl_packed.unavailable_reason() or (
        "measured no faster than oneDNN's copies here (ROLLOUT_MKL_PACKED=1 uses it anyway)")
    assert mkl_packed_reason(frozenset(), mkl_faster) == "fp32 linears are not packed here"
    assert mkl_packed_reason(fp32, mkl_faster) == mkl_packed.unavailable_reason()
    monkeypatch.setenv(mkl_packed.ENV_SWITCH, "1")
    assert mkl_packed_reason(fp32, onednn_faster) == mkl_packed.unavailable_reason()
    monkeypatch.setenv(mkl_packed.ENV_SWITCH, "yes")
    with pytest.raises(ValueError, match=r"ROLLOUT_MKL_PACKED='yes': expected 0 .*, 1 .* or unset"):
        mkl_packed.forced()


@needs_mkl
def test_a_wrong_result_fails_the_probe(monkeypatch):
    real = MklPackedWeight.linear
    monkeypatch.setattr(MklPackedWeight, "linear", lambda self, x, bias=None: real(self, x, bias) * 1.001)
    assert mkl_packed.probe() == "the packed result differs from F.linear at 1 rows"
    monkeypatch.setattr(MklPackedWeight, "linear", lambda self, x, bias=None: real(self, x, None))  # bias dropped
    assert mkl_packed.probe() == "the packed result differs from F.linear at 1 rows"


def test_this_machine_uses_it_where_the_rule_says(fresh_detection):
    features = cpu_features()
    expected = mkl_packed_reason(features.packed_dtypes, features.linear_timings)
    assert features.mkl_packed == (expected == "")
    assert features.mkl_packed_reason == expected
    if features.mkl_packed:
        assert features.unpacked_max_rows == unpacked_max_rows(features.linear_timings, mkl_packed=True)
        assert not features.small_matmul
        assert torch.float32 in features.gate_dtypes
        assert "fp32 packed copies by MKL: yes" in features.describe()
    else:
        assert f"fp32 packed copies by MKL: no ({expected})" in features.describe()


def _assert_greedy(engine, model, prompts):
    ids = [engine.add_request(p)[0] for p in prompts]
    done = run_engine(engine)
    for prompt, request_id in zip(prompts, ids):
        ref, safe = greedy_reference(model, prompt, 10)
        assert done[request_id].generated_tokens[:safe] == ref[:safe]


def _copies(linears: PackedLinears) -> list:
    return [entry.packed for entry in (*linears._packs.values(), *linears._stacks.values())]


@needs_mkl
@pytest.mark.skipif(not packing_available(torch.float32), reason="torch built without oneDNN")
def test_the_engines_forward_runs_mkls_copies_with_the_models_tokens():
    """Forced on (whatever the CPU): fp32 linears run MKL's copies (gate and up as one stacked copy) except at the few
    rows where F.linear was timed faster; a weight update repacks each copy in its own buffer; greedy tokens are the
    model's own."""
    model = tiny_model("qwen3")
    engine = LLMEngine(model, GenerationConfig(max_new_tokens=10, do_sample=False),
                       ContinuousBatchingConfig(page_size=8, allow_block_sharing=False))
    engine.runner.linears = linears = PackedLinears(model, mkl=True)
    prompts = random_prompts([15, 4, 23], seed=5)
    _assert_greedy(engine, model, prompts)
    packs = _copies(linears)
    assert packs and all(isinstance(p, MklPackedWeight) for p in packs)
    mlp = model.model.layers[0].mlp
    assert (id(mlp.gate_proj.weight), id(mlp.up_proj.weight)) in linears._stacks
    with torch.inference_mode(), linears:
        limit = linears.unpacked_max_rows
        for rows in sorted({1, limit, limit + 1} - {0}):
            x = torch.randn(1, rows, model.config.intermediate_size)
            packed = linears.packed_for(x, mlp.down_proj.weight)
            assert (packed is None) == (rows <= limit), rows
            assert packed is None or isinstance(packed, MklPackedWeight)

    other = tiny_model("qwen3", seed=3)
    with torch.no_grad():
        for p, q in zip(model.parameters(), other.parameters()):
            p.data.copy_(q)  # bumps no version counter: the engine's weight update marks the copies stale
    engine.set_weight_version(1)
    _assert_greedy(engine, other, prompts)
    after = _copies(linears)
    assert len(after) == len(packs) and all(a is b for a, b in zip(after, packs)), "repacked in their own buffers"
