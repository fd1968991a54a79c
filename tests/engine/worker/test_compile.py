"""Compiled forward (default_compile_level 1-3): exact greedy tokens, inert padding, one graph per shape bucket with no
graph break, no recompilation in steady state or after a weight update, and config validation.

Compiling is the slow part (seconds per graph even for a 2-layer model), so the level-1 engine is built once per
module and shared by the tests that read it; engines with the same compile config share the compiled graphs.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from rollout import ContinuousBatchingConfig, RolloutGenerator
from rollout.engine.cpu import features
from rollout.engine.cpu.features import ENV_BF16_PANELS, ENV_BF16_VIA_FP32, Bf16Route
from rollout.engine.cpu.kernel import load_kernel
from rollout.engine.cpu.packed_linear import packing_available
from rollout.engine.engine import LLMEngine
from rollout.engine.worker.attention import paged_attention_op
from rollout.engine.worker.compiled_forward import InductorBackend
from rollout.sampling_params import SamplingParams
from tests.engine.test_sliding_window import sliding_model
from tests.helpers.models import greedy, greedy_reference, perturbed, random_prompts, run_engine, tiny_model

MAX_NEW = 12
# prompts of varied lengths, an identical pair (prefix hit) and a shared prefix; with max_batch_tokens=48 the long
# ones are chunked, so steps mix prefill chunks and decode rows in many token counts
PROMPT_LENGTHS = [3, 17, 40, 5, 64, 9, 9, 33]
BATCH_TOKENS = 48
PAGE = 8


def _prompts(seed: int = 1, lengths=PROMPT_LENGTHS) -> list[list[int]]:
    prompts = random_prompts(lengths, seed=seed)
    if len(prompts) > 7:
        prompts[6] = list(prompts[5])
        prompts[7] = prompts[4][:40] + [1, 2, 3]
    return prompts


def _engine(model, **config) -> LLMEngine:
    config = {"page_size": PAGE, "max_batch_tokens": BATCH_TOKENS, "num_blocks": 256, **config}
    return LLMEngine(model, None, ContinuousBatchingConfig(**config))


def _run(engine: LLMEngine, prompts, sampling: SamplingParams | None = None) -> list:
    sampling = sampling or greedy(MAX_NEW, ignore_eos=True)
    ids = [engine.add_request(p, sampling_params=sampling)[0] for p in prompts]
    done = run_engine(engine)
    return [done[i] for i in ids]


def _assert_greedy_matches(model, engine: LLMEngine, prompts) -> None:
    for prompt, out in zip(prompts, _run(engine, prompts)):
        ref, safe = greedy_reference(model, prompt, MAX_NEW)
        assert out.error is None and len(out.generated_tokens) == MAX_NEW
        assert safe >= MAX_NEW // 2, "reference has near-ties too early; the test would prove little"
        assert out.generated_tokens[:safe] == ref[:safe]


@pytest.fixture(scope="module", autouse=True)
def models():
    """Both model classes exist before anything compiles: transformers registers each new PreTrainedModel class in a
    global dict that the traced forward reads, so a class first built after warm-up recompiles each path once."""
    counters.clear()
    return {"qwen3": tiny_model("qwen3"), "llama": tiny_model("llama"), "gemma2": sliding_model("gemma2")}


@pytest.fixture(scope="module")
def qwen3_model(models):
    return models["qwen3"]


@pytest.fixture(scope="module")
def qwen3_level1(qwen3_model):
    """Level 1 over tiny Qwen3: decode-only and mixed steps share one dynamic callable (same compile config)."""
    engine = _engine(qwen3_model, default_compile_level=1)
    paths = engine.runner.compiled.paths
    assert set(paths) == {"varlen", "decode"} and paths["varlen"].fn is paths["decode"].fn
    return engine


def test_level1_greedy_equals_generate_qwen3(qwen3_model, qwen3_level1):
    before = qwen3_level1.runner.compiled.num_compiles
    _assert_greedy_matches(qwen3_model, qwen3_level1, _prompts())
    assert qwen3_level1.runner.compiled.num_compiles - before <= 1  # one dynamic graph for every step of the run
    assert not counters["graph_break"], f"graph breaks: {dict(counters['graph_break'])}"


def test_level1_greedy_equals_generate_llama(models):
    model = models["llama"]
    engine = _engine(model, default_compile_level=1)
    _assert_greedy_matches(model, engine, _prompts())
    assert engine.runner.compiled.num_compiles <= 1  # its own graph (none if an earlier Llama engine compiled it)
    assert not counters["graph_break"], f"graph breaks: {dict(counters['graph_break'])}"


def test_level1_hybrid_model_reads_each_groups_tables(models):
    """Gemma 2's sliding and full layers keep their pages in one cache tensor under two block tables: the compiled
    step hands each layer its group's slots and tables, past the window."""
    model = models["gemma2"]
    engine = _engine(model, default_compile_level=1)
    assert engine.kv_groups.num_groups == 2
    _assert_greedy_matches(model, engine, _prompts())
    assert not counters["graph_break"], f"graph breaks: {dict(counters['graph_break'])}"


