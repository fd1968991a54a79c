"""KV cache sizing on CUDA (simulated: torch.cuda's memory queries are monkeypatched), the page size per kernels, and
memory given back when a manager is destroyed."""

import gc
import logging
import math
import weakref

import pytest
import torch
from transformers import GenerationConfig

from rollout import ContinuousBatchingConfig, ContinuousBatchingManager
from rollout.config import CUDA_DEFAULT_CACHE_FRACTION, CUDA_DEFAULT_CACHE_TOKENS, DEFAULT_PAGE_SIZE, FLASH_PAGE_SIZE
from rollout.engine.engine import LLMEngine, release_device_memory
from rollout.engine.worker import flash_backend
from rollout.rl.generator import RolloutGenerator
from rollout.sampling_params import SamplingParams
from tests.helpers.models import random_prompts, tiny_model

CUDA = torch.device("cuda", 0)
GB = 10**9
TOTAL = 141 * GB  # an H200
FREE = 120 * GB
PAGE = 16
KV_PER_TOKEN = 2 * 28 * 4 * 128 * 2  # a 7B model with 4 KV heads, bf16: 56 KiB per token
BLOCK = KV_PER_TOKEN * PAGE
VOCAB = 152064
# what one step needs at the least beside the cache: 64 KiB of activations per batch token, fp32 logits per row
STEP_AT_LEAST = 8192 * 64 * 1024 + 1024 * VOCAB * 4


@pytest.fixture
def h200(monkeypatch):
    """torch.cuda reports an H200 with `FREE` bytes free; set `memory["reserved"]` / `["allocated"]` to simulate
    torch's caching allocator holding memory no tensor uses."""
    memory = {"free": FREE, "reserved": 0, "allocated": 0}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (memory["free"], TOTAL))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: memory["reserved"])
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: memory["allocated"])
    return memory


def blocks(config=None, tokens_hint=None, block=BLOCK, **kw):
    config = config or ContinuousBatchingConfig(page_size=PAGE)
    return config.resolve_num_blocks(block, CUDA, tokens_hint, vocab_size=VOCAB, **kw)


def test_default_is_capped_by_the_cuda_token_budget(h200, caplog):
    with caplog.at_level(logging.INFO, logger="rollout.config"):
        n = blocks()
    assert n == CUDA_DEFAULT_CACHE_TOKENS // PAGE  # not 0.8 x 120 GB: a trainer on the same GPU keeps the rest
    assert n * BLOCK <= CUDA_DEFAULT_CACHE_FRACTION * TOTAL
    assert f"{n} blocks" in caplog.text and f"CUDA default of {CUDA_DEFAULT_CACHE_TOKENS} tokens" in caplog.text


def test_default_is_capped_by_a_share_of_the_device_for_large_kv_per_token(h200):
    block = 256 * 1024 * PAGE  # 256 KiB per token (a 32B model): the token budget alone would take 68 GB
    n = blocks(block=block)
    assert n * block <= CUDA_DEFAULT_CACHE_FRACTION * TOTAL < (n + 1) * block


def test_a_workload_hint_sizes_for_the_workload_beyond_the_default(h200):
    hint = 64 * 8 * (512 + 1024)  # 64 prompts x 8 samples x (prompt + completion)
    assert blocks(tokens_hint=hint) == math.ceil(hint / PAGE) + 1
    assert blocks(tokens_hint=hint) > CUDA_DEFAULT_CACHE_TOKENS // PAGE
    huge = blocks(tokens_hint=10**8)  # more than the GPU holds: the memory budget caps it
    assert huge * BLOCK <= 0.8 * FREE


def test_reserved_but_unallocated_memory_counts_as_free(h200):
    config = ContinuousBatchingConfig(page_size=PAGE, max_memory_percent=0.5)
    before = blocks(config)
    h200.update(reserved=30 * GB, allocated=10 * GB)  # the caching allocator holds 20 GB no tensor uses
    after = blocks(config)
    assert (after - before) * BLOCK == pytest.approx(0.5 * 20 * GB, abs=BLOCK)


def test_headroom_for_a_step_is_kept_even_at_max_memory_percent_one(h200):
    h200.update(free=20 * GB)
    usable = 20 * GB
    n = blocks(ContinuousBatchingConfig(page_size=PAGE, max_memory_percent=1.0))
    assert usable - n * BLOCK >= STEP_AT_LEAST
    assert n * BLOCK > usable - 4 * STEP_AT_LEAST  # and not much more than that is held back
    with_hint = blocks(ContinuousBatchingConfig(page_size=PAGE, max_memory_percent=1.0), tokens_hint=10**8)
    assert usable - with_hint * BLOCK >= STEP_AT_LEAST


def test_headroom_scales_with_max_batch_tokens(h200):
    h200.update(free=20 * GB)
    small = blocks(ContinuousBatchingConfig(page_size=PAGE, max_memory_percent=1.0, max_batch_tokens=1024))
    large = blocks(ContinuousBatchingConfig(page_size=PAGE, max_memory_percent=1.0, max_batch_tokens=65536))
    assert (small - large) * BLOCK >= (65536 - 1024) * 64 * 1024


