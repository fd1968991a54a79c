"""CPU capability detection: it reports what this machine really runs, an AVX2-only CPU (simulated here by making
oneDNN's bf16 packing raise exactly as it does there) keeps bf16 linears on F.linear with the same tokens, and the
summary is logged once, as one line."""

import logging

import pytest
import torch
from transformers import GenerationConfig

from rollout import ContinuousBatchingConfig, LLMEngine
from rollout.engine.cpu.features import (
    ENV_UNPACKED_MAX_ROWS,
    UNPACKED_MAX_ROWS_INTEL,
    UNPACKED_MAX_ROWS_MKL_PACKED,
    CpuFeatures,
    KernelBuild,
    cpu_features,
    probe_packed_linear,
    unpacked_max_rows,
)
from rollout.engine.cpu.packed_linear import PACK_BATCH_HINT, PackedLinears
from tests.helpers.cpu import BF16_ERROR
from tests.helpers.models import random_prompts, run_engine, tiny_model

NEW = 8


def _packs_directly(dtype) -> bool:
    """Ask oneDNN ourselves, without the module under test."""
    try:
        w = torch.ones(4, 8, dtype=dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, PACK_BATCH_HINT)
        torch.ops.mkldnn._linear_pointwise(torch.ones(2, 8, dtype=dtype), packed, None, "none", [], "")
        return True
    except (RuntimeError, AttributeError):
        return False


def _engine(model, **config):
    return LLMEngine(model, GenerationConfig(max_new_tokens=NEW, do_sample=False),
                     ContinuousBatchingConfig(page_size=8, allow_block_sharing=False, **config))


def _greedy(engine, prompts):
    ids = engine.add_request(prompts[0]) + engine.add_request(prompts[1])
    done = run_engine(engine)
    return [done[i].generated_tokens for i in ids]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_detection_agrees_with_onednn_on_this_machine(fresh_detection, dtype):
    features = cpu_features()
    assert features.packs(dtype) == (torch.backends.mkldnn.is_available() and _packs_directly(dtype))
    assert features.packs(dtype) == (features.packing_error(dtype) == "")


def test_isa_flags_agree_with_torchs_cpu_capability():
    """ISA flags come from CPUID; torch's own kernel level implies some of them."""
    features = cpu_features()
    if features.torch_capability in ("AVX2", "AVX512"):
        assert {"avx2", "fma3"} <= features.isa
    if features.torch_capability == "AVX512":
        assert {"avx512_f", "avx512_bw", "avx512_vl", "avx512_dq"} <= features.isa
    assert features.torch_capability == torch.backends.cpu.get_cpu_capability()


def test_simulated_avx2_machine_is_detected(avx2_machine):
    features = cpu_features()
    assert features.packs(torch.float32) == torch.backends.mkldnn.is_available()
    assert not features.packs(torch.bfloat16)
    assert features.packing_error(torch.bfloat16) == BF16_ERROR
    assert features.onednn_bf16_device is False
    assert "bfloat16 no (" + BF16_ERROR in features.describe()
    assert probe_packed_linear(torch.bfloat16) == BF16_ERROR


def test_bf16_engine_on_an_avx2_machine_generates_the_unpacked_tokens(avx2_machine):
    """What failed on AVX2-only EPYCs: every bf16 forward raised from the packing. Now bf16 linears keep F.linear
    (a bf16 pack attempt would raise and fail the requests), and fp32 models are still packed."""
    prompts = random_prompts([11, 6], seed=7)
    model = tiny_model("qwen3").to(torch.bfloat16)
    auto = _engine(model)
    assert isinstance(auto.runner.linears, PackedLinears) and torch.bfloat16 not in auto.runner.linears.dtypes
    tokens = _greedy(auto, prompts)
    assert [len(t) for t in tokens] == [NEW, NEW]
    assert not auto.runner.linears._packs
    assert tokens == _greedy(_engine(model, prepack_weights=False), prompts)

    fp32 = _engine(tiny_model("qwen3"))
    _greedy(fp32, prompts)
    linears = [m for m in fp32.model.modules() if isinstance(m, torch.nn.Linear)]
    packed = fp32.runner.linears
    assert len(packed._packs) + sum(len(key) for key in packed._stacks) == len(linears)


def test_explicit_prepack_on_an_avx2_machine(avx2_machine):
    """prepack_weights=True asks for packing: for bf16 that this CPU cannot pack it is a ValueError saying so (and
    what to do); for fp32 it packs as before."""
    with pytest.raises(ValueError, match=r"cannot pack torch\.bfloat16 linear weights on this CPU \(oneDNN packs "
                                         r"bf16 only on CPUs with AVX-512.*avx512bw.*prepack_weights None"):
        _engine(tiny_model("qwen3").to(torch.bfloat16), prepack_weights=True)
    engine = _engine(tiny_model("qwen3"), prepack_weights=True)
    assert len(_greedy(engine, random_prompts([5, 9], seed=1))[0]) == NEW
    assert engine.runner.linears._packs


