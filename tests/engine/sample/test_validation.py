"""Bad input fails only the request that carries it, with an error naming the request and the problem; the rest of
the batch completes, nothing is lost and no KV block leaks. Also: a cache too small for a prompt.
"""

from __future__ import annotations

import math

import pytest
from transformers import GenerationConfig

from rollout import (
    ContinuousBatchingConfig,
    RequestStatus,
    SamplingParams,
    generate_batch,
)
from rollout.engine.engine import LLMEngine
from tests.helpers.models import VOCAB, greedy, random_prompts, run_engine

MAX_POSITIONS = 512  # tests/models.py
NEW = 5



# (prompt, params, words the error must contain)
BAD = {
    "empty prompt": ([], greedy(), ["empty"]),
    "negative id": ([5, -1, 3], greedy(), ["-1", "vocabulary"]),
    "id == vocab": ([5, VOCAB, 3], greedy(), [str(VOCAB), "vocabulary"]),
    "id far above vocab": ([10**6], greedy(), [str(10**6), "vocabulary"]),
    "prompt too long": (list(range(1, 200)) * 3, greedy(), ["597", "positions"]),
    "prompt exactly max positions": ([7] * MAX_POSITIONS, greedy(), [str(MAX_POSITIONS), "positions"]),
    "negative temperature": ([1, 2, 3], SamplingParams(temperature=-0.5), ["temperature", "-0.5"]),
    "top_p zero": ([1, 2, 3], SamplingParams(temperature=1.0, top_p=0.0), ["top_p"]),
    "top_p above one": ([1, 2, 3], SamplingParams(temperature=1.0, top_p=1.5), ["top_p", "1.5"]),
    "top_p nan": ([1, 2, 3], SamplingParams(temperature=1.0, top_p=math.nan), ["top_p"]),
    "top_k negative": ([1, 2, 3], SamplingParams(temperature=1.0, top_k=-1), ["top_k", "-1"]),
    "min_p negative": ([1, 2, 3], SamplingParams(temperature=1.0, min_p=-0.1), ["min_p", "-0.1"]),
    "min_p above one": ([1, 2, 3], SamplingParams(temperature=1.0, min_p=1.5), ["min_p", "1.5"]),
    "max_new_tokens negative": ([1, 2, 3], SamplingParams(max_new_tokens=-1), ["max_new_tokens", "-1"]),
    "repetition_penalty zero": ([1, 2, 3], SamplingParams(repetition_penalty=0.0), ["repetition_penalty"]),
    "repetition_penalty tiny": ([1, 2, 3], SamplingParams(repetition_penalty=1e-300), ["repetition_penalty"]),
    "repetition_penalty inf": ([1, 2, 3], SamplingParams(repetition_penalty=math.inf), ["repetition_penalty"]),
    "temperature below the floor": ([1, 2, 3], SamplingParams(temperature=1e-300), ["temperature", "0.01"]),
    "temperature inf": ([1, 2, 3], SamplingParams(temperature=math.inf), ["temperature", "finite"]),
    "temperature beyond float32": ([1, 2, 3], SamplingParams(temperature=1e39), ["temperature", "finite"]),
    "min_new above max_new": ([1, 2, 3], SamplingParams(max_new_tokens=3, min_new_tokens=4), ["min_new_tokens"]),
    "seed not an int": ([1, 2, 3], SamplingParams(temperature=1.0, seed=1.5), ["seed"]),
}


def _mixed_batch():
    """Good prompts interleaved with every bad one: (prompts, params, {index: (words, n)}, [good indices])."""
    good = random_prompts([4, 9, 17, 6, 30], seed=13)
    prompts, params, bad, good_idx = [], [], {}, []
    for i, (prompt, p, words) in enumerate(BAD.values()):
        if i < len(good):
            good_idx.append(len(prompts))
            prompts.append(good[i])
            params.append(greedy())
        bad[len(prompts)] = words
        prompts.append(prompt)
        params.append(p)
    # A bad n-sample group fails every one of its samples.
    bad[len(prompts)] = ["top_k"]
    prompts.append([1, 2, 3])
    params.append(SamplingParams(n=3, top_k=-2))
    return prompts, params, bad, good_idx


def _check_mixed(outputs, prompts, bad, good_idx, model):
    for i, words in bad.items():
        ids = [f"req_{i}"] if f"req_{i}" in outputs else [f"req_{i}#{j}" for j in range(3)]
        for rid in ids:
            assert rid in outputs, f"{rid} was lost"
            out = outputs[rid]
            assert out.status == RequestStatus.FAILED and out.finish_reason == "error", rid
            assert out.generated_tokens == []
            assert f"'{rid}'" in out.error, f"the error must name the request: {out.error}"
            for word in words:
                assert word in out.error, f"{rid}: {word!r} missing from {out.error!r}"
    alone = generate_batch(model, [prompts[i] for i in good_idx], sampling_params=greedy(), progress_bar=False)
    for i, ref in zip(good_idx, alone.values()):
        out = outputs[f"req_{i}"]
        assert out.status == RequestStatus.FINISHED and out.error is None
        assert out.generated_tokens == ref.generated_tokens and len(out.generated_tokens) == NEW


def test_bad_requests_fail_alone_in_generate_batch(qwen3):
    prompts, params, bad, good_idx = _mixed_batch()
    outputs = generate_batch(qwen3, prompts, sampling_params=params, progress_bar=False)
    assert len(outputs) == len(prompts) + 2  # the n=3 group has three ids
    _check_mixed(outputs, prompts, bad, good_idx, qwen3)


