"""CPU capability detection: it reports what this machine really runs, an AVX2-only CPU (simulated here by making
oneDNN's bf16 packing raise exactly as it does there) keeps bf16 linears on F.linear with the same tokens, and the
summary is logged once, as one line."""

import logging

import pytest
import torch
from transformers import GenerationConfig

from rollout import ContinuousBatchingConfig, LLMEngine
from rollout.engine.cpu.features import (
    ENV_BF16_VIA_FP32,
    ENV_UNPACKED_MAX_ROWS,
    SMALL_MATMUL_ROWS,
    CpuFeatures,
    KernelBuild,
    cpu_features,
    probe_packed_linear,
    small_matmul_rows,
    unpacked_max_rows,
)
from rollout.engine.cpu.linear_timing import (
    ENV_PROBE_SHAPE,
    PREFILL_ROWS,
    PROBE_IN,
    PROBE_OUT,
    Bf16Timings,
    LinearTimings,
    _probe_weights,
    probe_shape,
    small_kernel_rows,
)
from rollout.engine.cpu.mkl_packed import forced as mkl_packed_forced
from rollout.engine.cpu.packed_linear import PACK_BATCH_HINT, PackedLinears
from tests.helpers.cpu import BF16_ERROR
from tests.helpers.models import greedy_reference, random_prompts, run_engine, tiny_model

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


def test_bf16_engine_on_an_avx2_machine_generates_the_unpacked_tokens(avx2_machine, monkeypatch):
    """What failed on AVX2-only EPYCs: every bf16 forward raised from the packing. Now bf16 linears keep F.linear
    (a bf16 pack attempt would raise and fail the requests) unless their fp32 copies serve them (not here:
    ROLLOUT_BF16_VIA_FP32=0), and fp32 models are still packed."""
    monkeypatch.setenv(ENV_BF16_VIA_FP32, "0")
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


def test_bf16_engine_on_an_avx2_machine_runs_fp32_copies_where_asked(avx2_machine, monkeypatch):
    """Where the fp32 copies serve bf16 (ROLLOUT_BF16_VIA_FP32=1, or timed faster), an AVX2-only CPU packs bf16
    weights as fp32 copies, and greedy decoding gives F.linear's tokens up to the first near-tie."""
    monkeypatch.setenv(ENV_BF16_VIA_FP32, "1")
    model = tiny_model("qwen3", lm_head_scale=2.0).to(torch.bfloat16)
    engine = _engine(model, prepack_weights=True)  # bf16 is served here, so asking for packing is no error
    prompts = random_prompts([9, 5], seed=3)
    outputs = _greedy(engine, prompts)
    copies = engine.runner.linears._packs
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert len(copies) == len(linears) and {c.packed.dtype for c in copies.values()} == {torch.float32}
    for prompt, tokens in zip(prompts, outputs):
        ref, safe = greedy_reference(model, prompt, NEW)
        assert safe >= 2 and tokens[:safe] == ref[:safe]


def _bf16_timings(f_linear, via_fp32, onednn=None) -> Bf16Timings:
    """Bf16Timings with these seconds at rows 1, 2, 4, 8, 32."""
    rows = (1, 2, 4, 8, 32)
    seconds = {"f_linear": dict(zip(rows, f_linear)), "via_fp32": dict(zip(rows, via_fp32))}
    return Bf16Timings({**seconds, **({"onednn": dict(zip(rows, onednn))} if onednn else {})})


def test_bf16_route_is_chosen_by_the_clocks():
    """The fp32 copies serve bf16 where they beat every bf16 path by the margin at the batch rows; F.linear keeps the
    row counts below them where it beats the copies."""
    emulated = _bf16_timings(f_linear=[1.0, 1.3, 2.6, 3.8, 10.5], via_fp32=[1.2, 1.3, 1.3, 1.8, 3.5],
                             onednn=[0.8, 1.5, 2.0, 3.2, 9.9])  # an Ice Lake Xeon: no bf16 dot products
    assert emulated.via_fp32_wins() and emulated.copies() == "via_fp32" and emulated.unpacked_max_rows("via_fp32") == 1
    native = _bf16_timings(f_linear=[1.0, 1.1, 1.2, 1.3, 2.0], via_fp32=[1.2, 1.3, 1.3, 1.8, 3.5],
                           onednn=[0.8, 0.8, 0.9, 1.0, 1.5])  # bf16 dot products: oneDNN's bf16 copies win
    assert not native.via_fp32_wins() and native.copies() == "native" and native.unpacked_max_rows("native") == 0
    near_tie = _bf16_timings(f_linear=[1.0] * 5, via_fp32=[0.95] * 5)  # within the margin: bf16 stays
    assert not near_tie.via_fp32_wins() and near_tie.unpacked_max_rows("via_fp32") == 0


