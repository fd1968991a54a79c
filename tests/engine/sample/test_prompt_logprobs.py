"""Prompt logprobs, top-k alternatives and prefill-only requests in the engine, against a plain forward's fp32
log_softmax: greedy and sampled requests, chunked prefills, prefix-cache hits, groups, preemption."""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig

from rollout import ContinuousBatchingConfig, RequestStatus, SamplingParams
from rollout.engine.engine import LLMEngine
from tests.helpers.models import random_prompts, run_engine, tiny_model

TOL = 1e-5
PAGE = 8


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen3")


def make_engine(model, max_batch_tokens: int | None = None, num_blocks: int = 64, **config) -> LLMEngine:
    return LLMEngine(model, GenerationConfig(do_sample=False), ContinuousBatchingConfig(
        page_size=PAGE, num_blocks=num_blocks, max_batch_tokens=max_batch_tokens, **config))


@torch.no_grad()
def reference(model, ids: list[int], temperature: float = 1.0) -> torch.Tensor:
    """[len(ids), vocab]: fp32 log_softmax(logits / T) of a plain forward over `ids`."""
    return (model(torch.tensor([ids])).logits[0].float() / temperature).log_softmax(-1)


def check_prompt_logprobs(out, ref: torch.Tensor, k: int, start: int = 1) -> None:
    prompt = out.prompt_ids
    assert len(out.prompt_logprobs) == len(prompt)
    assert out.prompt_logprobs[:max(1, start)] == [None] * max(1, start)
    for i in range(max(1, start), len(prompt)):
        assert abs(out.prompt_logprobs[i] - ref[i - 1, prompt[i]].item()) < TOL, i
        if k:
            check_top(out.prompt_top_logprobs[i], ref[i - 1], k)
    if not k:
        assert out.prompt_top_logprobs is None


def check_top(top: dict[int, float], row: torch.Tensor, k: int) -> None:
    """The k most likely tokens of `row`, most likely first, with their values."""
    values, ids = row.topk(k)
    assert list(top) == ids.tolist()
    assert torch.allclose(torch.tensor(list(top.values())), values, atol=TOL)


@pytest.mark.parametrize("max_batch_tokens", [None, 16], ids=["one-chunk", "chunked"])
@pytest.mark.parametrize("k", [0, 5])
def test_prompt_logprobs_match_a_plain_forward(model, max_batch_tokens, k):
    engine = make_engine(model, max_batch_tokens)
    prompts = random_prompts([41, 9, 2, 1], seed=3)
    params = [SamplingParams(temperature=0.0, max_new_tokens=3, prompt_logprobs=k),
              SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_new_tokens=4, prompt_logprobs=k),
              SamplingParams(temperature=1.0, max_new_tokens=2, prompt_logprobs=k),
              SamplingParams(temperature=0.0, max_new_tokens=2, prompt_logprobs=k)]
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(prompt, f"r{i}", p)
    engine.add_request(prompts[0], "plain", SamplingParams(temperature=0.0, max_new_tokens=3))  # asks for nothing
    outs = run_engine(engine)
    if max_batch_tokens:
        assert engine.stats().chunked_prefills > 0
    for i, prompt in enumerate(prompts):
        out = outs[f"r{i}"]
        assert out.status == RequestStatus.FINISHED and len(out.generated_tokens) == params[i].max_new_tokens
        check_prompt_logprobs(out, reference(model, prompt), k)
    assert outs["plain"].prompt_logprobs is None and outs["plain"].top_logprobs is None
    assert outs["plain"].generated_tokens == outs["r0"].generated_tokens


