"""ContinuousBatchingConfig: device-dependent defaults and the fields that are rejected rather than ignored."""

import warnings

import psutil
import pytest
import torch

from rollout import ContinuousBatchingConfig
from rollout.config import DEFAULT_PAGE_SIZE, FLASH_PAGE_SIZE, UNIMPLEMENTED_FIELDS
from rollout.engine.engine import LLMEngine
from tests.helpers.models import tiny_model


def test_page_size_default_depends_on_the_device():
    config = ContinuousBatchingConfig()
    assert config.page_size is None
    assert config.for_device(torch.device("cpu")).page_size == DEFAULT_PAGE_SIZE["cpu"] == 32
    cuda = torch.device("cuda", 0)
    assert config.for_device(cuda, torch.bfloat16, flash_attn=True).page_size == FLASH_PAGE_SIZE == 256
    assert config.for_device(cuda, torch.bfloat16, flash_attn=False).page_size == DEFAULT_PAGE_SIZE["cuda"] == 16
    assert config.for_device(cuda).page_size == DEFAULT_PAGE_SIZE["cuda"]  # flash-attn unknown: the SDPA path's page
    assert config.page_size is None  # the caller's object is not changed
    assert ContinuousBatchingConfig(page_size=64).for_device(torch.device("cpu")).page_size == 64


def test_engine_resolves_the_default_page_size():
    engine = LLMEngine(tiny_model("qwen3"), None, ContinuousBatchingConfig(num_blocks=8))
    assert engine.cache.page_size == DEFAULT_PAGE_SIZE["cpu"]
    assert engine.stats().page_size == DEFAULT_PAGE_SIZE["cpu"]


@pytest.mark.parametrize("value", [0, 3, -8, 2.5, "32"])
def test_bad_page_size(value):
    with pytest.raises(ValueError, match="page_size must be an integer >= 4"):
        ContinuousBatchingConfig(page_size=value)


NON_DEFAULT = {
    "use_cuda_graph": True, "use_async_batching": False,
    "max_queue_size": 16, "per_request_processors": False,
}


def test_every_unimplemented_field_is_covered():
    assert set(NON_DEFAULT) == set(UNIMPLEMENTED_FIELDS)


@pytest.mark.parametrize("name", sorted(NON_DEFAULT))
def test_unimplemented_fields_are_rejected_when_set(name):
    with pytest.raises(ValueError, match=rf"ContinuousBatchingConfig\.{name}=.* is not supported"):
        ContinuousBatchingConfig(**{name: NON_DEFAULT[name]})
    default, _ = UNIMPLEMENTED_FIELDS[name]
    assert getattr(ContinuousBatchingConfig(**{name: default}), name) == default  # the default still constructs


@pytest.mark.parametrize("timeout", [0, -1.0, True, "300"])
def test_bad_cpu_group_timeout(timeout):
    with pytest.raises(ValueError, match=r"cpu_group_timeout must be the seconds .* \(> 0\) or None"):
        ContinuousBatchingConfig(cpu_group_timeout=timeout)


@pytest.mark.parametrize("timeout", [None, 0.5, 600])
def test_cpu_group_timeout_is_accepted(timeout):
    assert ContinuousBatchingConfig(cpu_group_timeout=timeout).cpu_group_timeout == timeout


@pytest.mark.parametrize("page_size", [0, 1, 3, -4])
def test_page_size_below_four_raises(page_size):
    with pytest.raises(ValueError, match="page_size"):
        ContinuousBatchingConfig(page_size=page_size)


def test_page_size_four_is_the_minimum():
    assert ContinuousBatchingConfig(page_size=4).page_size == 4
    assert ContinuousBatchingConfig().page_size is None  # resolved per device by the engine (tests/test_config.py)