def test_no_recompilation_in_steady_state(qwen3_model, qwen3_level1):
    """After the warm-up run, new prompt lengths, batch sizes and contexts (token counts 1..48, 1..9 rows, one
    request alone) reuse the one dynamic graph, with no graph break."""
    engine = qwen3_level1
    _run(engine, _prompts())  # warm (already, when the greedy test ran first)
    compiled = engine.runner.compiled
    before, graphs = compiled.num_compiles, counters["stats"]["unique_graphs"]
    for seed, lengths in ((2, [7, 30, 2, 51, 11]), (3, [1]), (4, [23, 4]), (5, [2, 3, 4, 5, 6, 7, 8, 9, 60])):
        _run(engine, _prompts(seed, lengths))
    assert compiled.num_compiles == before
    assert counters["stats"]["unique_graphs"] == graphs
    assert not counters["graph_break"]


def test_no_recompilation_after_a_weight_update(qwen3_model, qwen3_level1):
    """Weights updated in place (the engine's weight-update path): outputs follow the new weights at once and
    nothing is recompiled (the weights are graph inputs, not constants)."""
    engine = qwen3_level1
    prompts = _prompts(seed=6, lengths=[14, 5, 26])
    _run(engine, prompts)  # every shape class warm
    before = engine.runner.compiled.num_compiles
    original = {k: v.clone() for k, v in qwen3_model.state_dict().items()}
    new = perturbed(qwen3_model, seed=3, scale=0.5)
    try:
        with torch.no_grad():
            for name, param in qwen3_model.state_dict().items():
                param.copy_(new.state_dict()[name])
        engine.set_weight_version(engine.weight_version + 1)
        _assert_greedy_matches(new, engine, prompts)
        assert engine.runner.compiled.num_compiles == before
    finally:
        with torch.no_grad():
            for name, param in qwen3_model.state_dict().items():
                param.copy_(original[name])
        engine.set_weight_version(engine.weight_version + 1)


def test_steady_state_steps_call_the_graph_without_dynamo(qwen3_model, qwen3_level1, monkeypatch):
    """After one call through dynamo shows which graph serves the model, steps call that graph directly (no guard
    evaluation): dynamo's compiled function is not entered again, and the tokens still equal model.generate."""
    engine = qwen3_level1
    _run(engine, _prompts(seed=7, lengths=[12, 3]))  # both kinds of step have met the graph
    compiled = engine.runner.compiled
    assert compiled._direct, "no graph was taken for direct calls"
    through_dynamo = []
    for path in compiled.paths.values():
        fn = path.fn
        monkeypatch.setattr(path, "fn", lambda *args, _fn=fn: through_dynamo.append(1) or _fn(*args))
    _assert_greedy_matches(qwen3_model, engine, _prompts(seed=8, lengths=[21, 6, 35]))
    assert not through_dynamo


def test_direct_calls_read_a_replaced_weight(qwen3_model, qwen3_level1):
    """A weight replaced by a new tensor (not written in place) is read by the next direct call, as dynamo's
    guards would have made it: the inputs are read from the live model every step."""
    engine = qwen3_level1
    _run(engine, _prompts(seed=9, lengths=[10, 19]))
    assert engine.runner.compiled._direct
    prompts = _prompts(seed=12, lengths=[11, 18])  # not in the prefix cache (nor is the weight version bumped)
    layer = qwen3_model.model.layers[0].mlp.down_proj
    original = layer.weight
    try:
        layer.weight = torch.nn.Parameter(original.detach() * 3.0, requires_grad=False)
        reference = _run(_engine(qwen3_model), prompts)
        for out, ref in zip(_run(engine, prompts), reference):
            assert out.generated_tokens == ref.generated_tokens
    finally:
        layer.weight = original