def test_bad_requests_leave_no_blocks_behind(qwen3):
    prompts, params, bad, good_idx = _mixed_batch()
    engine = LLMEngine(qwen3, GenerationConfig(), ContinuousBatchingConfig(page_size=8, num_blocks=40))
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(prompt, request_id=f"req_{i}", sampling_params=p)
    outputs = run_engine(engine)
    assert len(outputs) == len(prompts) + 2
    _check_mixed(outputs, prompts, bad, good_idx, qwen3)


def test_longest_allowed_prompt_is_accepted(qwen3):
    """max_position_embeddings - 1 prompt tokens leave room for exactly one new token."""
    out = generate_batch(qwen3, [[3] * (MAX_POSITIONS - 1)], sampling_params=greedy(), progress_bar=False)["req_0"]
    assert out.status == RequestStatus.FINISHED and out.finish_reason == "length"
    assert len(out.generated_tokens) == 1


@pytest.mark.parametrize("n", [0, -2])
def test_invalid_n_fails_the_request_instead_of_dropping_it(qwen3, n):
    outputs = generate_batch(qwen3, [[1, 2, 3], [4, 5, 6]], sampling_params=[greedy(), greedy(n=n)],
                             progress_bar=False)
    assert outputs["req_0"].status == RequestStatus.FINISHED
    assert "req_1" in outputs, "the request with n < 1 was silently dropped"
    assert outputs["req_1"].status == RequestStatus.FAILED and "n must be" in outputs["req_1"].error


def test_fractional_token_id_fails_the_request(qwen3):
    outputs = generate_batch(qwen3, [[1, 2.7, 3], [4, 5, 6]], sampling_params=greedy(), progress_bar=False)
    assert outputs["req_1"].status == RequestStatus.FINISHED
    assert outputs["req_0"].status == RequestStatus.FAILED and "'req_0'" in outputs["req_0"].error


def test_duplicate_request_id_is_refused_and_the_original_completes(qwen3):
    engine = LLMEngine(qwen3, GenerationConfig(), ContinuousBatchingConfig(page_size=8, num_blocks=16))
    assert engine.add_request([1, 2, 3], request_id="a", sampling_params=greedy()) == ["a"]
    with pytest.raises(ValueError, match="'a'"):
        engine.add_request([4, 5, 6], request_id="a", sampling_params=greedy())
    engine.add_request([4, 5, 6], request_id="g", sampling_params=greedy(n=2))
    with pytest.raises(ValueError, match="request id 'g' is already in use"):
        engine.add_request([7], request_id="g", sampling_params=greedy(n=2))
    with pytest.raises(ValueError, match="request id 'g#1' is already in use"):
        engine.add_request([7], request_id="g#1", sampling_params=greedy())
    assert engine.cancel("no-such-request") == []
    outputs = run_engine(engine)
    assert sorted(outputs) == ["a", "g#0", "g#1"]
    assert outputs["a"].prompt_ids == [1, 2, 3] and len(outputs["a"].generated_tokens) == NEW
    assert all(o.status == RequestStatus.FINISHED for o in outputs.values())


# ---------------------------------------------------------------------------------------------- a tiny cache


def test_prompt_too_big_for_the_cache_fails_alone(qwen3):
    # 4 blocks of 4 tokens: 16 slots. A 20-token prompt can never fit; the others can (one at a time).
    prompts = [random_prompts([5], seed=1)[0], random_prompts([20], seed=2)[0], random_prompts([3], seed=3)[0],
               random_prompts([9], seed=4)[0]]
    params = [greedy(max_new_tokens=4), greedy(), greedy(max_new_tokens=6), greedy(max_new_tokens=3)]
    outputs = generate_batch(qwen3, prompts, sampling_params=params, progress_bar=False,
                             continuous_batching_config=ContinuousBatchingConfig(page_size=4, num_blocks=4))
    failed = outputs["req_1"]
    assert failed.status == RequestStatus.FAILED and failed.finish_reason == "error"
    assert "'req_1'" in failed.error and "num_blocks" in failed.error
    ref = generate_batch(qwen3, [prompts[i] for i in (0, 2, 3)], sampling_params=[params[i] for i in (0, 2, 3)],
                         progress_bar=False)
    for i, r in zip((0, 2, 3), ref.values()):
        out = outputs[f"req_{i}"]
        assert out.status == RequestStatus.FINISHED and out.generated_tokens == r.generated_tokens


def test_sequence_that_outgrows_the_cache_fails_alone_without_leaks(qwen3):
    engine = LLMEngine(qwen3, GenerationConfig(), ContinuousBatchingConfig(page_size=4, num_blocks=4))
    engine.add_request(random_prompts([20], seed=2)[0], request_id="too-long-prompt", sampling_params=greedy())
    engine.add_request([1, 2, 3, 4, 5, 6, 7, 8], request_id="grows-too-long",
                       sampling_params=greedy(max_new_tokens=20, ignore_eos=True))
    engine.add_request([9, 8, 7], request_id="fits", sampling_params=greedy(max_new_tokens=6))
    outputs = run_engine(engine)
    for rid in ("too-long-prompt", "grows-too-long"):
        assert outputs[rid].status == RequestStatus.FAILED
        assert f"'{rid}'" in outputs[rid].error and "num_blocks" in outputs[rid].error
    assert outputs["fits"].status == RequestStatus.FINISHED and len(outputs["fits"].generated_tokens) == 6
