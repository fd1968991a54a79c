"""The eager forward off the CPU, checked without an accelerator: `meta` plays the device (tests/helpers/devices.py),
so a host sync raises, a device mix raises, and every copy of host data onto it is counted. Also on the CPU: the
folded-head attention forms equal the `enable_gqa` call they replace, and grouped prefill equals per-chunk prefill."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from rollout.engine.core.request import Request
from rollout.engine.core.step import StepPlan
from rollout.engine.sample.resolve import resolve_sampling
from rollout.engine.worker.attention import (
    AttentionBatch,
    PrefillSegment,
    _attend,
    _fold_heads,
    _positions_mask,
    paged_attention_forward,
)
from rollout.engine.worker.kv_cache import KVShape, PagedKVCache
from rollout.engine.worker.model_runner import ModelRunner
from tests.helpers.devices import ACCELERATOR, DeviceMixChecker, HostToDeviceCounter
from tests.helpers.models import tiny_model

PAGE = 8
DECODE = [(int(n), 1) for n in torch.linspace(4, 120, 24)]  # 24 rows spread wide enough for several buckets
# Chunks (computed, query): fresh prompts, continued prompts, and a long one that stays alone.
PREFILL = [(0, 20), (0, 25), (9, 8), (40, 30), (0, 3), (40, 35), (200, 64)]
PLANS = {"decode": DECODE, "mixed": DECODE[:16] + PREFILL, "prefill": PREFILL,
         "fresh": DECODE[:3] + [(0, 40)]}  # a lone first chunk: plain causal, no mask


def _plan(entries: list[tuple[int, int]], first_block: int = 1) -> StepPlan:
    """A step running `query` tokens of each request after its `computed` ones, blocks handed out in order."""
    plan, block = StepPlan(), first_block
    for i, (computed, query) in enumerate(entries):
        request = Request(f"r{i}", [t % 200 for t in range(computed + query)], resolve_sampling(None, None))
        request.num_computed = computed
        blocks = -(-(computed + query) // PAGE)
        request.block_tables = [list(range(block, block + blocks))]
        block += blocks
        plan.add(request, query)
    return plan


def _runner(device: torch.device, dtype: torch.dtype = torch.float32, kind: str = "qwen3") -> ModelRunner:
    model = tiny_model(kind).to(dtype).to(device)
    cache = PagedKVCache(KVShape.from_config(model.config), 256, PAGE, dtype, device)
    return ModelRunner(model, cache, prepack_weights=False, attention_kernel=False)


def _tensors(obj) -> list[torch.Tensor]:
    """Every tensor an input dict / AttentionBatch / metadata part holds (the cache's own storage aside)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, PagedKVCache):
        return [t for f in dataclasses.fields(obj) for t in _tensors(getattr(obj, f.name))]
    return []


@pytest.mark.parametrize("kind", list(PLANS))
@pytest.mark.parametrize("flash", [False, True])
def test_build_batch_puts_the_whole_step_on_the_device_in_one_copy(kind, flash):
    runner = _runner(ACCELERATOR)
    runner.use_flash = flash  # the flash metadata is built the same way without flash-attn installed
    for _ in range(2):  # the first step zeroes fresh blocks, the second finds them zeroed
        with DeviceMixChecker(), HostToDeviceCounter() as copies:
            inputs, keep = runner.build_batch(_plan(PLANS[kind]))
        assert len(copies.moves) == 1, copies.moves
        tensors = _tensors([inputs, keep])
        assert len(tensors) >= 6 and all(t.device == ACCELERATOR for t in tensors)
    batch = inputs["rollout_batch"]
    if flash:
        assert batch.flash is not None and batch.flash.block_tables.dtype == torch.int32
    elif kind in ("decode", "mixed"):
        assert len(batch.decode) >= 2  # every bucket's tensors travelled in the one copy
    if not flash and kind in ("mixed", "prefill"):
        assert batch.prefill_groups and batch.prefills  # grouped chunks and one left alone


def test_build_step_sends_the_compiled_inputs_in_one_copy():
    runner = _runner(ACCELERATOR)
    runner.compiled = type("Widths", (), {"table_width": staticmethod(lambda blocks, page: blocks)})()
    runner.cache.scratch_block = runner.cache.num_blocks - 1
    path = type("Path", (), {"q_interval": 64})()  # pads the tokens: a padding row on the scratch page
    with DeviceMixChecker(), HostToDeviceCounter() as copies:
        inputs, _ = runner.build_step(_plan(PLANS["mixed"]), path)
    assert len(copies.moves) == 1, copies.moves
    assert all(t.device == ACCELERATOR for t in _tensors([inputs["input_ids"], inputs["keep"], inputs["step"]]))


def test_kv_cache_prepare_and_fork_copy_send_at_most_one_tensor():
    cache = PagedKVCache(KVShape(4, 2, 8), 16, PAGE, torch.float32, ACCELERATOR)
    with DeviceMixChecker(), HostToDeviceCounter() as copies:
        cache.prepare(torch.tensor([1, 2, 2, 5]))  # one copy of the ids, whatever the number of layers
        cache.prepare(torch.tensor([1]))  # nothing fresh: nothing sent
        cache.copy_block(1, 7, 3)  # slices only
    assert len(copies.moves) == 1, copies.moves


@pytest.mark.parametrize("kind", list(PLANS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_eager_forward_on_the_device_never_syncs_and_keeps_sdpa_off_the_math_kernel(kind, dtype, monkeypatch):
    """A whole model forward on `meta`: any host sync in it (ours or transformers') raises. Every SDPA call must
    be one CUDA serves with a fused kernel: `enable_gqa` only without a mask and in half precision (flash), and
    K/V expanded to every query head only for what has no other fused form (a plain causal chunk in fp32)."""
    calls = []
    sdpa = F.scaled_dot_product_attention
    kv_heads = tiny_model("qwen3").config.num_key_value_heads

    def spy(q, k, v, attn_mask=None, *args, enable_gqa=False, **kwargs):
        calls.append((enable_gqa, attn_mask is not None, q.dtype, k.shape[1] > kv_heads))
        return sdpa(q, k, v, attn_mask, *args, enable_gqa=enable_gqa, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    runner = _runner(ACCELERATOR, dtype)
    plan = _plan(PLANS[kind])
    with DeviceMixChecker() as checked:
        logits = runner.run(plan)
    assert checked.calls > 100 and logits.device == ACCELERATOR and logits.shape[0] == len(plan.sample_rows)
    assert calls
    half = (torch.float16, torch.bfloat16)
    for gqa, masked, q_dtype, expanded in calls:
        assert not gqa or (not masked and q_dtype in half), calls
        assert not expanded or (not masked and q_dtype not in half), calls
    assert any(not masked for _, masked, _, _ in calls) == (kind == "fresh")


@pytest.mark.parametrize("window, softcap", [(None, None), (5, None), (None, 30.0), (7, 30.0)])
def test_paged_attention_on_the_device_with_windows_and_softcap(window, softcap):
    runner = _runner(ACCELERATOR)
    inputs, _ = runner.build_batch(_plan(PLANS["mixed"]))
    tokens = inputs["input_ids"].shape[1]
    heads, kv_heads, dim = 4, 2, 16
    q = torch.empty(1, heads, tokens, dim, device=ACCELERATOR)
    k = torch.empty(1, kv_heads, tokens, dim, device=ACCELERATOR)
    layer = type("Layer", (), {"layer_idx": 1})()
    with DeviceMixChecker():
        out, _ = paged_attention_forward(layer, q, k, k, None, rollout_batch=inputs["rollout_batch"],
                                         sliding_window=window, softcap=softcap)
    assert out.shape == (1, tokens, heads, dim) and out.device == ACCELERATOR


def _reference(q, k, v, mask, scale, softcap):
    """The call the folded forms replace: GQA by `enable_gqa` / repeated heads, mask over `[q, L]`."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = softcap * torch.tanh(q @ k.transpose(-1, -2) * scale / softcap)
    return scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v


@pytest.mark.parametrize("window, softcap", [(None, None), (40, None), (None, 20.0)])
def test_decode_with_folded_heads_equals_enable_gqa(window, softcap):
    g = torch.Generator().manual_seed(0)
    rows, heads, kv_heads, dim, width = 6, 16, 8, 64, 96
    q = torch.randn(1, rows, heads, dim, generator=g).transpose(1, 2)[0].transpose(0, 1).unsqueeze(2)
    k = torch.randn(rows, width, kv_heads, dim, generator=g).transpose(1, 2)  # the strides of a page gather
    v = torch.randn(rows, width, kv_heads, dim, generator=g).transpose(1, 2)
    lens = torch.tensor([1, 5, 33, 64, 90, 96])
    mask = _positions_mask(lens[:, None] - 1, torch.arange(width)[None, :], window)[:, None, None, :]
    folded = _attend(_fold_heads(q, kv_heads), k, v, mask, 0.125, softcap)  # [rows, KVH, groups, D]
    torch.testing.assert_close(folded.reshape(rows, heads, 1, dim), _reference(q, k, v, mask, 0.125, softcap),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window, softcap", [(None, None), (6, None), (None, 20.0)])
def test_prefill_chunk_with_folded_heads_equals_enable_gqa(window, softcap):
    g = torch.Generator().manual_seed(1)
    heads, kv_heads, dim, q_len, ctx = 8, 2, 16, 7, 19
    q = torch.randn(1, heads, q_len, dim, generator=g)
    k, v = torch.randn(2, 1, kv_heads, ctx, dim, generator=g)
    seg = PrefillSegment(3, 3 + q_len, torch.zeros(3, dtype=torch.long), ctx)
    folded = _attend(_fold_heads(q, kv_heads), k, v, seg.mask(window, heads // kv_heads), 0.25, softcap)
    torch.testing.assert_close(folded.reshape(1, heads, q_len, dim),
                               _reference(q, k, v, seg.mask(window), 0.25, softcap), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window, softcap", [(None, None), (9, None), (None, 25.0)])
def test_grouped_prefill_equals_per_chunk_prefill(window, softcap):
    """The accelerator's grouping (one padded call per group of chunks) on the CPU: the same output, row for row,
    as a call per chunk, padding rows and padded keys included."""
    g = torch.Generator().manual_seed(2)
    runner = _runner(torch.device("cpu"))
    runner.cache.prepare(torch.arange(runner.cache.num_blocks))  # no later step zeroes the random K/V below
    for t in runner.cache.keys + runner.cache.values:
        t.copy_(torch.randn(t.shape, generator=g))
    plan = _plan(PLANS["mixed"])
    tokens = plan.num_tokens
    q = torch.randn(1, tokens, 4, 16, generator=g).transpose(1, 2)
    k, v = torch.randn(2, 1, tokens, 2, 16, generator=g).transpose(2, 3)
    layer = type("Layer", (), {"layer_idx": 0})()
    outs = []
    for group in (False, True):
        runner.group_prefills = group
        batch: AttentionBatch = runner.build_batch(plan)[0]["rollout_batch"]
        assert bool(batch.prefill_groups) == group
        outs.append(paged_attention_forward(layer, q, k, v, None, rollout_batch=batch, sliding_window=window,
                                            softcap=softcap)[0])
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)


def test_cpu_steps_use_their_host_tensors_where_they_are():
    """The one copy is for accelerators: a CPU step neither concatenates nor copies its metadata."""
    runner = _runner(torch.device("cpu"))
    host = [torch.arange(3), torch.arange(4).view(2, 2)]
    assert runner._send(host) is host
    with HostToDeviceCounter() as copies:
        inputs, _ = runner.build_batch(_plan(PLANS["mixed"]))
    assert not copies.moves and inputs["rollout_batch"].decode[0].tokens.device.type == "cpu"