def test_prefix_cache_hits_do_not_drop_prompt_logprobs(model):
    engine = make_engine(model)
    prompt = random_prompts([37], seed=4)[0]
    ref = reference(model, prompt)
    run_engine_with(engine, prompt, "warm", SamplingParams(temperature=0.0, max_new_tokens=2))
    hits = engine.stats().prefix_hit_tokens
    out = run_engine_with(engine, prompt, "echo", SamplingParams(temperature=0.0, max_new_tokens=2, prompt_logprobs=3))
    check_prompt_logprobs(out, ref, 3)
    assert engine.stats().prefix_hit_tokens == hits, "the cached prompt is recomputed for its logits"
    # From position 30 on only: the blocks before position 29 come from the cache (3 of them), the rest is computed.
    out = run_engine_with(engine, prompt, "tail", SamplingParams(temperature=0.0, max_new_tokens=0, prompt_logprobs=0,
                                                                 prompt_logprobs_start=30))
    check_prompt_logprobs(out, ref, 0, start=30)
    assert engine.stats().prefix_hit_tokens == hits + 3 * PAGE
    # A request that asks for nothing still reuses the prompt (published by the recomputing requests too).
    run_engine_with(engine, prompt, "again", SamplingParams(temperature=0.0, max_new_tokens=1))
    assert engine.stats().prefix_hit_tokens == hits + 3 * PAGE + 4 * PAGE


def run_engine_with(engine, prompt, rid, params):
    engine.add_request(prompt, rid, params)
    return run_engine(engine)[rid]


def test_groups_and_identical_prompts_share_one_prefill_and_its_logprobs(model):
    engine = make_engine(model)
    prompt = random_prompts([21], seed=6)[0]
    ref = reference(model, prompt)
    engine.add_request(prompt, "group", SamplingParams(temperature=1.0, seed=1, n=3, max_new_tokens=3,
                                                       prompt_logprobs=2))
    engine.add_request(prompt, "same", SamplingParams(temperature=1.0, seed=2, max_new_tokens=2, prompt_logprobs=2))
    engine.add_request(prompt, "none", SamplingParams(temperature=1.0, seed=3, max_new_tokens=2))
    engine.add_request(prompt, "scored", SamplingParams(max_new_tokens=0, prompt_logprobs=2))
    outs = run_engine(engine)
    for rid in ("group#0", "group#1", "group#2", "same", "scored"):
        check_prompt_logprobs(outs[rid], ref, 2)
    assert outs["none"].prompt_logprobs is None and len(outs["none"].generated_tokens) == 2
    assert outs["scored"].generated_tokens == [] and outs["scored"].finish_reason == "length"


def test_prefill_only_requests_and_groups_finish_without_a_token(model):
    engine = make_engine(model, max_batch_tokens=16)
    prompts = random_prompts([30, 5], seed=7)
    engine.add_request(prompts[0], "a", SamplingParams(max_new_tokens=0, n=2, prompt_logprobs=1))
    engine.add_request(prompts[1], "b", SamplingParams(max_new_tokens=0))
    outs = run_engine(engine)
    for rid in ("a#0", "a#1", "b"):
        assert outs[rid].status == RequestStatus.FINISHED and outs[rid].finish_reason == "length"
        assert outs[rid].generated_tokens == [] and outs[rid].logprobs == []
    check_prompt_logprobs(outs["a#1"], reference(model, prompts[0]), 1)
    assert engine.stats().generated_tokens == 0


def test_prompt_logprobs_survive_preemption_mid_prefill(model, monkeypatch):
    engine = make_engine(model, max_batch_tokens=16, num_blocks=9)
    grow, scored = random_prompts([23, 50], seed=8)
    preempted = []
    preempt = engine.scheduler._preempt

    def spy(request):
        preempted.append((request.request_id, len(request.prompt_logprobs)))
        preempt(request)

    monkeypatch.setattr(engine.scheduler, "_preempt", spy)
    engine.add_request(grow, "grow", SamplingParams(temperature=0.0, max_new_tokens=40, ignore_eos=True))
    engine.add_request(scored, "scored", SamplingParams(temperature=0.0, max_new_tokens=2, prompt_logprobs=2))
    outs = run_engine(engine)
    assert any(rid == "scored" and 1 < done < len(scored) for rid, done in preempted), preempted
    check_prompt_logprobs(outs["scored"], reference(model, scored), 2)


def test_prompt_logprobs_temperature(model):
    engine = make_engine(model)
    prompt = random_prompts([12], seed=9)[0]
    out = run_engine_with(engine, prompt, "t", SamplingParams(max_new_tokens=0, prompt_logprobs=4,
                                                              prompt_logprobs_temperature=0.7))
    check_prompt_logprobs(out, reference(model, prompt, temperature=0.7), 4)