@pytest.mark.skipif(not packing_available(torch.float32), reason="oneDNN cannot pack fp32 weights here")
def test_q_k_v_run_as_one_stacked_matmul_that_follows_a_replaced_weight(qwen3_model, qwen3_level1):
    """The compiled graph runs each layer's q, k and v projections (linears of one input) as one matmul over one
    packed copy of the three weights stacked, kept instead of (not beside) their own copies; a member replaced by a
    new tensor is restacked by the next step."""
    engine = qwen3_level1
    _run(engine, _prompts(seed=13, lengths=[20, 30]))  # steps of more rows than the small-rows kernel takes
    linears = engine.runner.linears
    attention = [layer.self_attn for layer in qwen3_model.model.layers]
    q_k_v = {(id(a.q_proj.weight), id(a.k_proj.weight), id(a.v_proj.weight)) for a in attention}
    mlps = [layer.mlp for layer in qwen3_model.model.layers]  # MKL's copies stack each gate and up projection too
    gate_up = {(id(m.gate_proj.weight), id(m.up_proj.weight)) for m in mlps} if linears.mkl else set()
    assert set(linears._stacks) == q_k_v | gate_up
    assert not any(id(a.q_proj.weight) in linears._packs for a in attention)
    layer = attention[0].q_proj
    original = layer.weight
    prompts = _prompts(seed=14, lengths=[11, 18])
    try:
        layer.weight = torch.nn.Parameter(original.detach() * 2.0, requires_grad=False)
        reference = _run(_engine(qwen3_model), prompts)
        for out, ref in zip(_run(engine, prompts), reference):
            assert out.generated_tokens == ref.generated_tokens
        assert (id(layer.weight), id(attention[0].k_proj.weight), id(attention[0].v_proj.weight)) in linears._stacks
    finally:
        layer.weight = original


def test_a_graph_that_no_longer_fits_goes_back_through_dynamo(qwen3_model, qwen3_level1, monkeypatch):
    """A direct call that fails (the graph's size asserts, say) drops that shortcut and the step runs through
    dynamo, with the same tokens."""
    engine = qwen3_level1
    prompts = _prompts(seed=10, lengths=[8, 27])
    expected = _run(engine, prompts)
    compiled = engine.runner.compiled
    assert compiled._direct
    calls = []

    def stale(self, frame):
        calls.append(1)
        raise AssertionError("expected size 4096==4095")

    monkeypatch.setattr(type(next(iter(compiled._direct.values()))[1]), "direct", stale)
    for out, ref in zip(_run(engine, prompts), expected):
        assert out.error is None and out.generated_tokens == ref.generated_tokens
    assert calls  # the shortcut was tried, failed, and was dropped (re-learning it fails the same way)
    assert not compiled._direct


def test_rollout_generator_weight_update_needs_no_recompilation(qwen3_model):
    """The public path: RolloutGenerator.update_weights copies new weights into its (copied) model; the next batch
    follows them with the graphs it already has."""
    prompts = _prompts(seed=11, lengths=[17, 25, 6])
    config = ContinuousBatchingConfig(page_size=PAGE, max_batch_tokens=BATCH_TOKENS, num_blocks=256,
                                      default_compile_level=1)
    new_model = perturbed(qwen3_model, seed=5, scale=0.5)
    sampling = greedy(MAX_NEW, ignore_eos=True)
    with RolloutGenerator(qwen3_model, continuous_batching_config=config) as gen:
        gen.generate(prompts, sampling_params=sampling)  # its copy's parameters need no grad: a graph of its own
        compiled = gen.manager.engine.runner.compiled
        before = compiled.num_compiles_in_process
        assert gen.update_weights(new_model) == 1
        batch = gen.generate(prompts, sampling_params=sampling)
        assert compiled.num_compiles_in_process == before
    for prompt, sample in zip(prompts, batch.samples):
        ref, safe = greedy_reference(new_model, prompt, MAX_NEW)
        assert safe >= MAX_NEW // 2 and sample.completion_ids[:safe] == ref[:safe]


