"""CPU offload (`cpu_offload_space`): in a cache far smaller than the batch, preempted sequences' KV waits in a CPU
swap space and comes back, so nothing is recomputed, and the tokens are model.generate's."""

import pytest
import torch
from transformers import Gemma2Config, Gemma2ForCausalLM, MistralConfig, MistralForCausalLM

from rollout import ContinuousBatchingConfig, LLMEngine, SamplingParams
from rollout.engine.core.swap_space import PreemptionCosts
from rollout.engine.worker.kv_cache import HostKVStorage, KVShape, PagedKVCache
from tests.helpers.models import COMMON, greedy, greedy_reference, random_prompts, run_engine, tiny_model

MAX_NEW = 24
PATHS = {"kernel": {}, "torch-path": dict(cpu_attention_kernel=False, prepack_weights=False)}
ALWAYS_SWAP = dict(seconds_per_token=1.0, seconds_per_block=0.0, smoothing=0.0)  # pinned: timings cannot flip it


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen3")


def engine_for(model, num_blocks, offload=0.01, costs=ALWAYS_SWAP, **config):
    engine = LLMEngine(model, config=ContinuousBatchingConfig(page_size=4, num_blocks=num_blocks,
                                                              cpu_offload_space=offload, **config))
    if offload and costs is not None:
        engine.scheduler.kv.swap.costs = PreemptionCosts(**costs)
    return engine


def run(engine, prompts, params):
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, f"r{i}", params)
    return run_engine(engine)


@pytest.mark.parametrize("path", list(PATHS))
def test_preempted_sequences_swap_and_keep_greedy_parity(model, path):
    prompts = random_prompts([14, 9, 21, 6, 17, 11], seed=5)
    engine = engine_for(model, num_blocks=16, **PATHS[path])
    done = run(engine, prompts, greedy(MAX_NEW, ignore_eos=True))
    stats = engine.stats()
    assert stats.preemptions > 0 and stats.swapped_out_blocks > 0, "this cache is meant to force swapping"
    assert stats.swapped_in_blocks > 0 and stats.swap_free_blocks == stats.swap_blocks and stats.swapped == 0
    assert stats.prefill_tokens == sum(map(len, prompts)), "a swap recomputes nothing"
    for i, prompt in enumerate(prompts):
        ref, safe = greedy_reference(model, prompt, MAX_NEW)
        assert done[f"r{i}"].error is None and safe >= MAX_NEW // 2
        assert done[f"r{i}"].generated_tokens[:safe] == ref[:safe], f"r{i}"


def test_swapped_kv_gives_the_logprobs_of_a_cache_that_never_preempted(model):
    prompts = random_prompts([14, 9, 21, 6, 17, 11], seed=6)
    params = SamplingParams(temperature=1.0, seed=3, max_new_tokens=MAX_NEW, ignore_eos=True)
    roomy = run(engine_for(model, num_blocks=256, offload=0), prompts, params)
    swapping = engine_for(model, num_blocks=16)
    tight = run(swapping, prompts, params)
    assert swapping.stats().swapped_out_blocks > 0
    for rid, out in roomy.items():
        assert tight[rid].generated_tokens == out.generated_tokens, rid
        assert torch.allclose(torch.tensor(tight[rid].policy_logprobs), torch.tensor(out.policy_logprobs), atol=1e-5)


def test_without_room_to_swap_the_engine_recomputes_as_before(model):
    prompts = random_prompts([14, 9, 21, 6, 17, 11], seed=5)
    off = engine_for(model, num_blocks=16, offload=0)
    on = engine_for(model, num_blocks=16)
    expected = run(off, prompts, greedy(MAX_NEW, ignore_eos=True))
    got = run(on, prompts, greedy(MAX_NEW, ignore_eos=True))
    assert off.stats().prefill_tokens > on.stats().prefill_tokens
    assert {k: o.generated_tokens for k, o in got.items()} == {k: o.generated_tokens for k, o in expected.items()}
    assert off.scheduler.kv.swap is None and off.stats().swap_blocks == 0