def test_explicit_max_memory_percent_is_the_share_of_usable_memory(h200):
    h200.update(reserved=14 * GB, allocated=4 * GB)
    usable = FREE + 10 * GB
    for share in (0.3, 0.6):
        n = blocks(ContinuousBatchingConfig(page_size=PAGE, max_memory_percent=share))
        assert n * BLOCK <= share * usable < (n + 1) * BLOCK  # the explicit knob, not the default budget


def test_explicit_num_blocks_is_used_as_given(h200):
    for num_blocks in (3, 10**6):
        assert blocks(ContinuousBatchingConfig(page_size=PAGE, num_blocks=num_blocks), tokens_hint=100) == num_blocks


def test_no_room_left_gives_one_block_and_warns(h200, caplog):
    h200.update(free=GB // 2)
    with caplog.at_level(logging.WARNING, logger="rollout.config"):
        assert blocks() == 1
    assert "no memory left" in caplog.text


# ------------------------------------------------------------------ page size
@pytest.mark.parametrize(("device", "dtype", "flash", "expected"), [
    ("cuda", torch.bfloat16, True, FLASH_PAGE_SIZE),
    ("cuda", torch.float16, True, FLASH_PAGE_SIZE),
    ("cuda", torch.float32, True, DEFAULT_PAGE_SIZE["cuda"]),  # flash-attn cannot serve an fp32 cache
    ("cuda", torch.bfloat16, False, DEFAULT_PAGE_SIZE["cuda"]),
    ("cuda", None, True, DEFAULT_PAGE_SIZE["cuda"]),
    ("cpu", torch.bfloat16, True, DEFAULT_PAGE_SIZE["cpu"]),
])
def test_page_size_follows_the_kernels_present(device, dtype, flash, expected):
    assert ContinuousBatchingConfig().for_device(torch.device(device), dtype, flash).page_size == expected
    assert ContinuousBatchingConfig(page_size=64).for_device(torch.device(device), dtype, flash).page_size == 64


def test_small_cuda_page_without_flash_attn():
    assert DEFAULT_PAGE_SIZE["cuda"] <= 32 < FLASH_PAGE_SIZE == flash_backend.FLASH_PAGE_MULTIPLE


@pytest.mark.parametrize("have_flash", [True, False])
def test_engine_tells_the_config_whether_flash_attn_imports(monkeypatch, have_flash):
    seen = []
    original = ContinuousBatchingConfig.for_device

    def spy(self, device, dtype=None, flash_attn=False):
        seen.append((device.type, dtype, flash_attn))
        return original(self, device, dtype, flash_attn)

    monkeypatch.setattr(flash_backend, "HAVE_FLASH", have_flash)
    monkeypatch.setattr(ContinuousBatchingConfig, "for_device", spy)
    LLMEngine(tiny_model("qwen3"), None, ContinuousBatchingConfig(num_blocks=8))
    assert seen == [("cpu", torch.float32, have_flash)]


# ------------------------------------------------------------------ destroy
def _served_manager(config=None):
    manager = ContinuousBatchingManager(tiny_model("qwen3"), GenerationConfig(max_new_tokens=4, do_sample=False),
                                        config or ContinuousBatchingConfig(page_size=8, num_blocks=64))
    manager.start()
    assert manager.get_result(manager.add_request(random_prompts([6], seed=1)[0]), timeout=120) is not None
    return manager


@pytest.mark.parametrize("compile_level", [0, pytest.param(1, marks=pytest.mark.slow)])
def test_destroy_frees_the_kv_cache_before_giving_memory_back(monkeypatch, compile_level):
    """The compiled forward leaves a reference cycle to the cache: collected before memory goes back."""
    manager = _served_manager(ContinuousBatchingConfig(page_size=8, num_blocks=64, default_compile_level=compile_level))
    key = weakref.ref(manager.engine.cache.keys[0])
    given_back = []

    def release(device):
        gc.collect()
        given_back.append((device, key() is None))

    monkeypatch.setattr("rollout.manager.release_device_memory", release)
    manager.destroy()
    assert given_back == [(torch.device("cpu"), True)]  # nothing held the cache any more when memory went back


def test_generator_close_frees_the_kv_cache():
    config = ContinuousBatchingConfig(page_size=8, num_blocks=64)
    with RolloutGenerator(tiny_model("qwen3"), continuous_batching_config=config) as gen:
        gen.generate([random_prompts([5], seed=2)[0]], n=2, sampling_params=SamplingParams(max_new_tokens=4))
        refs = [weakref.ref(t) for t in (gen.manager.engine.cache.keys[0], gen.manager.engine.cache.values[-1])]
    gc.collect()
    assert [r() for r in refs] == [None, None]


def test_release_device_memory_empties_the_cuda_cache_only_on_cuda(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    release_device_memory(torch.device("cpu"))
    assert calls == []
    release_device_memory(CUDA)
    assert calls == ["empty_cache"]


# ------------------------------------------------------------------ hints
def test_rollout_generator_passes_its_tokens_hint():
    config = ContinuousBatchingConfig(page_size=8)
    with RolloutGenerator(tiny_model("qwen3"), continuous_batching_config=config, tokens_hint=1000) as gen:
        assert gen.manager.engine.pool.num_blocks == math.ceil(1000 / 8) + 1
    with RolloutGenerator(tiny_model("qwen3"), continuous_batching_config=config) as gen:
        assert gen.manager.engine.pool.num_blocks == 65536 // 8  # the CPU default budget
