"""Per-request logits processors: the built-ins (allowed ids, bad words, logit bias, min new tokens) against
transformers' own LogitsProcessor classes, greedy decoding against model.generate with the same processors, a
request's own processors (callables and LogitsProcessor objects), failure isolation, batch invariance of seeded
requests, the sampler's fast path, and the logprob contract under processors.
"""

from __future__ import annotations

import random

import pytest
import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor,
    NoBadWordsLogitsProcessor,
    PrefixConstrainedLogitsProcessor,
    SequenceBiasLogitsProcessor,
    SuppressTokensLogitsProcessor,
    TopPLogitsWarper,
)

from rollout import ContinuousBatchingConfig, SamplingParams, generate_batch
from rollout.engine.core.request import ErrorKind, RequestStatus
from rollout.engine.engine import LLMEngine
from rollout.engine.sample import logits_processors
from rollout.engine.sample.resolve import resolve_sampling
from rollout.engine.sample.rows import SampleRow
from rollout.engine.sample.sampler import Sampler
from rollout.validation import InvalidRequestError
from tests.helpers.models import VOCAB, greedy_reference, random_prompts, run_engine, tiny_model

TOL = 1e-5
NEG_INF = float("-inf")


def gen(model, prompts, params, **cfg):
    cfg.setdefault("page_size", 8)
    return generate_batch(model, prompts, GenerationConfig(), ContinuousBatchingConfig(**cfg),
                          sampling_params=params, progress_bar=False)


def resolved(**kw):
    return resolve_sampling(SamplingParams(**kw), GenerationConfig())


@pytest.fixture(scope="module")
def flat():
    return tiny_model("llama", seed=1, lm_head_scale=1.0)


# -------------------------------------------------------------------------------- built-ins against transformers


def hf_processed(row: SampleRow, logits_row: torch.Tensor, settings: dict) -> torch.Tensor:
    """The row's logits through transformers' processors for the same settings, in generate's order."""
    ids = torch.tensor([row.tokens])
    scores = logits_row[None].clone()
    if settings.get("bad_words_ids"):
        # One token that matches nothing in front: transformers 5.17 and older skip a bad word as long as the whole
        # context, whose prefix would match all of it (tokens [30, 9] and the word [30, 9, 50] must mask 50).
        padded = torch.tensor([[-1] + row.tokens])
        scores = NoBadWordsLogitsProcessor(settings["bad_words_ids"])(padded, scores)
    if settings.get("min_new_tokens"):
        prompt_len = len(row.tokens) - row.num_generated
        scores = MinNewTokensLengthLogitsProcessor(prompt_len, settings["min_new_tokens"],
                                                   settings["eos_token_id"])(ids, scores)
    if settings.get("allowed_token_ids"):
        allowed = settings["allowed_token_ids"]
        scores = PrefixConstrainedLogitsProcessor(lambda batch, sent: allowed, 1)(ids, scores)
    if settings.get("logit_bias"):
        # the dict form: the list form ([[[0], bias]]) rejects token id 0 in transformers 5.17 and older
        bias = {(tok,): float(value) for tok, value in settings["logit_bias"].items()}
        scores = SequenceBiasLogitsProcessor(bias)(ids, scores)
    return scores[0]


def random_settings(rng: random.Random, vocab: int, tokens: list[int]) -> dict:
    """A random mix of built-ins; multi-token bad words are built from the row's own tail half the time, so some of
    them are completed and must mask their last token."""
    s: dict = {}
    if rng.random() < 0.4:
        s["allowed_token_ids"] = rng.sample(range(vocab), rng.randint(1, 30))
    if rng.random() < 0.5:
        words = [[rng.randrange(vocab)] for _ in range(rng.randint(1, 4))]
        for length in (2, 3):
            prefix = tokens[-(length - 1):] if rng.random() < 0.5 else rng.sample(range(vocab), length - 1)
            words.append(list(prefix) + [rng.randrange(vocab)])
        s["bad_words_ids"] = words
    if rng.random() < 0.4:
        s["logit_bias"] = {rng.randrange(vocab): rng.uniform(-5, 5) for _ in range(rng.randint(1, 6))}
    if rng.random() < 0.3:
        s["min_new_tokens"] = 5
        s["eos_token_id"] = rng.sample(range(vocab), 3)
    return s