def test_the_small_rows_kernel_takes_bf16_rows_from_one_up_while_its_summed_times_win():
    """Against what serves those rows without it: the faster of the fp32 copies and F.linear on the fp32-copy route,
    oneDNN's bf16 copies otherwise; summed from 1 row up, by the margin."""
    small = {"small": dict(zip((1, 2, 4, 8), [0.6, 0.7, 0.9, 1.1]))}
    ice_lake = Bf16Timings({**_bf16_timings(f_linear=[0.74, 1.1, 2.7, 3.9, 10.3], via_fp32=[1.0, 1.1, 1.3, 1.7, 3.3],
                                            onednn=[0.75, 1.5, 2.1, 3.3, 9.9]).seconds, **small})
    assert ice_lake.via_fp32_wins() and ice_lake.kernel_max_rows("via_fp32") == 8
    slow_at_eight = Bf16Timings({**ice_lake.seconds, "small": {**small["small"], 8: 4.0}})
    assert slow_at_eight.kernel_max_rows("via_fp32") == 4  # summed to 8 rows: 6.2 against 4.45
    native = _bf16_timings(f_linear=[1.0] * 5, via_fp32=[1.2] * 5, onednn=[0.5, 0.5, 0.6, 0.6, 1.0])
    amx = Bf16Timings({**native.seconds, **small})  # bf16 dot products: oneDNN's bf16 copies, faster than the kernel
    assert not amx.via_fp32_wins() and amx.kernel_max_rows("native") == 0
    assert _bf16_timings(f_linear=[1.0] * 5, via_fp32=[1.0] * 5).kernel_max_rows("via_fp32") == 0  # not built


def _with_panels(timings: Bf16Timings, panels, prefill: dict[str, float]) -> Bf16Timings:
    """`timings` plus panels at rows 1, 2, 4, 8, 32 and every backend in `prefill` at PREFILL_ROWS."""
    seconds = {name: dict(by_rows) for name, by_rows in timings.seconds.items()}
    seconds["panels"] = dict(zip((1, 2, 4, 8, 32), panels))
    for name, s in prefill.items():
        seconds[name][PREFILL_ROWS] = s
    return Bf16Timings(seconds)


def test_bf16_panels_are_chosen_by_the_clocks():
    """The panels serve bf16 where they beat every other path by the margin at the batch rows and take at most 1.25x
    the fastest's time at a prefill chunk's rows (decode carries a rollout's time; no fp32 copy in RAM); the
    small-rows kernel then takes no rows, and F.linear only those where it beats the panels."""
    small = {"small": dict(zip((1, 2, 4, 8), [1.0, 1.06, 1.25, 1.97]))}
    ice_lake = Bf16Timings({**_bf16_timings(f_linear=[1.24, 1.78, 4.4, 6.9, 20.3], via_fp32=[2.6, 2.4, 2.6, 3.0, 5.5],
                                            onednn=[1.4, 2.6, 3.9, 6.1, 19.2]).seconds, **small})
    measured = _with_panels(ice_lake, [1.14, 1.17, 1.26, 1.35, 3.9], {"via_fp32": 28.5, "onednn": 142, "panels": 28.5})
    assert measured.panels_win() and measured.copies() == "panels"
    # faster summed to 2 rows (2.06 against 0.9 * 2.31), but the panels keep every row count
    assert measured.kernel_max_rows("panels") == 0 and measured.unpacked_max_rows("panels") == 0
    noisy_prefill = _with_panels(ice_lake, [1.14, 1.17, 1.26, 1.35, 3.9], {"via_fp32": 25.0, "panels": 28.5})
    assert noisy_prefill.panels_win()  # 1.14x the copies' time at 256 rows: within the slack
    slow_prefill = _with_panels(ice_lake, [1.14, 1.17, 1.26, 1.35, 3.9], {"via_fp32": 22.0, "panels": 28.5})
    assert not slow_prefill.panels_win() and slow_prefill.copies() == "via_fp32"  # 28.5 > 22 / 0.8
    near_tie = _with_panels(ice_lake, [1.14, 1.17, 1.26, 2.8, 5.2], {"via_fp32": 28.5, "panels": 28.5})
    assert not near_tie.panels_win()  # within the margin at 8 and 32 rows: the copies stay
    amx = _with_panels(_bf16_timings(f_linear=[1.0] * 5, via_fp32=[1.2] * 5, onednn=[0.5, 0.5, 0.6, 0.6, 1.0]),
                       [1.0, 1.0, 1.0, 1.0, 2.0], {"via_fp32": 20.0, "onednn": 6.0, "panels": 15.0})
    assert amx.copies() == "native"  # bf16 dot products: oneDNN's bf16 copies
    assert not ice_lake.panels_win()  # not built: not timed