def test_a_recomputing_weight_update_drops_swapped_kv(model):
    engine = engine_for(model, num_blocks=16)
    for i, prompt in enumerate(random_prompts([14, 9, 21, 6, 17, 11], seed=5)):
        engine.add_request(prompt, f"r{i}", greedy(MAX_NEW, ignore_eos=True))
    while not engine.stats().swapped:
        engine.step()
    engine.set_weight_version(1, recompute=True)
    stats = engine.stats()
    assert stats.swapped == 0 and stats.swap_free_blocks == stats.swap_blocks
    assert all(r.num_computed == 0 for r in engine.scheduler.waiting)
    done = run_engine(engine)
    assert all(o.error is None and len(o.generated_tokens) == MAX_NEW for o in done.values())
    assert all(o.weight_versions[-1] == 1 for o in done.values())


def test_a_sliding_model_swaps_only_the_window_it_holds():
    torch.manual_seed(0)
    model = MistralForCausalLM(MistralConfig(**{**COMMON, "sliding_window": 16})).eval()
    prompts = random_prompts([8, 8, 8], seed=7)
    engine = engine_for(model, num_blocks=10)  # each sequence comes to hold 5 blocks (its window's)
    done = run(engine, prompts, greedy(40, ignore_eos=True))
    stats = engine.stats()
    assert stats.swapped_out_blocks > 0 and stats.prefill_tokens == 24
    assert stats.swapped_out_blocks <= 5 * stats.preemptions, "only the blocks inside the window travel"
    for i, prompt in enumerate(prompts):
        ref, safe = greedy_reference(model, prompt, 40)
        assert done[f"r{i}"].generated_tokens[:safe] == ref[:safe]


@pytest.mark.parametrize("path", list(PATHS))
def test_a_hybrid_model_swaps_its_full_and_sliding_groups(path):
    torch.manual_seed(0)
    model = Gemma2ForCausalLM(Gemma2Config(**{**COMMON, "head_dim": 16, "sliding_window": 8})).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # clear argmax margins
    prompts = random_prompts([8, 8, 8], seed=7)
    engine = engine_for(model, num_blocks=24, **PATHS[path])  # 48 tokens: 12 full + 3 sliding blocks each
    done = run(engine, prompts, greedy(40, ignore_eos=True))
    stats = engine.stats()
    assert stats.preemptions > 0 and stats.swapped_in_blocks > 0 and stats.prefill_tokens == 24
    for i, prompt in enumerate(prompts):
        ref, safe = greedy_reference(model, prompt, 40)
        assert safe >= 20 and done[f"r{i}"].generated_tokens[:safe] == ref[:safe]


def test_the_swap_space_is_sized_from_the_config(model):
    engine = engine_for(model, num_blocks=16, offload=1 / 1024, costs=None)  # 1 MiB
    block_bytes = engine.cache.shape.bytes_per_token(torch.float32) * 4
    assert engine.scheduler.kv.swap.num_blocks == 2**20 // block_bytes
    assert engine.scheduler.kv.swap.costs == PreemptionCosts(), "the costs are learned, not pinned"
    tiny = engine_for(model, num_blocks=16, offload=1e-9, costs=None)
    assert tiny.scheduler.kv.swap is None, "a space smaller than one block turns offloading off"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocks_come_back_bit_for_bit_into_blocks_never_used_before(dtype):
    cache = PagedKVCache(KVShape(num_layers=2, num_kv_heads=2, head_dim=8), 4, 4, dtype, torch.device("cpu"))
    cache.prepare(torch.tensor([0, 1]))
    for t in cache.keys + cache.values:
        t[:8] = torch.randn(8, 2, 8).to(dtype)
    storage = HostKVStorage(cache, num_blocks=3)
    storage.copy_out([1, 0], [2, 0])
    storage.copy_in([0, 2], [3, 2])  # blocks 2 and 3 were never used: prepare() must not wipe them
    cache.prepare(torch.tensor([2, 3]))
    for t in cache.keys + cache.values:
        assert torch.equal(t[8:12], t[4:8]) and torch.equal(t[12:16], t[0:4])