@pytest.mark.parametrize("batch_seed", range(3))
def test_builtins_match_transformers_processors_row_by_row(batch_seed):
    rng = random.Random(batch_seed)
    vocab = 64
    logits = torch.randn(80, vocab, generator=torch.Generator().manual_seed(batch_seed)) * 3
    rows, settings = [], []
    for i in range(80):
        tokens = [rng.randrange(vocab) for _ in range(rng.randint(1, 12))]
        s = random_settings(rng, vocab, tokens)
        temperature = 0.0 if i % 7 == 0 else rng.choice([0.5, 1.0, 1.5])
        top_p = rng.choice([1.0, 1.0, 0.8])
        rows.append(SampleRow(resolved(temperature=temperature, top_p=top_p, seed=i, **s), tokens,
                              num_generated=rng.randint(0, min(6, len(tokens) - 1))))
        settings.append({**s, "temperature": temperature, "top_p": top_p})
    res = Sampler(seed=batch_seed).sample(logits, rows)
    assert not res.errors
    checked_masks = 0
    for i, (row, s) in enumerate(zip(rows, settings)):
        ref = hf_processed(row, logits[i], s)
        token = res.tokens[i]
        if s["temperature"] == 0:
            assert token == int(ref.argmax()), f"row {i} {s}"
            assert res.logprobs[i] == 0.0
            continue
        t = s["temperature"]
        scores = ref[None] / t
        if s["top_p"] < 1:
            scores = TopPLogitsWarper(s["top_p"])(torch.zeros(1, 1, dtype=torch.long), scores)
        sampled = torch.log_softmax(scores[0], -1)
        policy = torch.log_softmax(logits[i] / t, -1)
        kept = torch.isfinite(sampled)
        assert kept[token], f"row {i}: token {token} is masked by transformers' processors {s}"
        assert res.logprobs[i] == pytest.approx(float(sampled[token]), abs=1e-4), (i, s)
        assert res.policy_logprobs[i] == pytest.approx(float(policy[token]), abs=TOL)
        assert res.kept_logmass[i] == pytest.approx(float(torch.logsumexp(policy[kept], 0)), abs=1e-4), (i, s)
        if "logit_bias" not in s:  # masks and truncation only: the identity holds
            assert res.logprobs[i] == pytest.approx(res.policy_logprobs[i] - res.kept_logmass[i], abs=1e-4)
            checked_masks += not bool(kept.all())
    assert checked_masks > 10, "too few masked rows: the test proves little"


# ----------------------------------------------------------------------------- greedy against model.generate


class Suppress(SuppressTokensLogitsProcessor):
    """transformers' processor, as a request's own (the engine batches LogitsProcessor objects)."""


def test_greedy_with_processors_equals_generate(qwen3):
    prompts = random_prompts([9, 21, 14], seed=8)
    plain = gen(qwen3, prompts, SamplingParams(temperature=0.0, max_new_tokens=16))
    changed = 0
    for j, prompt in enumerate(prompts):
        base = plain[f"req_{j}"].generated_tokens
        rng = random.Random(j)
        bad = [[base[2]], [base[4], base[5]], [prompt[-1], base[0]]]  # one token, two tokens, across the prompt end
        bias = {base[7]: -4.0, rng.randrange(VOCAB): 3.0}
        allowed = sorted(set(rng.sample(range(VOCAB), 120)) | set(base))
        eos = base[1]
        suppressed = [base[9]]
        params = SamplingParams(temperature=0.0, max_new_tokens=16, bad_words_ids=bad, logit_bias=bias,
                                allowed_token_ids=allowed, min_new_tokens=4, eos_token_id=eos,
                                logits_processors=[Suppress(suppressed)])
        got = gen(qwen3, [prompt], params)["req_0"]
        ref, safe = greedy_reference(
            qwen3, prompt, 16, force_length=False, bad_words_ids=bad, min_new_tokens=4, eos_token_id=eos,
            sequence_bias=[[[t], v] for t, v in bias.items()],
            prefix_allowed_tokens_fn=lambda batch, sent, allowed=allowed: allowed,
            logits_processor=LogitsProcessorList([SuppressTokensLogitsProcessor(suppressed)]))
        assert safe >= min(8, len(ref)), "near-ties too early in the reference"
        assert got.generated_tokens[:safe] == ref[:safe]
        if safe == len(ref):
            assert got.generated_tokens == ref
        changed += got.generated_tokens != base
    assert changed, "the processors never changed the output: the test proves nothing"