def test_query_padding_changes_no_result(qwen3_model, qwen3_level1):
    """The same seeded samples (tokens, logprobs, prompt logprobs) with and without q padding: padding tokens never
    reach a real token's result. The padded engine's decode steps run their own callable, compiled with
    fullgraph=True (which raises on any graph break)."""
    sampling = SamplingParams(temperature=1.0, max_new_tokens=MAX_NEW, ignore_eos=True, seed=7, prompt_logprobs=0)
    prompts = _prompts(seed=8, lengths=[13, 6, 29, 3, 21])
    plain = _run(qwen3_level1, prompts, sampling)
    padded_engine = _engine(qwen3_model, default_compile_level=1, q_padding_interval_size=16,
                            kv_padding_interval_size=4 * PAGE,
                            decode_compile_config={"mode": "default", "dynamic": True, "fullgraph": True})
    paths = padded_engine.runner.compiled.paths
    assert paths["decode"].fn is not paths["varlen"].fn and paths["decode"].config["fullgraph"]
    padded = _run(padded_engine, prompts, sampling)
    for a, b in zip(plain, padded):
        assert a.generated_tokens == b.generated_tokens
        # bitwise equal on the machine this was written on; the margin allows a matmul whose blocking depends on
        # the row count (another CPU), never a padding token reaching a real row
        assert a.policy_logprobs == pytest.approx(b.policy_logprobs, abs=1e-6)
        assert a.prompt_logprobs[1:] == pytest.approx(b.prompt_logprobs[1:], abs=1e-6)
    assert padded_engine.runner.compiled.num_compiles == 1  # the decode callable; mixed steps reuse level 1's graph


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_level3_static_with_padding_equals_generate(models, kind):
    """Static token counts: every step's is padded to its bucket (2, 4, 8 or 16 tokens with q interval 16 and
    16-token steps), one graph per bucket serves the run, and a second run with other lengths compiles nothing new."""
    model = models[kind]
    engine = _engine(model, default_compile_level=3, q_padding_interval_size=16, max_batch_tokens=16)
    compiled = engine.runner.compiled
    assert all(p.static and p.q_interval == 16 for p in compiled.paths.values())
    _assert_greedy_matches(model, engine, _prompts(lengths=[3, 17, 40, 5, 9]))
    before = compiled.num_compiles
    assert 2 <= before <= 4  # kept rows and table sizes are dynamic dims: no graph per count of either
    _run(engine, _prompts(seed=9, lengths=[8, 21, 2, 11]))
    assert compiled.num_compiles == before


@pytest.mark.parametrize("via_fp32", ["0", "1", "kernel", "panels"],
                         ids=["bf16 copies", "fp32 copies", "small-rows kernel", "panels"])
def test_bf16_compiled_equals_eager(models, via_fp32, fresh_detection, monkeypatch):
    """bf16 rounds where eager rounds (inductor's emulate_precision_casts): the same tokens and logprobs as level 0,
    where plain inductor keeps fused intermediates in fp32 and samples other tokens. Also with bf16 linears on fp32
    copies at every row count (ROLLOUT_BF16_VIA_FP32=1), which are not stacked in compiled steps for that reason,
    with steps of up to 8 rows on the small-rows kernel over the bf16 weights (as a route timed faster sets it), and
    on panels (ROLLOUT_BF16_PANELS=1)."""
    if via_fp32 in ("kernel", "panels") and load_kernel() is None:
        pytest.skip("the C kernels do not build here")
    if via_fp32 == "kernel":
        monkeypatch.setattr(features, "_bf16_route",
                            lambda packed, *settings: Bf16Route(torch.float32 in packed, kernel_max_rows=8))
    elif via_fp32 == "panels":  # stacked in compiled steps: their rows' bits do not depend on the stack
        monkeypatch.setenv(ENV_BF16_PANELS, "1")
    else:
        monkeypatch.setenv(ENV_BF16_VIA_FP32, via_fp32)
    model = tiny_model("qwen3").to(torch.bfloat16)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=MAX_NEW, ignore_eos=True, seed=3)
    prompts = _prompts()
    eager = _run(_engine(model), prompts, sampling)
    compiled = _run(_engine(model, default_compile_level=1), prompts, sampling)
    for a, b in zip(eager, compiled):
        assert a.generated_tokens == b.generated_tokens
        assert a.policy_logprobs == pytest.approx(b.policy_logprobs, abs=1e-6)


def test_a_forward_that_fails_to_compile_runs_eagerly(qwen3_model, monkeypatch, caplog):
    """A backend error is logged once and that kind of step runs eagerly from then on; no request fails."""
    def explode(self, gm, example_inputs):
        raise RuntimeError("backend exploded")

    monkeypatch.setattr(InductorBackend, "__call__", explode)
    engine = _engine(qwen3_model, varlen_compile_config={"dynamic": True, "options": {"fallback_random": True}})
    with caplog.at_level("ERROR", logger="rollout.engine.worker.model_runner"):
        _assert_greedy_matches(qwen3_model, engine, _prompts()[:3])
    assert caplog.text.count("compiling the forward of Qwen3ForCausalLM failed") == 1
    assert "backend exploded" in caplog.text
    assert engine.runner.compiled.paths == {}


