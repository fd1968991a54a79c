"""`max_blocks_per_request`: which decode-only steps take flash-attn's `flash_attn_with_kvcache` (the decode fast
path) rather than its varlen kernel. The kernels are stood in for (flash-attn does not install on these CPUs); what is
checked is the choice, the forced 0 for sliding models and the log lines, as transformers defines them."""

import logging

import pytest
import torch

from rollout import ContinuousBatchingConfig, LLMEngine
from rollout.engine.worker import flash_backend
from tests.helpers.models import tiny_model

PAGE = 256


def host_batch(query_lens, blocks_per_row):
    q, ctx = torch.tensor(query_lens), torch.tensor([PAGE * b for b in blocks_per_row])
    tables = torch.arange(len(query_lens) * max(blocks_per_row)).view(len(query_lens), -1)
    return flash_backend.flash_host_tensors(tables, q, ctx), q, ctx


@pytest.mark.parametrize("query_lens, widths, limit, fast", [
    ([1, 1], [3, 5], None, True),  # the default: any width
    ([1, 1], [3, 5], 5, True),
    ([1, 1], [3, 5], 4, False),  # the step's widest table does not fit the fast path's
    ([1, 1], [3, 5], 0, False),  # 0 turns it off
    ([1, 4], [3, 5], None, False),  # a mixed step always takes the varlen kernel
])
def test_the_fast_path_takes_decode_only_steps_whose_tables_fit(query_lens, widths, limit, fast):
    host, q, ctx = host_batch(query_lens, widths)
    assert flash_backend.build_flash_batch(host, q, ctx, limit).kv_cache_kernel is fast


def test_the_attention_calls_the_kernel_the_batch_chose(monkeypatch):
    calls = []
    monkeypatch.setattr(flash_backend, "flash_attn_with_kvcache",
                        lambda q, *a, **k: calls.append("kvcache") or q, raising=False)
    monkeypatch.setattr(flash_backend, "flash_attn_varlen_func",
                        lambda q, *a, **k: calls.append("varlen") or q, raising=False)
    cache = torch.zeros(4 * PAGE, 2, 8)
    for limit in (None, 0):
        host, q, ctx = host_batch([1, 1], [1, 2])
        out = flash_backend.flash_paged_attention(torch.zeros(2, 4, 8), cache, cache,
                                                  flash_backend.build_flash_batch(host, q, ctx, limit), PAGE, 1.0,
                                                  None, None)
        assert out.shape == (2, 4, 8)
    assert calls == ["kvcache", "varlen"]


def test_sliding_models_force_the_fast_path_off_and_say_why(caplog):
    with caplog.at_level(logging.INFO, logger="rollout.config"):
        assert ContinuousBatchingConfig(max_blocks_per_request=64).resolve_fast_path_blocks(True, sliding=True) == 0
    assert "decode fast path is off" in caplog.text and "the 64 set is ignored" in caplog.text
    assert ContinuousBatchingConfig().resolve_fast_path_blocks(True, sliding=False) is None
    assert ContinuousBatchingConfig(max_blocks_per_request=8).resolve_fast_path_blocks(True, sliding=False) == 8


def test_without_flash_attn_an_explicit_value_warns_that_it_does_nothing(caplog):
    with caplog.at_level(logging.WARNING, logger="rollout.config"):
        assert ContinuousBatchingConfig().resolve_fast_path_blocks(False, sliding=False) is None
        assert not caplog.text, "the default says nothing"
        assert ContinuousBatchingConfig(max_blocks_per_request=0).resolve_fast_path_blocks(False, False) is None
    assert "max_blocks_per_request=0 has no effect" in caplog.text and "flash_attn_with_kvcache" in caplog.text


def test_a_cpu_engine_accepts_the_field_and_reads_tables_of_any_width():
    engine = LLMEngine(tiny_model(), config=ContinuousBatchingConfig(max_blocks_per_request=4, num_blocks=8))
    assert engine.runner.fast_path_blocks is None


@pytest.mark.parametrize("value", [-1, 2.0, True, "8"])
def test_bad_max_blocks_per_request(value):
    with pytest.raises(ValueError, match="max_blocks_per_request must be None"):
        ContinuousBatchingConfig(max_blocks_per_request=value)