@pytest.mark.parametrize("max_batch_tokens", [None, 16], ids=["one-chunk", "chunked"])
def test_top_k_alternatives_of_generated_tokens(model, max_batch_tokens):
    engine = make_engine(model, max_batch_tokens)
    prompts = random_prompts([19, 7, 26], seed=10)
    k = 6
    params = {"greedy": SamplingParams(temperature=0.0, max_new_tokens=5, logprobs=k),
              "sampled": SamplingParams(temperature=0.7, seed=3, max_new_tokens=5, logprobs=k),
              "truncated": SamplingParams(temperature=1.0, top_k=3, seed=4, max_new_tokens=5, logprobs=k)}
    for (rid, p), prompt in zip(params.items(), prompts):
        engine.add_request(prompt, rid, p)
    engine.add_request(prompts[0], "none", SamplingParams(temperature=0.0, max_new_tokens=5, logprobs=0))
    outs = run_engine(engine)
    for (rid, p), prompt in zip(params.items(), prompts):
        out = outs[rid]
        ids = prompt + out.generated_tokens
        raw, policy = reference(model, ids), reference(model, ids, p.temperature or 1.0)
        for t, token in enumerate(out.generated_tokens):
            row = len(prompt) - 1 + t
            assert abs(out.raw_logprobs[t] - raw[row, token].item()) < TOL
            assert abs(out.policy_logprobs[t] - policy[row, token].item()) < TOL
            check_top(out.raw_top_logprobs[t], raw[row], k)
            check_top(out.policy_top_logprobs[t], policy[row], k)
            top = out.top_logprobs[t]
            if rid == "greedy":  # a point mass, as `logprobs` says
                assert top == {token: 0.0} and out.logprobs[t] == 0.0
            elif rid == "sampled":  # no truncation: the sampled distribution is the policy
                check_top(top, policy[row], k)
            else:  # top_k=3: only the 3 kept tokens, renormalised
                assert list(top) == policy[row].topk(3).indices.tolist()
                assert abs(torch.tensor(list(top.values())).exp().sum().item() - 1) < 1e-5
                assert abs(top[token] - out.logprobs[t]) < TOL
    assert outs["none"].raw_logprobs == outs["greedy"].raw_logprobs
    assert outs["none"].top_logprobs == [{}] * 5 and outs["none"].raw_top_logprobs == [{}] * 5


def test_settings_are_validated(model):
    engine = make_engine(model, num_blocks=80)
    for bad in (SamplingParams(prompt_logprobs=-1), SamplingParams(logprobs=-2), SamplingParams(logprobs=1.5),
                SamplingParams(prompt_logprobs=1, prompt_logprobs_temperature=0.0),
                SamplingParams(prompt_logprobs=1, prompt_logprobs_start=-1), SamplingParams(max_new_tokens=-1)):
        with pytest.raises(ValueError):
            engine.validate_sampling(bad)
    # A prefill-only request may fill every position of the model; one that samples needs one more.
    full = [3] * model.config.max_position_embeddings
    engine.add_request(full, "full", SamplingParams(max_new_tokens=0, prompt_logprobs=0, prompt_logprobs_start=510))
    engine.add_request(full, "sampling", SamplingParams(max_new_tokens=1))
    outs = run_engine(engine)
    assert outs["full"].status == RequestStatus.FINISHED and len(outs["full"].prompt_logprobs) == len(full)
    assert outs["sampling"].status == RequestStatus.FAILED and "positions" in outs["sampling"].error


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_other_families(kind):
    other = tiny_model(kind)
    engine = make_engine(other, max_batch_tokens=16)
    prompt = random_prompts([35], seed=11)[0]
    engine.add_request(prompt[:20], "warm", SamplingParams(temperature=0.0, max_new_tokens=1))
    engine.add_request(prompt, "echo", SamplingParams(temperature=0.0, max_new_tokens=2, prompt_logprobs=2,
                                                      logprobs=2))
    out = run_engine(engine)["echo"]
    ref = reference(other, prompt + out.generated_tokens)
    check_prompt_logprobs(out, ref, 2)
    for t, token in enumerate(out.generated_tokens):
        assert abs(out.raw_logprobs[t] - ref[len(prompt) - 1 + t, token].item()) < TOL
