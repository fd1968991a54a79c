"""GPU paths: the CUDA SDPA path must be exact like the CPU one; flash-attn (when installed) must agree with
model.generate; the sampler and every logits processor run on CUDA logits and draw what the CPU draws; the KV cache
leaves the GPU room. Skipped on machines without CUDA (like CI); run them where a GPU is lent
(`python -m pytest tests/engine/worker/test_gpu.py`). Only the structured-output test needs xgrammar, and it is
skipped where xgrammar does not import."""

from __future__ import annotations

import copy
import gc
import math
import re
from itertools import pairwise

import pytest
import torch
from transformers import GenerationConfig, SuppressTokensLogitsProcessor

from rollout import ContinuousBatchingConfig, LLMEngine, SamplingParams, generate_batch
from rollout.engine.worker.flash_backend import HAVE_FLASH
from tests.helpers.models import VOCAB, greedy_reference, random_prompts, run_engine, tiny_model

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture
def exact_fp32():
    """fp32 matmuls in full precision (no TF32), so CUDA logits agree with the CPU's to ~1e-5."""
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(previous)


@cuda
@pytest.mark.parametrize("page_size", [16, 256])
def test_cuda_sdpa_greedy_equals_generate(page_size):
    model = tiny_model("qwen3").cuda()
    prompts = random_prompts([5, 40, 300, 17], seed=3)
    out = generate_batch(model, prompts, GenerationConfig(max_new_tokens=16, do_sample=False),
                         ContinuousBatchingConfig(page_size=page_size, max_batch_tokens=128), progress_bar=False)
    for p, o in zip(prompts, out.values()):
        ref, safe = greedy_reference(model, p, 16)
        assert safe > 0, "a near-tie at the first token: the comparison proves nothing"
        assert o.generated_tokens[:safe] == ref[:safe]


@cuda
@pytest.mark.skipif(not HAVE_FLASH, reason="needs flash-attn")
def test_flash_paged_kernels_agree_with_generate():
    model = tiny_model("llama").cuda().to(torch.bfloat16)
    prompts = random_prompts([5, 40, 300, 17], seed=4)
    config = ContinuousBatchingConfig(page_size=256, max_batch_tokens=256)
    out = generate_batch(model, prompts, GenerationConfig(max_new_tokens=8, do_sample=False), config,
                         progress_bar=False)
    agree = 0
    for p, o in zip(prompts, out.values()):
        ref, _ = greedy_reference(model, p, 8, tie_gap=0.05)
        agree += o.generated_tokens[:4] == ref[:4]
    assert agree >= 3  # bf16 kernels differ in summation order; near-ties may flip a token


# ----------------------------------------------------------------------------- processors and sampler on CUDA


def odd_tokens_banned(generated: list[int], row: torch.Tensor) -> torch.Tensor:
    """A request's own processor (a plain callable): it gets the row where the logits are, on CUDA here."""
    row = row.clone()
    row[1::2] = float("-inf")
    return row


@cuda
def test_cuda_logits_processors():
    """Built-in processors, a request's own callable and a transformers LogitsProcessor, applied to CUDA logits:
    what they forbid is never sampled, and where they only mask the logprob identity holds."""
    model = tiny_model("qwen3", seed=1, lm_head_scale=1.0).cuda()
    prompts = random_prompts([5, 40, 23], seed=3)
    suppressed = list(range(0, VOCAB, 4))  # with odd ids banned too, only ids = 2 mod 4 remain
    masked = SamplingParams(temperature=0.8, top_p=0.9, seed=1, max_new_tokens=12,
                            allowed_token_ids=list(range(0, VOCAB, 3)), logits_processors=[odd_tokens_banned])
    # every id these name is 2 mod 4, so each processor acts on tokens the two bans leave
    shaped = SamplingParams(temperature=1.0, seed=2, n=3, max_new_tokens=12, logit_bias={14: 4.0, 6: -100.0},
                            bad_words_ids=[[18], [22, 26]], repetition_penalty=1.3, min_new_tokens=12,
                            eos_token_id=[10, 30],
                            logits_processors=[SuppressTokensLogitsProcessor(suppressed, device="cuda"),
                                               odd_tokens_banned])
    greedy_masked = SamplingParams(temperature=0.0, max_new_tokens=8, bad_words_ids=[[t] for t in range(100)])
    out = generate_batch(model, prompts, GenerationConfig(), ContinuousBatchingConfig(page_size=16),
                         [masked, shaped, greedy_masked], progress_bar=False)
    assert len(out) == 5
    for rid, o in out.items():
        assert o.error is None, (rid, o.error)
        assert o.generated_tokens, rid
        if rid == "req_0":
            assert all(t % 6 == 0 for t in o.generated_tokens), o.generated_tokens  # allowed (3k) and even
            for lp, policy, kept in zip(o.logprobs, o.policy_logprobs, o.kept_logmass):
                assert abs(lp - (policy - kept)) < 1e-4  # masks and truncation only: the identity holds
                assert kept < 0  # the masks removed policy mass
        elif rid.startswith("req_1#"):
            toks = o.generated_tokens
            assert len(toks) == 12 and all(t % 4 == 2 for t in toks), toks
            assert not {6, 18, 10, 30} & set(toks), toks  # biased to -100, a bad word, EOS before min_new_tokens
            ends = o.prompt_ids[-1:] + toks  # each pair ending in a generated token
            assert (22, 26) not in set(pairwise(ends)), "bad word [22, 26] completed"
        else:
            assert all(t >= 100 for t in o.generated_tokens), o.generated_tokens
            assert o.logprobs == [0.0] * len(o.generated_tokens)
    samples = [out[f"req_1#{i}"].generated_tokens for i in range(3)]
    assert len({tuple(s) for s in samples}) > 1, "an n=3 group drew the same tokens three times"