@pytest.mark.parametrize("value", ["", "96x48", " 96X48 ", "96", "0x48", "ax48", "96x48x2"])
def test_the_probe_shape_switch(monkeypatch, value):
    """ROLLOUT_LINEAR_PROBE_SHAPE times smaller weights (an emulated CPU); a bad value says what it expects."""
    monkeypatch.setenv(ENV_PROBE_SHAPE, value)
    if value.strip().lower() not in ("", "96x48"):
        with pytest.raises(ValueError, match=r"ROLLOUT_LINEAR_PROBE_SHAPE=.*: expected OUTxIN, two positive sizes"):
            probe_shape()
        return
    shape = (PROBE_OUT, PROBE_IN) if not value else (96, 48)
    assert probe_shape() == shape
    weights, x = _probe_weights(torch.bfloat16)
    assert {tuple(w.shape) for w in weights} == {shape} and x.shape[1] == shape[1] and x.dtype == torch.bfloat16
    assert f"{shape[0]}x{shape[1]} bf16 linears" in Bf16Timings({"f_linear": {1: 1e-3}}).describe()


@pytest.mark.parametrize("value", ["0", "1", "yes"])
def test_bf16_route_switch(fresh_detection, monkeypatch, value):
    monkeypatch.setenv(ENV_BF16_VIA_FP32, value)
    if value == "yes":
        with pytest.raises(ValueError, match=r"ROLLOUT_BF16_VIA_FP32='yes': expected 0 .* 1 .* or unset"):
            assert cpu_features().bf16_via_fp32 is None  # raises first: the route is decided on first use
        return
    features = cpu_features()
    fp32_packs = features.packs(torch.float32)
    assert features.bf16_via_fp32 == (value == "1" and fp32_packs)
    assert (torch.bfloat16 in features.served_dtypes) == (features.packs(torch.bfloat16) or features.bf16_via_fp32)
    route = features.bf16_route
    assert route.unpacked_max_rows == route.kernel_max_rows == 0  # the switch: one path per route


def test_explicit_prepack_on_an_avx2_machine(avx2_machine, monkeypatch):
    """prepack_weights=True asks for packing: for bf16 that this CPU cannot pack (nor serve from fp32 copies) it is a
    ValueError saying so (and what to do); for fp32 it packs as before."""
    monkeypatch.setenv(ENV_BF16_VIA_FP32, "0")
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
        kernel=KernelBuild(True, march="native", isa="avx2", openmp=False),
        mkl_packed_reason="measured no faster than oneDNN's copies here")
    assert features.describe() == (
        "x86_64 AMD EPYC 7702 [sse4_2 avx2 fma3]; torch CPU capability AVX2; oneDNN packed linear: float32 yes, "
        f"bfloat16 no ({BF16_ERROR}) [torch's bf16 device check agrees]; fp32 packed copies by MKL: no (measured no "
        "faster than oneDNN's copies here); fused SiLU gate: float32; fp32 linears of small steps: packed; "
        "attention kernel: -march=native avx2, single-threaded (no OpenMP)")
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