def test_block_size_is_a_deprecated_alias_of_page_size():
    with pytest.warns(FutureWarning, match="block_size"):
        config = ContinuousBatchingConfig(block_size=16)
    assert config.page_size == 16
    with pytest.warns(FutureWarning), pytest.raises(ValueError, match="page_size"):
        ContinuousBatchingConfig(block_size=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ContinuousBatchingConfig(page_size=16)  # the new name warns about nothing


@pytest.mark.parametrize("name", ["lifo", "FIFO", "", None])
def test_unknown_scheduler_type_raises(name):
    with pytest.raises(ValueError, match="scheduler_type"):
        ContinuousBatchingConfig(scheduler_type=name)


def test_safety_margin_defaults_per_scheduler():
    assert ContinuousBatchingConfig().safety_margin == pytest.approx(0.15)
    assert ContinuousBatchingConfig(scheduler_type="fifo").safety_margin == pytest.approx(0.15)
    assert ContinuousBatchingConfig(scheduler_type="prefill_first").safety_margin == 0.0
    assert ContinuousBatchingConfig(scheduler_type="prefill_first", safety_margin=0.3).safety_margin == 0.3
    assert ContinuousBatchingConfig(safety_margin=0.0).safety_margin == 0.0
    for bad in (-0.1, 1.0, 2.0):
        with pytest.raises(ValueError, match="safety_margin"):
            ContinuousBatchingConfig(safety_margin=bad)


def test_max_batch_tokens_default_and_explicit():
    """The inferred budget is 512 on CPU (8192 on GPU, never below 256 when capped by memory); an explicit value is
    honoured as given, so tiny budgets can force chunked prefill."""
    cpu = torch.device("cpu")
    assert ContinuousBatchingConfig().resolve_batch_tokens(cpu) == 512
    assert ContinuousBatchingConfig(max_batch_tokens=16).resolve_batch_tokens(cpu) == 16
    assert ContinuousBatchingConfig(max_batch_tokens=1000).resolve_batch_tokens(cpu) == 1000
    with pytest.raises(ValueError, match="max_batch_tokens"):
        ContinuousBatchingConfig(max_batch_tokens=0)


@pytest.mark.parametrize("space", [-1.0, "8", True, [1]])
def test_bad_cpu_offload_space(space):
    with pytest.raises(ValueError, match="cpu_offload_space must be the CPU swap space in GiB"):
        ContinuousBatchingConfig(cpu_offload_space=space)


@pytest.mark.parametrize("share", [0.0, 1.5, -0.2, None, True])
def test_bad_cpu_offload_safety_threshold(share):
    with pytest.raises(ValueError, match=r"cpu_offload_space_safety_threshold must be a fraction .* in \(0, 1\]"):
        ContinuousBatchingConfig(cpu_offload_space_safety_threshold=share)


@pytest.fixture
def ram(monkeypatch):
    """psutil reports 10 GiB of RAM available."""
    memory = type("Memory", (), {"available": 10 * 2**30, "total": 16 * 2**30})
    monkeypatch.setattr(psutil, "virtual_memory", lambda: memory)


def test_the_swap_space_is_what_was_asked_for_within_the_safety_share_of_ram(ram, caplog):
    block = 2**20
    assert ContinuousBatchingConfig().resolve_swap_blocks(block) == 0, "off by default, as in transformers"
    assert ContinuousBatchingConfig(cpu_offload_space=2.0).resolve_swap_blocks(block) == 2048
    assert ContinuousBatchingConfig(cpu_offload_space=None).resolve_swap_blocks(block) == 8192  # 80% of 10 GiB
    half = ContinuousBatchingConfig(cpu_offload_space=None, cpu_offload_space_safety_threshold=0.5)
    assert half.resolve_swap_blocks(block, cache_bytes_in_ram=2 * 2**30) == 4096, "a CPU cache's RAM is not free"
    with caplog.at_level("WARNING", logger="rollout.config"):
        assert ContinuousBatchingConfig(cpu_offload_space=64.0).resolve_swap_blocks(block) == 8192
    assert "64.00 GiB asked for" in caplog.text and "using that" in caplog.text
