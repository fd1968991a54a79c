"""The paged K/V storage: shapes from configs, slot arithmetic, lazy zeroing, copy-on-fork, storage that never moves."""

import pytest
import torch
from transformers import GPT2Config, Qwen3Config

from rollout.engine.worker.kv_cache import KVShape, PagedKVCache


def _cache(num_blocks=6, page=4, dtype=torch.float32, layers=2, kv_heads=2, head_dim=8):
    return PagedKVCache(KVShape(layers, kv_heads, head_dim), num_blocks, page, dtype, torch.device("cpu"))


def test_shape_from_configs_and_bytes_per_token():
    qwen = KVShape.from_config(Qwen3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                           num_hidden_layers=3))
    assert (qwen.num_layers, qwen.num_kv_heads, qwen.head_dim) == (3, 2, 32)  # an explicit head_dim wins
    gpt2 = KVShape.from_config(GPT2Config(n_embd=64, n_head=4, n_layer=2))
    assert (gpt2.num_layers, gpt2.num_kv_heads, gpt2.head_dim) == (2, 4, 16)  # no GQA: kv heads = heads
    assert qwen.bytes_per_token(torch.float32) == 2 * 3 * 2 * 32 * 4
    assert qwen.bytes_per_token(torch.bfloat16) == 2 * 3 * 2 * 32 * 2


def test_storage_sizes_and_nbytes():
    cache = _cache(num_blocks=6, page=4)
    assert all(k.shape == (24, 2, 8) for k in cache.keys + cache.values)
    assert cache.nbytes == 6 * 4 * KVShape(2, 2, 8).bytes_per_token(torch.float32)


def test_write_puts_each_token_at_its_slot():
    cache = _cache()
    slots = torch.tensor([5, 0, 13])  # block 1 offset 1, block 0 offset 0, block 3 offset 1
    key, value = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    cache.write(1, slots, key, value)
    assert torch.equal(cache.keys[1][slots], key) and torch.equal(cache.values[1][slots], value)


def test_write_converts_to_the_cache_dtype():
    cache = _cache(dtype=torch.bfloat16)
    cache.write(0, torch.tensor([2]), torch.ones(1, 2, 8), torch.full((1, 2, 8), 3.0))
    assert cache.keys[0].dtype == torch.bfloat16 and cache.values[0][2].eq(3).all()


def test_prepare_zeroes_only_fresh_blocks_once():
    cache = _cache(num_blocks=4, page=4)
    for t in cache.keys + cache.values:
        t.fill_(float("nan"))  # what torch.empty may hold
    cache.prepare(torch.tensor([1, 1, 2]))
    assert cache.keys[0][4:12].eq(0).all() and cache.values[1][4:12].eq(0).all()
    assert cache.keys[0][:4].isnan().all() and cache.keys[0][12:].isnan().all(), "untouched blocks stay unmapped"
    cache.write(0, torch.tensor([5]), torch.ones(1, 2, 8), torch.ones(1, 2, 8))
    cache.prepare(torch.tensor([1]))  # already prepared: written K/V must survive
    assert cache.keys[0][5].eq(1).all()


@pytest.mark.parametrize("num_tokens, copied", [(2, 2), (None, 4)])
def test_copy_block_copies_every_layer_and_prepares_the_target(num_tokens, copied):
    cache = _cache(num_blocks=4, page=4)
    for layer in range(2):
        cache.write(layer, torch.arange(4, 8), torch.randn(4, 2, 8), torch.randn(4, 2, 8))
    cache.copy_block(1, 3, num_tokens)
    for t in cache.keys + cache.values:
        assert torch.equal(t[12:12 + copied], t[4:4 + copied])
    cache.prepare(torch.tensor([3]))  # a later step's prepare must not wipe the copy
    assert torch.equal(cache.keys[0][12:12 + copied], cache.keys[0][4:4 + copied])


def test_storage_never_moves():
    cache = _cache()
    before = cache.data_ptrs()
    cache.prepare(torch.arange(6))
    cache.write(0, torch.tensor([1]), torch.ones(1, 2, 8), torch.ones(1, 2, 8))
    cache.copy_block(0, 2)
    assert cache.data_ptrs() == before and len(before) == 4