def timings(f_linear, onednn, mkl=None):
    """LinearTimings with these seconds at rows 1, 2, 4, 8, 32."""
    rows = (1, 2, 4, 8, 32)
    seconds = {"f_linear": dict(zip(rows, f_linear)), "onednn": dict(zip(rows, onednn))}
    return LinearTimings({**seconds, **({"mkl": dict(zip(rows, mkl))} if mkl else {})})


def test_the_fp32_backends_are_chosen_by_their_clocks_not_the_vendor(monkeypatch):
    monkeypatch.delenv(ENV_UNPACKED_MAX_ROWS, raising=False)
    ice_lake = timings(f_linear=[8, 9, 12, 20, 60], onednn=[12, 12, 13, 16, 40], mkl=[10, 10, 10, 12, 30])
    assert ice_lake.mkl_wins() and unpacked_max_rows(ice_lake, mkl_packed=True) == 2
    assert unpacked_max_rows(ice_lake, mkl_packed=False) == 2
    generic_mkl = timings(f_linear=[10, 40, 40, 40, 60], onednn=[12, 13, 13, 16, 40], mkl=[11, 40, 40, 40, 55])
    assert not generic_mkl.mkl_wins() and unpacked_max_rows(generic_mkl) == 1
    near_tie = timings(f_linear=[11.5, 20, 20, 20, 60], onednn=[12, 12, 13, 16, 40], mkl=[12, 12, 13, 15, 38])
    assert not near_tie.mkl_wins() and unpacked_max_rows(near_tie) == 0, "a near-tie keeps the incumbent"
    no_mkl = timings(f_linear=[5, 5, 5, 20, 60], onednn=[12, 12, 13, 16, 40])
    assert not no_mkl.mkl_wins() and unpacked_max_rows(no_mkl) == 4
    assert unpacked_max_rows(None) == 0, "where fp32 is not packed nothing was timed"
    micro = timings(f_linear=[5e-6, 5e-6, 5e-6, 2e-5, 6e-5], onednn=[1.2e-5, 1.2e-5, 1.3e-5, 1.6e-5, 4e-5])
    assert "fp32 linears by rows: f_linear 1:5/2:5/4:5/8:20/32:60, onednn 1:12/" in micro.describe()


def test_the_small_rows_kernel_takes_one_and_two_rows_where_it_is_timed_faster():
    """On AVX-512 builds the kernel keeps 3-8 rows by rule and takes 1-2 where it beats F.linear and the copies."""
    amd = timings(f_linear=[24, 43, 38, 50, 84], onednn=[18, 21, 14, 21, 35])
    amd.seconds["small"] = {1: 14, 2: 13, 4: 30, 8: 40}
    assert amd.small_matmul_rows(mkl=False, by_rule=(3, 8)) == (1, 8) and amd.unpacked_max_rows(mkl=False) == 0
    only_two = timings(f_linear=[10, 43, 38, 50, 84], onednn=[18, 21, 14, 21, 35])
    only_two.seconds["small"] = {1: 14, 2: 13, 4: 30, 8: 40}
    assert only_two.small_matmul_rows(False, (3, 8)) == (2, 8), "F.linear keeps the one-row steps it wins"
    sgemv = timings(f_linear=[8, 9, 12, 20, 60], onednn=[12, 12, 13, 16, 40])
    sgemv.seconds["small"] = {1: 9, 2: 12, 4: 12, 8: 15}
    assert sgemv.small_matmul_rows(False, (3, 8)) == (3, 8)
    untimed = timings(f_linear=[1] * 5, onednn=[1] * 5)
    assert untimed.small_matmul_rows(False, (3, 8)) == (3, 8), "not built: not timed, the rule stands"
    assert untimed.small_matmul_rows(False, None) is None


