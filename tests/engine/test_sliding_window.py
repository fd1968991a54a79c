"""Sliding-window models: greedy tokens equal model.generate well past the window, and a model whose every layer
slides holds only its window's KV (blocks behind it go back to the pool), so a sequence can outgrow the whole cache.
In a hybrid model (some layers full) each attention kind has block tables of its own: full layers keep every block,
sliding layers only their window's, and prefixes are cached for both."""

import pytest
import torch
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GenerationConfig,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from rollout import ContinuousBatchingConfig, LLMEngine, generate_batch
from rollout.engine.core.block_pool import hash_chain
from tests.helpers.models import COMMON, greedy, greedy_reference, random_prompts

WINDOW = 8
MAX_NEW = 40


def _scaled_head(model):
    """Clear argmax margins, as tests/helpers/models.py does for its tiny models."""
    with torch.no_grad():
        head = model.get_output_embeddings()
        head.weight = torch.nn.Parameter(head.weight.detach().clone() * 8.0)
        model.config.tie_word_embeddings = False
    return model.eval()


def sliding_model(kind: str):
    torch.manual_seed(0)
    if kind == "mistral":  # every layer slides
        return _scaled_head(MistralForCausalLM(MistralConfig(**{**COMMON, "sliding_window": WINDOW})))
    if kind == "qwen2-all-sliding":  # layers from max_window_layers on slide: all of them
        return _scaled_head(Qwen2ForCausalLM(Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=WINDOW,
                                                         max_window_layers=0)))
    if kind == "qwen2-hybrid":  # layer 0 full, layer 1 sliding
        return _scaled_head(Qwen2ForCausalLM(Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=WINDOW,
                                                         max_window_layers=1)))
    if kind == "qwen2-hybrid-3":  # layer 0 full, layers 1 and 2 sliding: kinds of different sizes
        return _scaled_head(Qwen2ForCausalLM(Qwen2Config(**{**COMMON, "num_hidden_layers": 3}, use_sliding_window=True,
                                                         sliding_window=WINDOW, max_window_layers=1)))
    if kind == "gemma2":  # alternating sliding and full layers, with attention softcapping
        return _scaled_head(Gemma2ForCausalLM(Gemma2Config(**{**COMMON, "head_dim": 16, "sliding_window": WINDOW})))
    if kind == "gemma3":  # five sliding layers, then a full one (each kind with its own rotary base)
        torch.manual_seed(1)  # seed 0 gives near-tied logits early in two of the test prompts
        return _scaled_head(Gemma3ForCausalLM(Gemma3TextConfig(**{**COMMON, "num_hidden_layers": 6, "head_dim": 16,
                                                                  "sliding_window": WINDOW})))
    raise ValueError(kind)


FULLY_SLIDING = ["mistral", "qwen2-all-sliding"]
HYBRID = ["qwen2-hybrid", "qwen2-hybrid-3", "gemma2", "gemma3"]
FULL_LAYERS = {"qwen2-hybrid": 1, "qwen2-hybrid-3": 1, "gemma2": 1, "gemma3": 1}
PATHS = {"kernel": {}, "torch-path": dict(cpu_attention_kernel=False, prepack_weights=False)}


@pytest.fixture(scope="module", params=FULLY_SLIDING + HYBRID)
def model_kind(request):
    return request.param, sliding_model(request.param)


@pytest.mark.parametrize("path", list(PATHS))
def test_greedy_equals_generate_past_the_window(model_kind, path):
    kind, model = model_kind
    prompts = random_prompts([3, 13, 30, 5], seed=2)
    config = ContinuousBatchingConfig(page_size=4, max_batch_tokens=16, **PATHS[path])
    out = generate_batch(model, prompts, GenerationConfig(max_new_tokens=MAX_NEW, do_sample=False), config,
                         progress_bar=False)
    for prompt, o in zip(prompts, out.values()):
        ref, safe = greedy_reference(model, prompt, MAX_NEW)
        assert o.error is None and safe >= MAX_NEW // 2
        assert o.generated_tokens[:safe] == ref[:safe], kind


def _decode_blocks(model, tokens: int, num_blocks: int = 256) -> tuple[int, object]:
    """The most blocks one sequence (a 20-token prompt, then `tokens` generated) holds while it decodes, and its
    output."""
    engine = LLMEngine(model, config=ContinuousBatchingConfig(page_size=4, num_blocks=num_blocks))
    engine.add_request(random_prompts([20], seed=3)[0], "long", greedy(tokens, ignore_eos=True))
    outputs, held = [], []
    while engine.has_unfinished():
        outputs += engine.step()
        engine.check_invariants()
        if engine.has_unfinished() and engine.requests["long"].num_generated > 1:  # decoding, past the prefill
            held.append(engine.pool.num_used)
    assert engine.pool.num_free == engine.pool.num_blocks, "a block leaked"
    return max(held), next(o for o in outputs if o.request_id == "long")