@cuda
def test_cuda_structured_outputs():
    """xgrammar bitmasks applied to CUDA logits: every sample of a regex request matches it, a choice request gives
    one of its strings."""
    pytest.importorskip("xgrammar", reason="structured outputs need xgrammar (pip install 'rollout[structured]')")
    from tests.helpers.tokenizers import json_tokenizer

    tok = json_tokenizer()
    model = tiny_model("qwen3", seed=1, lm_head_scale=1.0, vocab_size=384).cuda()
    prompts = random_prompts([5, 40], seed=3, vocab=320)
    regex = r"\d{3}-[a-z]{2,4}"
    constrained = SamplingParams(temperature=1.0, seed=3, n=4, max_new_tokens=40, eos_token_id=1, regex=regex,
                                 logit_bias={5: 2.0}, bad_words_ids=[[7], [8, 9]])
    choice = SamplingParams(temperature=0.7, seed=4, max_new_tokens=20, eos_token_id=1, choice=["yes", "no", "maybe"],
                            logprobs=2)
    out = generate_batch(model, prompts, GenerationConfig(), ContinuousBatchingConfig(page_size=16),
                         [constrained, choice], progress_bar=False, tokenizer=tok)
    for rid, o in out.items():
        assert o.error is None, o.error
        text = tok.decode(o.generated_tokens, skip_special_tokens=True)
        if rid.startswith("req_0"):
            assert re.fullmatch(regex, text), text
        else:
            assert text in {"yes", "no", "maybe"}, text
            for lp, policy, kept in zip(o.logprobs, o.policy_logprobs, o.kept_logmass):
                assert abs(lp - (policy - kept)) < 1e-4  # the grammar only masks


def every_sampler_feature() -> list[SamplingParams]:
    """Greedy and seeded sampled requests that together use every sampler feature."""
    return [
        SamplingParams(temperature=0.0, max_new_tokens=12, logprobs=3),
        SamplingParams(temperature=0.0, max_new_tokens=12, repetition_penalty=1.4, logit_bias={3: 2.0}),
        SamplingParams(temperature=0.8, top_k=20, seed=11, max_new_tokens=16, logprobs=4),
        SamplingParams(temperature=1.0, top_p=0.85, seed=12, max_new_tokens=16),
        SamplingParams(temperature=1.2, min_p=0.05, seed=13, max_new_tokens=16, logprobs=2),
        SamplingParams(temperature=0.9, top_k=50, top_p=0.9, min_p=0.02, seed=14, n=3, max_new_tokens=16),
        SamplingParams(temperature=1.0, seed=15, max_new_tokens=16, repetition_penalty=1.3,
                       logit_bias={5: 3.0, 6: -100.0}),
        SamplingParams(temperature=1.0, seed=16, max_new_tokens=16, bad_words_ids=[[7], [8, 9], [20, 21, 22]]),
        SamplingParams(temperature=0.7, top_p=0.95, seed=17, max_new_tokens=16,
                       allowed_token_ids=list(range(0, VOCAB, 5))),
        SamplingParams(temperature=1.0, seed=18, max_new_tokens=16, min_new_tokens=10, eos_token_id=[0, 1, 2]),
    ]


def assert_same_draws(on_cuda: dict, on_cpu: dict, tol: float = 1e-4) -> None:
    """Sequence by sequence: the same tokens, and the same numbers for them. A sequence may leave the other at a
    near-tie (fp32 sums in another order can move a uniform across a CDF boundary, or a token across a top-p / min-p
    threshold); up to there everything must agree, and such a split must stay rare."""
    assert on_cuda.keys() == on_cpu.keys()
    split = []
    for rid in on_cpu:
        a, b = on_cuda[rid], on_cpu[rid]
        assert a.error is None and b.error is None, (rid, a.error, b.error)
        same = 0
        while same < min(len(a.generated_tokens), len(b.generated_tokens)) and \
                a.generated_tokens[same] == b.generated_tokens[same]:
            same += 1
        for name in ("logprobs", "policy_logprobs", "kept_logmass"):
            x, y = getattr(a, name)[:same], getattr(b, name)[:same]
            assert all(math.isclose(u, v, abs_tol=tol) for u, v in zip(x, y)), (rid, name, x, y)
        if b.top_logprobs is not None:
            for da, db in zip(a.top_logprobs[:same], b.top_logprobs[:same]):
                common = da.keys() & db.keys()
                assert len(common) >= len(db) - 1, (rid, da, db)  # near-equal alternatives may swap at the edge
                assert all(abs(da[t] - db[t]) < tol for t in common), (rid, da, db)
        if a.generated_tokens != b.generated_tokens:
            split.append((rid, same, a.generated_tokens, b.generated_tokens))
    assert len(split) <= 1, f"CUDA and CPU drew different tokens for more than a near-tie could explain: {split}"