# ------------------------------------------------------------------------------------- a request's own processors


def forced_prefix(prefix: list[int]):
    """A per-request callable forcing the first generated tokens (masks everything else)."""

    def force(generated: list[int], row: torch.Tensor) -> torch.Tensor:
        if len(generated) < len(prefix):
            forced = torch.full_like(row, NEG_INF)
            forced[prefix[len(generated)]] = row[prefix[len(generated)]]
            return forced
        return row

    return force


def test_a_callable_forces_a_prefix_and_keeps_the_contract(flat):
    prompt = random_prompts([7], seed=3)[0]
    prefix = [5, 17, 200]
    out = gen(flat, [prompt], SamplingParams(temperature=1.0, seed=4, n=3, max_new_tokens=8,
                                             logits_processors=[forced_prefix(prefix)]))
    tails = set()
    for o in out.values():
        assert o.error is None and o.generated_tokens[:3] == prefix
        # A forced token is a point mass: logprob 0, and the kept mass is its whole policy probability.
        assert o.logprobs[:3] == pytest.approx([0.0] * 3, abs=TOL)
        assert o.kept_logmass[:3] == pytest.approx(o.policy_logprobs[:3], abs=TOL)
        assert o.kept_logmass[3:] == pytest.approx([0.0] * 5, abs=TOL)  # rounding of a full-vocabulary logsumexp
        tails.add(tuple(o.generated_tokens[3:]))
    assert len(tails) == 3, "after the prefix, each seeded sample goes its own way"


class Recorder(LogitsProcessor):
    """Records the batch shape of each call; masks nothing."""

    def __init__(self) -> None:
        self.shapes: list[tuple[int, ...]] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self.shapes.append(tuple(input_ids.shape))
        return scores


def test_a_shared_logits_processor_runs_once_per_step_for_a_group(flat):
    prompt = random_prompts([6], seed=9)[0]
    outs = {}
    for recorder in (Recorder(), None):
        engine = LLMEngine(flat, GenerationConfig(), ContinuousBatchingConfig(page_size=8, num_blocks=64))
        engine.add_request(prompt, "g", SamplingParams(temperature=1.0, seed=2, n=4, max_new_tokens=5,
                                                       logits_processors=[recorder] if recorder else None))
        outs[recorder is None] = {k: v.generated_tokens for k, v in run_engine(engine).items()}
        if recorder is not None:
            assert recorder.shapes == [(4, len(prompt) + k) for k in range(5)]
    assert outs[True] == outs[False], "batching the processor changed samples"


def _raise_after(n: int):
    def flaky_processor(generated: list[int], row: torch.Tensor) -> torch.Tensor:
        if len(generated) >= n:
            raise ValueError("tool-call parser out of sync")
        return row

    return flaky_processor


def _wrong_shape(generated: list[int], row: torch.Tensor):
    return row[:10]