def test_without_a_rule_the_small_rows_kernel_takes_rows_from_one_up_while_its_summed_times_win():
    """An AVX2 build serves 1 row up to the most timed rows where its time summed so far beats the best of F.linear
    and the copies summed, and nothing where it never does."""
    f_linear, onednn = [24, 43, 38, 50, 84], [18, 21, 14, 21, 35]  # the best of the two: 18, 21, 14, 21 at 1-8 rows
    cases = [({1: 14, 2: 13, 4: 10, 8: 18}, (1, 8)),  # as measured on a 2-core AVX2 EPYC
             ({1: 14, 2: 13, 4: 10, 8: 30}, (1, 4)),  # sums 14, 27, 37, 67 against 16.2, 35.1, 47.7, 66.6
             ({1: 17, 2: 17, 4: 10, 8: 30}, (1, 4)),  # a near-tie at 1 and 2 rows is carried by the sum at 4
             ({1: 30, 2: 30, 4: 30, 8: 30}, None)]
    for small, rows in cases:
        measured = timings(f_linear=f_linear, onednn=onednn)
        measured.seconds["small"] = small
        assert measured.small_matmul_rows(mkl=False, by_rule=None) == rows, small
    sgemv = timings(f_linear=[8, 9, 12, 20, 60], onednn=[18, 21, 14, 21, 35])
    sgemv.seconds["small"] = {1: 14, 2: 13, 4: 10, 8: 18}
    assert sgemv.small_matmul_rows(False, None) is None, "F.linear's sgemv at 1-2 rows is the one to beat"
    against_mkl = timings(f_linear=f_linear, onednn=onednn, mkl=[9, 9, 9, 9, 30])
    against_mkl.seconds["small"] = {1: 14, 2: 13, 4: 10, 8: 18}
    assert against_mkl.small_matmul_rows(mkl=True, by_rule=None) is None, "timed against the copies chosen"


def test_which_build_decides_the_rule_and_which_the_clocks():
    measured = timings(f_linear=[24, 43, 38, 50, 84], onednn=[18, 21, 14, 21, 35])
    measured.seconds["small"] = {1: 14, 2: 13, 4: 10, 8: 30}
    avx512, avx2 = KernelBuild(True, isa="avx512f"), KernelBuild(True, isa="avx2")
    assert small_matmul_rows(measured, avx512, mkl=False) == (1, 8)
    assert small_matmul_rows(measured, avx2, mkl=False) == (1, 4)
    assert small_matmul_rows(None, avx512, mkl=False) == SMALL_MATMUL_ROWS
    assert small_matmul_rows(None, avx2, mkl=False) is None
    assert small_matmul_rows(measured, KernelBuild(False, reason="no C compiler found"), mkl=False) is None
    assert small_kernel_rows(SMALL_MATMUL_ROWS) == (1, 2), "the rule's own rows are not timed at start-up"
    assert small_kernel_rows(None) == (1, 2, 4, 8)


def test_the_environment_overrides_the_small_step_rule(monkeypatch):
    fast_f_linear = timings(f_linear=[1, 1, 1, 20, 60], onednn=[12, 12, 13, 16, 40])
    for value, rows in (("0", 0), (" 8 ", 8)):
        monkeypatch.setenv(ENV_UNPACKED_MAX_ROWS, value)
        assert unpacked_max_rows(fast_f_linear) == rows and unpacked_max_rows(None, mkl_packed=True) == rows
    for bad in ("-1", "four"):
        monkeypatch.setenv(ENV_UNPACKED_MAX_ROWS, bad)
        with pytest.raises(ValueError, match=rf"{ENV_UNPACKED_MAX_ROWS}=.*row count >= 0"):
            unpacked_max_rows(None)


def test_this_cpu_was_timed_and_the_choice_follows_the_clocks(monkeypatch):
    monkeypatch.delenv(ENV_UNPACKED_MAX_ROWS, raising=False)
    features = cpu_features()
    if torch.float32 not in features.packed_dtypes:
        assert features.linear_timings is None
        return
    measured = features.linear_timings
    assert set(measured.seconds) >= {"f_linear", "onednn"} and all(
        s > 0 for by_rows in measured.seconds.values() for s in by_rows.values())
    assert features.unpacked_max_rows == unpacked_max_rows(measured, features.mkl_packed)
    if features.mkl_packed and not mkl_packed_forced():
        assert measured.mkl_wins()