@cuda
def test_cuda_sampler_draws_what_the_cpu_draws(exact_fp32):
    """Every sampler feature on CUDA logits; seeded and greedy requests draw what the same requests draw on a CPU
    copy of the fp32 model (seeded uniforms depend on (seed, position) alone, not on the device)."""
    cpu_model = tiny_model("qwen3", seed=2)
    cuda_model = copy.deepcopy(cpu_model).cuda()
    prompts = random_prompts([7, 33, 12, 50, 4, 19, 41, 9, 26, 15], seed=5)
    params = every_sampler_feature()
    config = ContinuousBatchingConfig(page_size=16)
    on_cuda = generate_batch(cuda_model, prompts, GenerationConfig(), config, params, progress_bar=False)
    on_cpu = generate_batch(cpu_model, prompts, GenerationConfig(), config, params, progress_bar=False)
    assert len(on_cpu) == 12
    assert_same_draws(on_cuda, on_cpu)
    group = [on_cuda[f"req_5#{i}"].generated_tokens for i in range(3)]
    assert len({tuple(g) for g in group}) > 1, "an n=3 group drew the same tokens three times"
    for rid, o in on_cuda.items():
        assert all(0 <= t < VOCAB for t in o.generated_tokens)
        assert all(math.isfinite(x) for x in o.logprobs + o.policy_logprobs + o.kept_logmass), rid
    # what each feature forbids is never drawn on CUDA
    assert 6 not in on_cuda["req_6"].generated_tokens
    ends = on_cuda["req_7"].prompt_ids[-1:] + on_cuda["req_7"].generated_tokens
    assert 7 not in on_cuda["req_7"].generated_tokens and (8, 9) not in set(pairwise(ends))
    assert all(t % 5 == 0 for t in on_cuda["req_8"].generated_tokens)
    assert not {0, 1, 2} & set(on_cuda["req_9"].generated_tokens[:10])
    assert len(on_cuda["req_0"].top_logprobs) == 12 and on_cuda["req_0"].raw_logprobs is not None
    # unseeded requests run on CUDA too (their draws come from the engine's generator, so only their validity is
    # checked)
    unseeded = generate_batch(cuda_model, prompts[:3], GenerationConfig(),
                              config, SamplingParams(temperature=1.0, top_k=30, max_new_tokens=8, n=2),
                              progress_bar=False)
    assert all(o.error is None and len(o.generated_tokens) == 8 for o in unseeded.values())


# ----------------------------------------------------------------------------- the KV cache's size on CUDA


def _free_cuda() -> None:
    """Give the memory of dropped engines back to the driver (a reference cycle may still hold one)."""
    gc.collect()
    torch.cuda.empty_cache()


def _usable() -> int:
    """Free device memory plus what torch's caching allocator holds with no tensor in it."""
    free, _ = torch.cuda.mem_get_info()
    return free + max(0, torch.cuda.memory_reserved() - torch.cuda.memory_allocated())


@cuda
def test_cuda_kv_cache_is_capped():
    """Without num_blocks (and without a workload hint) the cache takes well under the free GPU memory, so the step's
    activations and a trainer on the same GPU keep room; max_memory_percent caps it too, and a workload hint
    (generate_batch's) sizes it to the job."""
    model = tiny_model("qwen3").cuda()
    torch.cuda.empty_cache()
    free_before, _ = torch.cuda.mem_get_info()

    engine = LLMEngine(model, GenerationConfig(), ContinuousBatchingConfig())
    per_block = engine.cache.nbytes // engine.pool.num_blocks
    assert engine.cache.nbytes <= 0.5 * free_before, (engine.cache.nbytes, free_before)
    assert torch.cuda.mem_get_info()[0] >= 0.4 * free_before, "the KV cache took most of the free GPU memory"
    engine.add_request(random_prompts([9])[0], sampling_params=SamplingParams(temperature=0.0, max_new_tokens=4))
    run_engine(engine)
    del engine
    _free_cuda()

    usable = _usable()
    engine = LLMEngine(model, GenerationConfig(), ContinuousBatchingConfig(max_memory_percent=0.05))
    assert engine.cache.nbytes <= 0.05 * usable + per_block
    del engine
    _free_cuda()

    hinted = LLMEngine(model, GenerationConfig(), ContinuousBatchingConfig(page_size=256), tokens_hint=1000)
    assert hinted.pool.num_blocks <= math.ceil(1000 / 256) + 1
    assert hinted.cache.nbytes < 16 * 2**20  # a job of 1000 tokens reserves megabytes, not the GPU