@pytest.mark.skipif(load_kernel() is None, reason="the C attention kernel cannot be built here")
@pytest.mark.parametrize("window, softcap", [(0, 0.0), (5, 0.0), (0, 30.0)])
def test_attention_op_torch_path_equals_kernel(window, softcap):
    """The op without the C kernel (per-row gathers + SDPA) attends exactly as the kernel does, including padding
    rows on the scratch page and rows no token uses."""
    g = torch.Generator().manual_seed(0)
    page, heads, kv_heads, dim = 4, 4, 2, 16
    query_lens, starts = [5, 1, 1, 3], [0, 6, 9, 2]  # a prefill, two decodes, a chunk after a prefix
    rows = torch.repeat_interleave(torch.arange(4), torch.tensor(query_lens))
    positions = torch.cat([torch.arange(s, s + n) for n, s in zip(query_lens, starts)])
    tables = torch.tensor([[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11], [12, 0, 0], [0, 0, 0]])
    rows, positions = torch.cat([rows, torch.tensor([4, 4])]), torch.cat([positions, torch.tensor([0, 0])])
    slots = tables[rows, positions // page] * page + positions % page
    tokens = len(rows)
    q = torch.randn(1, heads, tokens, dim, generator=g)
    k, v = torch.randn(1, kv_heads, tokens, dim, generator=g), torch.randn(1, kv_heads, tokens, dim, generator=g)
    outs = []
    for use_kernel in (True, False):
        g2 = torch.Generator().manual_seed(1)
        k_cache = torch.randn(13 * page, kv_heads, dim, generator=g2)
        v_cache = torch.randn(13 * page, kv_heads, dim, generator=g2)
        outs.append(paged_attention_op(q, k, v, k_cache, v_cache, slots, positions, rows, tables, page, 0.25, window,
                                       softcap, use_kernel))
        assert torch.equal(k_cache[slots[:-2]], k[0].transpose(0, 1)[:-2])
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kwargs, match", [
    (dict(default_compile_level=4), "default_compile_level must be an integer from 0"),
    (dict(default_compile_level=True), "default_compile_level must be an integer"),
    (dict(default_compile_level="1"), "default_compile_level must be an integer"),
    (dict(q_padding_interval_size=-1, default_compile_level=1), "q_padding_interval_size must be an integer >= 0"),
    (dict(kv_padding_interval_size=2.5, default_compile_level=1), "kv_padding_interval_size must be an integer"),
    (dict(q_padding_interval_size=64), "nothing is compiled. Set default_compile_level"),
    (dict(kv_padding_interval_size=64), "nothing is compiled"),
    (dict(varlen_compile_config={"mode": "fastest"}), r"'fastest' is not a torch.compile mode; use one of"),
    (dict(decode_compile_config={"dynamc": True}), r"unknown keys \['dynamc'\]"),
    (dict(decode_compile_config="max-autotune"), "must be None .* or a dict of torch.compile keywords"),
    (dict(varlen_compile_config={"dynamic": "yes"}), r"\['dynamic'\] must be True"),
    (dict(varlen_compile_config={"fullgraph": 1}), r"\['fullgraph'\] must be a bool"),
    (dict(varlen_compile_config={"backend": "nonsense"}), "is not a torch.compile backend"),
    (dict(varlen_compile_config={"backend": "eager", "mode": "max-autotune"}), "mode and options are inductor"),
])
def test_invalid_compile_settings_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ContinuousBatchingConfig(**kwargs)


def test_compile_settings_resolve_per_path():
    assert ContinuousBatchingConfig().compile_configs() == (None, None)
    level2 = ContinuousBatchingConfig(default_compile_level=2).compile_configs()
    assert level2[0] == level2[1] == {"mode": "max-autotune-no-cudagraphs", "dynamic": True, "fullgraph": False}
    assert ContinuousBatchingConfig(default_compile_level=3).compile_configs()[0]["dynamic"] is False
    only_decode = ContinuousBatchingConfig(decode_compile_config={"dynamic": False}, q_padding_interval_size=8)
    assert only_decode.compile_configs() == (None, {"dynamic": False})
    from transformers import CompileConfig

    converted = ContinuousBatchingConfig(varlen_compile_config=CompileConfig(dynamic=True)).varlen_compile_config
    assert converted["dynamic"] is True and converted["backend"] == "inductor"
    engine = LLMEngine(tiny_model("qwen3"), None, ContinuousBatchingConfig(page_size=PAGE, num_blocks=16))
    assert engine.runner.compiled is None and engine.cache.scratch_block is None  # level 0: eager, as before