def test_summary_is_logged_once_as_one_line(fresh_detection, caplog):
    with caplog.at_level(logging.INFO, logger="rollout.engine.cpu.features"):
        for config in ({}, {"prepack_weights": False}):
            _engine(tiny_model("qwen3"), **config)
    lines = [r.getMessage() for r in caplog.records if r.name == "rollout.engine.cpu.features"]
    assert len(lines) == 1 and "\n" not in lines[0]
    features = cpu_features()
    assert lines[0] == "CPU fast paths: " + features.describe()
    assert f"torch CPU capability {features.torch_capability}" in lines[0]
    for dtype in ("float32", "bfloat16"):
        assert f"{dtype} yes" in lines[0] or f"{dtype} no (" in lines[0]
    assert f"attention kernel: {features.kernel.describe()}" in lines[0]


def test_describe_names_every_fallback_and_why():
    features = CpuFeatures(
        machine="x86_64", cpu_name="AMD EPYC 7702", isa=frozenset({"sse4_2", "avx2", "fma3"}),
        torch_capability="AVX2", onednn=True, onednn_bf16_device=False, packed_dtypes=frozenset({torch.float32}),
        packing_errors=(("bfloat16", BF16_ERROR),), silu_gate_dtypes=frozenset({torch.float32}),
        kernel=KernelBuild(True, march="native", isa="avx2", openmp=False), mkl_packed_reason="not an Intel CPU")
    assert features.describe() == (
        "x86_64 AMD EPYC 7702 [sse4_2 avx2 fma3]; torch CPU capability AVX2; oneDNN packed linear: float32 yes, "
        f"bfloat16 no ({BF16_ERROR}) [torch's bf16 device check agrees]; fp32 packed copies by MKL: no (not an Intel "
        "CPU); fused SiLU gate: float32; fp32 linears of small steps: packed; attention kernel: -march=native avx2, "
        "single-threaded (no OpenMP)")
    intel = CpuFeatures(
        machine="x86_64", cpu_name="Intel Xeon", isa=frozenset({"avx512_f"}), torch_capability="AVX512", onednn=True,
        onednn_bf16_device=True, packed_dtypes=frozenset({torch.float32, torch.bfloat16}),
        silu_gate_dtypes=frozenset({torch.float32}), unpacked_max_rows=2,
        kernel=KernelBuild(True, march="native", isa="avx512f", openmp=True), mkl_packed=True, mkl_packed_reason="")
    assert not intel.small_matmul  # MKL's copies serve the steps of a few rows
    assert ("fp32 packed copies by MKL: yes; fused SiLU gate: float32; fp32 linears of small steps: F.linear (MKL) "
            "up to 2 rows, packed otherwise;") in intel.describe()
    bare = CpuFeatures(machine="aarch64", cpu_name="", isa=frozenset(), torch_capability="DEFAULT", onednn=False,
                       onednn_bf16_device=None, packed_dtypes=frozenset(),
                       kernel=KernelBuild(False, reason="no C compiler found"))
    assert bare.describe() == ("aarch64 CPU [none of interest]; torch CPU capability DEFAULT; oneDNN packed linear: "
                               "unavailable (torch built without oneDNN); fp32 packed copies by MKL: no (not probed); "
                               "fused SiLU gate: no; fp32 linears of small steps: packed; attention kernel: "
                               "unavailable (no C compiler found)")


def test_small_steps_skip_the_packed_copies_on_intel_with_mkl_or_as_the_environment_says(monkeypatch):
    monkeypatch.delenv(ENV_UNPACKED_MAX_ROWS, raising=False)
    intel = UNPACKED_MAX_ROWS_INTEL if torch.backends.mkl.is_available() else 0
    assert unpacked_max_rows("Intel Xeon 2.60GHz") == intel
    assert unpacked_max_rows("Intel Xeon 2.60GHz", mkl_packed=True) == UNPACKED_MAX_ROWS_MKL_PACKED
    assert unpacked_max_rows("AMD EPYC 7702") == 0 and unpacked_max_rows("") == 0
    monkeypatch.setattr(torch.backends.mkl, "is_available", lambda: False)
    assert unpacked_max_rows("Intel Xeon 2.60GHz") == 0
    for value, rows in (("0", 0), (" 8 ", 8)):
        monkeypatch.setenv(ENV_UNPACKED_MAX_ROWS, value)
        assert unpacked_max_rows("AMD EPYC 7702") == rows and unpacked_max_rows("Intel Xeon") == rows
    for bad in ("-1", "four"):
        monkeypatch.setenv(ENV_UNPACKED_MAX_ROWS, bad)
        with pytest.raises(ValueError, match=rf"{ENV_UNPACKED_MAX_ROWS}=.*row count >= 0"):
            unpacked_max_rows("Intel Xeon")
