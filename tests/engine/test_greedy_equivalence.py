"""Greedy decoding through the engine equals model.generate token for token, whatever the batch shape."""

import pytest
from transformers import GenerationConfig

from rollout import ContinuousBatchingConfig, generate_batch
from tests.helpers.models import greedy_reference, random_prompts, tiny_model

MAX_NEW = 24
KINDS = ["llama", "qwen2", "qwen3", "mistral", "gpt2"]


def _prompts():
    prompts = random_prompts([3, 17, 40, 5, 64, 9, 9, 33], seed=1)
    prompts[6] = list(prompts[5])  # identical prompt: full prefix hit
    prompts[7] = prompts[4][:40] + [1, 2, 3]  # shares 40 tokens with another prompt
    return prompts


_REFS = {}


def _reference(kind, model, prompts):
    if kind not in _REFS:
        _REFS[kind] = [greedy_reference(model, p, MAX_NEW) for p in prompts]
    return _REFS[kind]


def _assert_matches(model, kind, config):
    prompts = _prompts()
    outputs = generate_batch(model, prompts, GenerationConfig(max_new_tokens=MAX_NEW, do_sample=False), config,
                             progress_bar=False)
    assert list(outputs) == [f"req_{i}" for i in range(len(prompts))]
    for (ref, safe), out in zip(_reference(kind, model, prompts), outputs.values()):
        assert out.error is None
        assert out.finish_reason == "length" and len(out.generated_tokens) == MAX_NEW
        assert safe >= MAX_NEW // 2, "reference has near-ties too early; the test would prove little"
        assert out.generated_tokens[:safe] == ref[:safe]


@pytest.fixture(scope="module", params=KINDS)
def model_kind(request):
    return request.param, tiny_model(request.param)


CONFIGS = {
    "page4-chunked": dict(page_size=4, max_batch_tokens=16),
    "page16": dict(page_size=16),
    "page4-no-sharing-prefill-first": dict(page_size=4, allow_block_sharing=False, scheduler_type="prefill_first"),
    "page16-tiny-cache-preempts": dict(page_size=16, num_blocks=12, max_batch_tokens=64),
    "page4-prefill-first-chunked": dict(page_size=4, max_batch_tokens=8, scheduler_type="prefill_first"),
    # the PyTorch attention path (page gathers + SDPA) and plain F.linear, as on a machine without a C compiler
    "page4-chunked-torch-path": dict(page_size=4, max_batch_tokens=16, cpu_attention_kernel=False,
                                     prepack_weights=False),
    "page16-tiny-cache-torch-path": dict(page_size=16, num_blocks=12, max_batch_tokens=64, cpu_attention_kernel=False),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_equals_generate(model_kind, name):
    kind, model = model_kind
    _assert_matches(model, kind, ContinuousBatchingConfig(**CONFIGS[name]))


@pytest.mark.parametrize("name, counter", [("page16-tiny-cache-preempts", "preemptions"),
                                           ("page4-chunked", "chunked_prefills"),
                                           ("page4-prefill-first-chunked", "chunked_prefills")])
def test_configs_really_exercise_their_path(name, counter):
    """The preemption and chunking configs above must actually take those paths."""
    from rollout.engine.engine import LLMEngine

    model = tiny_model("qwen3")
    engine = LLMEngine(model, GenerationConfig(max_new_tokens=MAX_NEW, do_sample=False),
                       ContinuousBatchingConfig(**CONFIGS[name]))
    for p in _prompts():
        engine.add_request(p)
    while engine.has_unfinished():
        engine.step()
        engine.check_invariants()
    stats = engine.stats()
    assert getattr(stats, counter) > 0
    assert stats.free_blocks == stats.num_blocks


def test_module_attention_implementation_is_restored(qwen3):
    before = qwen3.config._attn_implementation
    generate_batch(qwen3, [[1, 2, 3]], GenerationConfig(max_new_tokens=3, do_sample=False), progress_bar=False)
    assert qwen3.config._attn_implementation == before


def test_configs_take_the_attention_path_they_name():
    from rollout.engine.cpu.kernel import load_kernel
    from rollout.engine.engine import LLMEngine

    model = tiny_model("qwen3")
    for name, kwargs in CONFIGS.items():
        runner = LLMEngine(model, None, ContinuousBatchingConfig(**kwargs)).runner
        expect = load_kernel() is not None and kwargs.get("cpu_attention_kernel") is not False
        assert runner.use_kernel == expect, name