@pytest.mark.parametrize("bad, message, num_tokens", [
    (SamplingParams(logits_processors=[_raise_after(2)]), "_raise_after.<locals>.flaky_processor failed: "
                                                          "ValueError: tool-call parser out of sync", 2),
    (SamplingParams(logits_processors=[_wrong_shape]), "_wrong_shape failed: TypeError: returned (10,)", 0),
    (SamplingParams(allowed_token_ids=[3, 4], bad_words_ids=[[3], [4]]), "left no token to sample", 0),
])
def test_a_failing_processor_fails_only_its_request(qwen3, bad, message, num_tokens):
    prompts = random_prompts([8, 12, 5], seed=13)
    good = SamplingParams(temperature=0.0, max_new_tokens=6)
    alone = gen(qwen3, [prompts[0], prompts[2]], good)
    engine = LLMEngine(qwen3, GenerationConfig(), ContinuousBatchingConfig(page_size=8, num_blocks=64))
    engine.add_request(prompts[0], "a", good)
    engine.add_request(prompts[1], "bad", bad.with_overrides(temperature=0.0, max_new_tokens=6, n=2))
    engine.add_request(prompts[2], "c", good)
    outs = run_engine(engine)
    for rid in ("bad#0", "bad#1"):
        assert outs[rid].status == RequestStatus.FAILED and outs[rid].error_kind == ErrorKind.INVALID_REQUEST
        assert message in outs[rid].error and f"request {rid!r}" in outs[rid].error
        assert len(outs[rid].generated_tokens) == num_tokens
    assert outs["a"].generated_tokens == alone["req_0"].generated_tokens
    assert outs["c"].generated_tokens == alone["req_1"].generated_tokens
    assert engine.counters["forward_errors"] == 0 and not engine.health.failing


# --------------------------------------------------------------------------------------- batch invariance, fast path


def test_seeded_request_with_processors_is_batch_invariant(qwen3):
    prompt = random_prompts([11], seed=77)[0]
    target = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_new_tokens=14,
                            allowed_token_ids=list(range(0, VOCAB, 3)), logit_bias={9: 2.0, 30: -1.0},
                            bad_words_ids=[[12], [3, 6]], logits_processors=[forced_prefix([33])])
    alone = gen(qwen3, [prompt], target)["req_0"]
    rng = random.Random(5)
    prompts = random_prompts([rng.randint(3, 30) for _ in range(30)], seed=6)
    crowd_params = []
    for i in range(30):
        extra = [dict(), dict(logit_bias={rng.randrange(VOCAB): 50.0}), dict(bad_words_ids=[[i], [i + 1, i + 2]]),
                 dict(allowed_token_ids=rng.sample(range(VOCAB), 40)), dict(logits_processors=[Recorder()]),
                 dict(min_new_tokens=3, stop_token_ids=[1, 2])][i % 6]
        crowd_params.append(SamplingParams(temperature=rng.choice([0.0, 0.7, 1.3]), seed=i if i % 2 else None,
                                           max_new_tokens=rng.randint(2, 16), **extra))
    prompts.insert(13, prompt)
    crowd_params.insert(13, target)
    among = gen(qwen3, prompts, crowd_params)["req_13"]
    assert alone.error is None and among.error is None
    assert among.generated_tokens == alone.generated_tokens
    assert among.logprobs == pytest.approx(alone.logprobs, abs=TOL)
    assert among.kept_logmass == pytest.approx(alone.kept_logmass, abs=TOL)


def test_a_batch_without_processors_skips_the_processor_pass(monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("a batch without processors must not reach the processor pass")

    for name in ("_repetition_penalty", "_add_logit_bias", "_apply_masks", "_apply_custom", "_fail_dead_rows"):
        monkeypatch.setattr(logits_processors, name, boom)
    rows = [SampleRow(resolved(temperature=t, top_k=k, seed=s), [1, 2, 3], 1)
            for t, k, s in [(0.0, 0, None), (1.0, 5, 3), (0.7, 0, None)] * 10]
    rows.append(SampleRow(resolved(min_new_tokens=1, eos_token_id=[2]), [1, 2, 3], 1))  # its stop mask is over
    logits = torch.randn(len(rows), 32)
    assert logits_processors.apply_processors(logits, rows).logits is logits
    res = Sampler(seed=0).sample(logits, rows)
    assert not res.errors and len(res.tokens) == len(rows)


# ------------------------------------------------------------------------------------------- the logprob contract


@torch.no_grad()
def fresh_logits(model, prompt: list[int], generated: list[int]) -> torch.Tensor:
    full = torch.tensor([prompt + generated])
    return model(full).logits[0, len(prompt) - 1:full.shape[1] - 1].float()


def test_masking_processors_keep_the_logprob_identity_against_a_fresh_forward(flat):
    prompts = random_prompts([4, 19], seed=23)
    allowed = list(range(0, VOCAB, 2))
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=7, n=2, max_new_tokens=10, allowed_token_ids=allowed,
                            bad_words_ids=[[4], [6, 8]], min_new_tokens=10, stop_token_ids=[10, 12])
    outs = gen(flat, prompts, params)
    for rid, out in outs.items():
        prompt = prompts[int(rid.split("#")[0][4:])]
        logits = fresh_logits(flat, prompt, out.generated_tokens)
        policy_full = torch.log_softmax(logits / 0.8, dim=-1)
        tokens = torch.tensor(out.generated_tokens)
        assert set(out.generated_tokens) <= set(allowed) - {4, 10, 12}
        policy, sampled, kept = (torch.tensor(x) for x in (out.policy_logprobs, out.logprobs, out.kept_logmass))
        assert policy == pytest.approx(policy_full.gather(1, tokens[:, None]).squeeze(1), abs=TOL)
        assert sampled == pytest.approx(policy - kept, abs=TOL)
        assert bool((kept < -0.1).all()), "masking half the vocabulary must show in the kept mass"