@pytest.mark.parametrize("kind", FULLY_SLIDING)
def test_a_fully_sliding_model_holds_a_window_of_blocks(kind):
    model = sliding_model(kind)
    held, out = _decode_blocks(model, 200)
    assert out.error is None and len(out.generated_tokens) == 200
    assert held == WINDOW // 4 + 1  # the pages the window spans, one of them partly (without reclaim: 55)
    # a cache far smaller than the sequence still serves it, with the same tokens
    small_held, small = _decode_blocks(model, 200, num_blocks=4)
    assert small.generated_tokens == out.generated_tokens and small_held <= 4


@pytest.mark.parametrize("kind", HYBRID)
def test_a_hybrid_model_keeps_full_layers_whole_and_sliding_layers_to_their_window(kind):
    model = sliding_model(kind)
    held, out = _decode_blocks(model, 60)
    groups = LLMEngine(model, config=ContinuousBatchingConfig(page_size=4, num_blocks=8)).kv_groups
    layers = model.config.num_hidden_layers
    assert groups.num_groups * groups.num_slots == layers  # these kinds split without padding
    sliding = sum(window is not None for window in groups.windows)
    assert groups.num_groups - sliding == FULL_LAYERS[kind] // groups.num_slots
    # 79 tokens: 20 blocks in each full group, the window's 3 in each sliding one (one table for all layers: 20
    # blocks of every layer, i.e. 20 * num_groups of these smaller blocks)
    assert out.error is None and held == 20 * (groups.num_groups - sliding) + 3 * sliding
    _, reference = _decode_blocks(model, 60, num_blocks=20 * groups.num_groups)
    assert reference.generated_tokens == out.generated_tokens


def test_kv_groups_of_a_hybrid_share_cache_tensors_slot_by_slot():
    engine = LLMEngine(sliding_model("gemma2"), config=ContinuousBatchingConfig(page_size=4, num_blocks=8))
    groups = engine.kv_groups
    assert groups.windows == (WINDOW, None) and groups.layer_group == (0, 1) and groups.layer_slot == (0, 0)
    assert engine.cache.keys[0] is engine.cache.keys[1] and len(engine.cache.tensors) == 2
    assert engine.cache.nbytes == 2 * (8 + 0) * 4 * 2 * 16 * 4  # K and V, 8 blocks of 4 tokens, 2 heads x 16, fp32


@pytest.mark.parametrize("kind", ["mistral", "gemma2", "gemma3"])
@pytest.mark.parametrize("path", list(PATHS))
def test_a_shared_prefix_hits_the_cache_of_every_group(path, kind):
    """A prompt sharing 30 tokens with one that ran before hits the prefix cache with every block of a full group and
    the blocks its window reads of a sliding one (the earlier ones were reclaimed and may be gone), and still
    generates model.generate's tokens."""
    model = sliding_model(kind)
    # room for every block each group publishes (Gemma 3's six groups publish 6 x 18): none is evicted
    engine = LLMEngine(model, config=ContinuousBatchingConfig(page_size=4, num_blocks=128, **PATHS[path]))
    shared = random_prompts([30], seed=5)[0]
    prompts = [shared + [1, 2], shared + [3, 4, 5]]
    outputs = {}
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, f"p{i}", greedy(MAX_NEW, ignore_eos=True))
        while engine.has_unfinished():
            outputs.update((o.request_id, o) for o in engine.step() if o.is_finished())
            engine.check_invariants()
    assert engine.stats().prefix_hit_tokens == 28  # 7 full shared blocks, of which a window reads 3
    for i, prompt in enumerate(prompts):
        ref, safe = greedy_reference(model, prompt, MAX_NEW)
        assert safe >= MAX_NEW // 2 and outputs[f"p{i}"].generated_tokens[:safe] == ref[:safe]


def test_a_hybrid_prefix_hit_needs_every_block_of_its_full_groups():
    """Once a shared prompt's first block is evicted, the sliding groups still hold what their window reads, but the
    full group cannot attend without it: no hit, and the tokens still equal model.generate's."""
    model = sliding_model("gemma2")
    engine = LLMEngine(model, config=ContinuousBatchingConfig(page_size=4, num_blocks=64))
    shared = random_prompts([30], seed=5)[0]
    engine.add_request(shared + [1, 2], "first", greedy(4, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    first_full_block = engine.pool.lookup(engine.scheduler.kv.group_key(hash_chain(shared, 4, 0)[0], 1))
    engine.pool.release([first_full_block])
    engine.pool.unregister([first_full_block])
    engine.add_request(shared + [3, 4, 5], "second", greedy(MAX_NEW, ignore_eos=True))
    out = []
    while engine.has_unfinished():
        out += engine.step()
        engine.check_invariants()
    assert engine.stats().prefix_hit_tokens == 0
    ref, safe = greedy_reference(model, shared + [3, 4, 5], MAX_NEW)
    assert safe >= MAX_NEW // 2 and out[-1].generated_tokens[:safe] == ref[:safe]