def test_logit_bias_breaks_the_identity_but_logprobs_are_of_the_sampled_distribution(flat):
    prompt = random_prompts([6], seed=31)[0]
    bias = {t: 3.0 for t in range(0, VOCAB, 5)}
    out = gen(flat, [prompt], SamplingParams(temperature=1.0, seed=2, max_new_tokens=8, logit_bias=bias))["req_0"]
    logits = fresh_logits(flat, prompt, out.generated_tokens)
    biased = logits.clone()
    biased[:, list(bias)] += 3.0
    ref = torch.log_softmax(biased, -1).gather(1, torch.tensor(out.generated_tokens)[:, None]).squeeze(1)
    assert torch.tensor(out.logprobs) == pytest.approx(ref, abs=TOL)
    assert out.kept_logmass == pytest.approx([0.0] * 8, abs=TOL), "bias masks nothing: all the policy mass is kept"
    assert torch.tensor(out.logprobs) != pytest.approx(torch.tensor(out.policy_logprobs), abs=1e-3)


# --------------------------------------------------------------------------------------------------- validation


@pytest.mark.parametrize("kw, param", [
    (dict(logit_bias={5: 101.0}), "logit_bias"),
    (dict(logit_bias={-1: 1.0}), "logit_bias"),
    (dict(logit_bias={"five": 1.0}), "logit_bias"),
    (dict(logit_bias=[(5, 1.0)]), "logit_bias"),
    (dict(allowed_token_ids=[]), "allowed_token_ids"),
    (dict(allowed_token_ids=[1, 2.5]), "allowed_token_ids"),
    (dict(bad_words_ids=[[1], []]), "bad_words_ids"),
    (dict(bad_words_ids=[1, 2]), "bad_words_ids"),
    (dict(logits_processors=forced_prefix([1])), "logits_processors"),
    (dict(logits_processors=["not callable"]), "logits_processors"),
])
def test_bad_processor_settings_name_the_field(kw, param):
    with pytest.raises(InvalidRequestError) as err:
        resolved(**kw)
    assert err.value.param == param and param in str(err.value)


def test_logit_bias_accepts_json_style_string_keys():
    assert resolved(logit_bias={"7": -100}).processors.bias_ids.tolist() == [7]


@pytest.mark.parametrize("kw", [dict(logit_bias={VOCAB: 1.0}), dict(allowed_token_ids=[0, VOCAB + 3]),
                                dict(bad_words_ids=[[1, VOCAB]])])
def test_token_ids_outside_the_vocabulary_fail_the_request_alone(qwen3, kw):
    engine = LLMEngine(qwen3, GenerationConfig(), ContinuousBatchingConfig(page_size=8, num_blocks=32))
    engine.add_request([1, 2, 3], "bad", SamplingParams(max_new_tokens=2, **kw))
    engine.add_request([1, 2, 3], "ok", SamplingParams(max_new_tokens=2))
    outs = run_engine(engine)
    assert outs["bad"].error_kind == ErrorKind.INVALID_REQUEST and "outside the model's vocabulary" in outs["bad"].error
    assert outs["ok"].error is None and len(outs["ok"].generated_tokens) == 2
