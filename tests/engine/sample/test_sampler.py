"""Per-request sampling through the engine: seeds, n-sample groups, truncation, the RL logprob contract, penalties and
stopping. References are independent: a fresh fp32 forward of the model and transformers' own logits processors.
"""

from __future__ import annotations

from dataclasses import replace
from unittest import mock

import pytest
import torch
from transformers import GenerationConfig
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from rollout import ContinuousBatchingConfig, SamplingParams, generate_batch
from rollout.engine.cpu.kernel import draw_tokens, load_kernel
from rollout.engine.engine import LLMEngine
from rollout.engine.sample.resolve import resolve_sampling
from rollout.engine.sample.rows import SampleRow
from rollout.engine.sample.sampler import Sampler, inverse_cdf
from rollout.engine.sample.units import lp_units
from tests.helpers.models import VOCAB, greedy_reference, random_prompts, run_engine, tiny_model

TOL = 1e-5


def gen(model, prompts, params=None, gen_config=None, **cfg):
    cfg.setdefault("page_size", 8)
    return generate_batch(model, prompts, gen_config or GenerationConfig(), ContinuousBatchingConfig(**cfg),
                          sampling_params=params, progress_bar=False)


@pytest.fixture(scope="module")
def flat():
    """Unscaled head: near-uniform next-token distributions, so different seeds visibly differ."""
    return tiny_model("llama", seed=1, lm_head_scale=1.0)


def resolved(**kw):
    return resolve_sampling(SamplingParams(**kw), GenerationConfig())


def hf_keep_mask(logits_row: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """Which tokens survive transformers' warpers (temperature, top-k, top-p, min-p, in generate's order)."""
    scores = logits_row.float()[None] / temperature
    ids = torch.zeros(1, 1, dtype=torch.long)
    if top_k:
        scores = TopKLogitsWarper(top_k)(ids, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(ids, scores)
    if min_p:
        scores = MinPLogitsWarper(min_p)(ids, scores)
    return torch.isfinite(scores[0])


@torch.no_grad()
def fresh_logits(model, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """fp32 logits that predicted each generated token, from one plain forward over prompt + generated."""
    full = torch.tensor([prompt + generated])
    return model(full).logits[0, len(prompt) - 1:full.shape[1] - 1].float()


# ---------------------------------------------------------------------------------------------------------- seeds


def _crowd(n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    prompts = random_prompts(torch.randint(1, 40, (n,), generator=g).tolist(), seed=seed + 100)
    params = []
    for i in range(n):
        kind = i % 5
        if kind == 0:
            params.append(SamplingParams(temperature=0.0, max_new_tokens=1 + i % 23))
        elif kind == 1:
            params.append(SamplingParams(temperature=1.5, top_k=7, max_new_tokens=2 + i % 17))
        elif kind == 2:
            params.append(SamplingParams(temperature=0.6, top_p=0.7, seed=i, max_new_tokens=3 + i % 29))
        elif kind == 3:
            params.append(SamplingParams(temperature=1.0, min_p=0.2, repetition_penalty=1.2, max_new_tokens=5))
        else:
            params.append(SamplingParams(temperature=0.9, seed=1000 + i, n=2, max_new_tokens=1 + i % 11))
    return prompts, params


TARGET = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_new_tokens=20)


def test_seeded_sampling_repeats_across_runs(qwen3):
    prompts = random_prompts([5, 12, 30, 7], seed=3)
    params = [replace(TARGET, seed=s, top_k=k) for s, k in [(0, 0), (2, 10), (3, 0), (1, 3)]]  # seed 0 is a seed
    first = gen(qwen3, prompts, params)
    torch.manual_seed(987)  # neither the global RNG ...
    second = gen(qwen3, prompts, params, seed=55)  # ... nor the engine's own generator may matter for seeded rows
    for rid in first:
        assert first[rid].generated_tokens == second[rid].generated_tokens, rid
        assert first[rid].logprobs == second[rid].logprobs, rid
        assert len(first[rid].generated_tokens) == 20


def test_seeded_request_is_batch_invariant(qwen3):
    prompt = random_prompts([11], seed=77)[0]
    alone = gen(qwen3, [prompt], TARGET)["req_0"]
    prompts, params = _crowd(50)
    prompts.insert(25, prompt)
    params.insert(25, TARGET)
    crowd = gen(qwen3, prompts, params)
    among = crowd["req_25"]
    assert all(out.error is None for out in crowd.values())
    assert among.generated_tokens == alone.generated_tokens
    assert among.logprobs == pytest.approx(alone.logprobs, abs=TOL)
    assert among.policy_logprobs == pytest.approx(alone.policy_logprobs, abs=TOL)


def test_seeded_sampling_survives_preemption_and_recompute(flat):
    """A preempted request recomputes its KV and resumes; its seeded samples are the ones it would have drawn."""
    prompts = random_prompts([14, 30, 9, 22, 17, 26], seed=91)
    params = [SamplingParams(temperature=1.0, seed=100 + i, max_new_tokens=16) for i in range(len(prompts))]
    roomy = gen(flat, prompts, params)
    engine = LLMEngine(flat, GenerationConfig(), ContinuousBatchingConfig(page_size=4, num_blocks=14))
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(prompt, request_id=f"req_{i}", sampling_params=p)
    tight = {}
    while engine.has_unfinished():
        tight.update({o.request_id: o for o in engine.step() if o.is_finished()})
    assert engine.stats().preemptions > 0, "the tight cache must force preemption"
    for rid, out in roomy.items():
        assert tight[rid].generated_tokens == out.generated_tokens, rid
        assert tight[rid].logprobs == pytest.approx(out.logprobs, abs=TOL)


def test_sampler_rows_are_independent_of_the_rest_of_the_batch():
    """Given identical logits, a seeded row draws the same token whatever rows surround it and wherever it sits."""
    g = torch.Generator().manual_seed(0)
    vocab = 512
    seeded = [SampleRow(resolved(temperature=t, top_p=p, seed=s), tokens=[1] * (3 + s % 5), num_generated=s % 3)
              for s, (t, p) in enumerate([(1.0, 1.0), (0.8, 0.9), (1.5, 0.99), (1.0, 0.7)] * 6)]
    seeded_logits = torch.randn(len(seeded), vocab, generator=g) * 0.5  # flat: different noise, different token
    alone = [Sampler(seed=0).sample(seeded_logits[i:i + 1], [row]) for i, row in enumerate(seeded)]
    others = [SampleRow(resolved(temperature=t, top_k=k, seed=s), tokens=[5] * (i + 1), num_generated=i)
              for i, (t, k, s) in enumerate([(0.0, 0, None), (1.0, 5, None), (1.3, 0, 777), (0.5, 2, None)] * 4)]
    for trial in range(3):
        order = torch.randperm(len(seeded) + len(others), generator=g).tolist()
        rows, logits, where = [], [], {}
        for j in order:
            if j < len(seeded):
                where[j] = len(rows)
                rows.append(seeded[j])
                logits.append(seeded_logits[j])
            else:
                rows.append(others[j - len(seeded)])
                logits.append(torch.randn(vocab, generator=g))
        res = Sampler(seed=trial + 1).sample(torch.stack(logits), rows)
        for j, pos in where.items():
            assert res.tokens[pos] == alone[j].tokens[0], f"seeded row {j} changed with its neighbours"
            assert res.policy_logprobs[pos] == alone[j].policy_logprobs[0]
            assert res.logprobs[pos] == pytest.approx(alone[j].logprobs[0], abs=TOL)
            assert res.kept_logmass[pos] == pytest.approx(alone[j].kept_logmass[0], abs=TOL)


def test_a_row_that_does_not_truncate_is_unaffected_by_rows_that_do():
    vocab = 256
    peaked = torch.full((1, vocab), -20.0)
    peaked[0, 0] = 0.0
    plain = SampleRow(resolved(temperature=1.0, seed=1), tokens=[1], num_generated=0)
    truncating = SampleRow(resolved(temperature=1.0, top_k=5, seed=2), tokens=[1], num_generated=0)
    alone = Sampler(seed=0).sample(peaked, [plain])
    mixed = Sampler(seed=0).sample(torch.cat([peaked, torch.randn(1, vocab)]), [plain, truncating])
    assert alone.kept_logmass[0] == 0.0, "no truncation keeps all the mass"
    assert mixed.kept_logmass[0] == 0.0, "no truncation keeps all the mass, whatever the other rows ask for"
    assert mixed.logprobs[0] == alone.logprobs[0] == alone.policy_logprobs[0]


def test_different_seeds_give_different_samples(flat):
    prompt = random_prompts([9], seed=5)[0]
    outs = gen(flat, [prompt] * 8, [SamplingParams(temperature=1.0, seed=s, max_new_tokens=12) for s in range(8)])
    samples = {tuple(o.generated_tokens) for o in outs.values()}
    assert len(samples) == 8
    unseeded = gen(flat, [prompt] * 4, SamplingParams(temperature=1.0, max_new_tokens=12))
    assert len({tuple(o.generated_tokens) for o in unseeded.values()}) == 4


# ---------------------------------------------------------------------------------------------------- n > 1 groups


def test_n_samples_get_group_ids_and_distinct_reproducible_samples(flat):
    prompts = random_prompts([6, 19], seed=8)
    params = SamplingParams(n=4, seed=11, temperature=1.0, max_new_tokens=10)
    first = gen(flat, prompts, params)
    assert list(first) == [f"req_{i}#{j}" for i in range(2) for j in range(4)]
    for i, prompt in enumerate(prompts):
        group = [first[f"req_{i}#{j}"] for j in range(4)]
        assert all(o.prompt_ids == prompt and len(o.generated_tokens) == 10 for o in group)
        assert len({tuple(o.generated_tokens) for o in group}) == 4, "samples of one group must differ"
    second = gen(flat, prompts, params)
    assert {k: v.generated_tokens for k, v in first.items()} == {k: v.generated_tokens for k, v in second.items()}


@pytest.mark.parametrize("prompt_len", [37, 32])  # a partial last block (copied on fork), and only full blocks
def test_n_group_prefills_its_prompt_once(qwen3, prompt_len):
    engine = LLMEngine(qwen3, GenerationConfig(), ContinuousBatchingConfig(page_size=8, num_blocks=64))
    prompt = random_prompts([prompt_len], seed=12)[0]
    ids = engine.add_request(prompt, sampling_params=SamplingParams(n=8, temperature=1.0, seed=3, max_new_tokens=5))
    assert ids == [f"req_0#{j}" for j in range(8)]
    outs = run_engine(engine)
    stats = engine.stats()
    assert stats.prefill_tokens == prompt_len, "the group's prompt must be computed once, not once per sample"
    assert stats.decode_tokens == 8 * 4
    assert stats.generated_tokens == 8 * 5
    assert stats.free_blocks == stats.num_blocks
    assert sorted(outs) == sorted(ids) and all(len(o.generated_tokens) == 5 for o in outs.values())
    # Each sample's KV (shared full blocks, its own copy of the partial block) must give the right logits.
    for out in outs.values():
        ref = torch.log_softmax(fresh_logits(qwen3, prompt, out.generated_tokens), dim=-1)
        ref = ref.gather(1, torch.tensor(out.generated_tokens)[:, None]).squeeze(1)
        assert torch.tensor(out.policy_logprobs) == pytest.approx(ref, abs=TOL)


# ---------------------------------------------------------------------------------------- the RL logprob contract

CONTRACT_CASES = {
    "plain": dict(temperature=1.0),
    "top_k": dict(temperature=0.6, top_k=20),
    "top_p": dict(temperature=1.3, top_p=0.8),
    "min_p": dict(temperature=0.8, min_p=0.1),
    "top_k+top_p+min_p": dict(temperature=1.0, top_k=50, top_p=0.9, min_p=0.05),
    "top_p+min_p-hot": dict(temperature=2.0, top_p=0.5, min_p=0.02),
    "greedy": dict(temperature=0.0),
}


@pytest.mark.parametrize("case", list(CONTRACT_CASES))
def test_logprob_contract_against_a_fresh_forward(qwen3, case):
    kw = CONTRACT_CASES[case]
    prompts = random_prompts([3, 17, 30], seed=21)
    outs = gen(qwen3, prompts, SamplingParams(seed=5, max_new_tokens=12, n=2, **kw))
    greedy = kw["temperature"] == 0
    temperature = 1.0 if greedy else kw["temperature"]
    top_k, top_p, min_p = kw.get("top_k", 0), kw.get("top_p", 1.0), kw.get("min_p", 0.0)
    for rid, out in outs.items():
        prompt = prompts[int(rid.split("#")[0][4:])]
        assert out.error is None and len(out.generated_tokens) == 12
        tokens = torch.tensor(out.generated_tokens)
        logits = fresh_logits(qwen3, prompt, out.generated_tokens)
        policy_full = torch.log_softmax(logits / temperature, dim=-1)
        policy_ref = policy_full.gather(1, tokens[:, None]).squeeze(1)
        policy, sampled, kept = (torch.tensor(x) for x in (out.policy_logprobs, out.logprobs, out.kept_logmass))
        # (b) the full-vocabulary fp32 log_softmax(logits / T): what a trainer recomputes.
        assert policy == pytest.approx(policy_ref, abs=TOL), rid
        # (a) = (b) - (c)
        assert sampled == pytest.approx(policy - kept, abs=TOL), rid
        assert bool((kept <= 1e-6).all()), "the kept mass is a probability: its log is <= 0"
        if greedy:
            assert bool((sampled == 0).all()), "greedy samples a point mass: logprob 0"
            assert kept == pytest.approx(policy, abs=TOL)
            continue
        for i, token in enumerate(out.generated_tokens):
            keep = hf_keep_mask(logits[i], temperature, top_k, top_p, min_p)
            assert keep[token], f"{rid} token {i} ({token}) lies outside transformers' truncated set"
            assert float(kept[i]) == pytest.approx(float(torch.logsumexp(policy_full[i][keep], 0)), abs=1e-4)
            truncated = torch.log_softmax((logits[i] / temperature).masked_fill(~keep, float("-inf")), dim=-1)
            assert float(sampled[i]) == pytest.approx(float(truncated[token]), abs=1e-4)
        if not (top_k or top_p < 1 or min_p):
            assert kept == pytest.approx(torch.zeros_like(kept), abs=TOL)


def test_top_k_1_is_greedy_with_zero_logprobs(qwen3):
    prompts = random_prompts([4, 21], seed=31)
    greedy = gen(qwen3, prompts, SamplingParams(temperature=0.0, max_new_tokens=10))
    top1 = gen(qwen3, prompts, SamplingParams(temperature=1.7, top_k=1, seed=9, max_new_tokens=10))
    for rid in greedy:
        assert top1[rid].generated_tokens == greedy[rid].generated_tokens
        assert top1[rid].logprobs == pytest.approx([0.0] * 10, abs=1e-6)
        assert top1[rid].kept_logmass == pytest.approx(top1[rid].policy_logprobs, abs=TOL)


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0), SamplingParams(do_sample=False, temperature=0.7),
                                    None])
def test_greedy_has_zero_logprobs_and_argmax_tokens(qwen3, params):
    prompt = random_prompts([13], seed=41)[0]
    out = gen(qwen3, [prompt], params, GenerationConfig(max_new_tokens=8, do_sample=False))["req_0"]
    logits = fresh_logits(qwen3, prompt, out.generated_tokens)
    assert out.generated_tokens == logits.argmax(-1).tolist()
    assert out.logprobs == [0.0] * 8
    ref = torch.log_softmax(logits, -1).gather(1, torch.tensor(out.generated_tokens)[:, None]).squeeze(1)
    assert torch.tensor(out.policy_logprobs) == pytest.approx(ref, abs=TOL)


# ------------------------------------------------------------------------------------------- the sampler directly

TRUNCATION_GRID = dict(temperature=[0.3, 0.7, 1.0, 1.8], top_k=[0, 1, 5, 20, 64, 100], top_p=[1.0, 0.95, 0.5, 0.1],
                       min_p=[0.0, 0.05, 0.3])


@pytest.mark.parametrize("batch_seed", range(4))
def test_truncation_matches_transformers_warpers_row_by_row(batch_seed):
    """A mixed batch (every row its own temperature/top-k/top-p/min-p, some greedy) against transformers per row."""
    g = torch.Generator().manual_seed(batch_seed)
    rows, settings_ = [], []
    for i in range(96):
        pick = {k: v[int(torch.randint(len(v), (1,), generator=g))] for k, v in TRUNCATION_GRID.items()}
        if i % 11 == 0:
            pick["temperature"] = 0.0
        settings_.append(pick)
        seed = None if i % 3 else i
        rows.append(SampleRow(resolved(seed=seed, **pick), tokens=[i % VOCAB], num_generated=0))
    vocab = 64
    logits = torch.randn(len(rows), vocab, generator=g) * 4
    res = Sampler(seed=batch_seed).sample(logits, rows)
    for i, pick in enumerate(settings_):
        token = res.tokens[i]
        if pick["temperature"] == 0:
            assert token == int(logits[i].argmax()) and res.logprobs[i] == 0.0
            continue
        t = pick["temperature"]
        policy = torch.log_softmax(logits[i] / t, -1)
        keep = hf_keep_mask(logits[i], t, pick["top_k"], pick["top_p"], pick["min_p"])
        assert keep[token], f"row {i} {pick}: token {token} outside transformers' truncated set"
        assert res.policy_logprobs[i] == pytest.approx(float(policy[token]), abs=TOL)
        assert res.kept_logmass[i] == pytest.approx(float(torch.logsumexp(policy[keep], 0)), abs=TOL), (i, pick)
        assert res.logprobs[i] == pytest.approx(res.policy_logprobs[i] - res.kept_logmass[i], abs=TOL)


FIXED_ROW = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
DIST_CASES = {
    "plain": dict(temperature=1.0),
    "cold+top_k": dict(temperature=0.7, top_k=5),
    "hot+top_p": dict(temperature=1.3, top_p=0.8),
    "min_p": dict(temperature=1.0, min_p=0.2),
}


@pytest.mark.parametrize("seeded", [False, True], ids=["engine-rng", "per-row-seeds"])
@pytest.mark.parametrize("case", list(DIST_CASES))
def test_empirical_distribution_matches_the_truncated_softmax(case, seeded):
    kw = DIST_CASES[case]
    n = 8000
    base = resolved(**kw)
    rows = [SampleRow(replace(base, seed=i) if seeded else base, tokens=[3, 1], num_generated=0) for i in range(n)]
    res = Sampler(seed=2024).sample(FIXED_ROW.expand(n, -1), rows)
    counts = torch.bincount(torch.tensor(res.tokens), minlength=len(FIXED_ROW)).double()
    keep = hf_keep_mask(FIXED_ROW, kw["temperature"], kw.get("top_k", 0), kw.get("top_p", 1.0), kw.get("min_p", 0.0))
    probs = torch.softmax((FIXED_ROW / kw["temperature"]).masked_fill(~keep, float("-inf")), -1).double()
    assert counts[~keep].sum() == 0, "sampled a token that truncation removed"
    expected = n * probs[keep]
    chi2 = float(((counts[keep] - expected) ** 2 / expected).sum())
    df = int(keep.sum()) - 1
    # Very loose bound (mean df, sd sqrt(2 df)): catches a wrong distribution, never a fair one in practice.
    assert chi2 < df + 8 * (2 * df) ** 0.5 + 10, f"chi2={chi2:.1f} with {df} dof; counts={counts.tolist()}"


# ---------------------------------------------------------------------------------------------- repetition penalty


def _hf_greedy(model, prompt, max_new, tie_gap=1e-4, **kw):
    return greedy_reference(model, prompt, max_new, tie_gap, force_length=False, **kw)


@pytest.mark.parametrize("penalty", [1.5, 0.7])
def test_repetition_penalty_matches_transformers_greedy(qwen3, penalty):
    prompts = [[3, 4, 3, 4, 5, 6, 5, 6, 7, 3, 4, 7], random_prompts([14], seed=52)[0]]
    outs = gen(qwen3, prompts, SamplingParams(temperature=0.0, repetition_penalty=penalty, max_new_tokens=16))
    via_config = gen(qwen3, prompts, None, GenerationConfig(do_sample=False, max_new_tokens=16,
                                                            repetition_penalty=penalty))
    plain = gen(qwen3, prompts, SamplingParams(temperature=0.0, max_new_tokens=16))
    changed = 0
    for i, prompt in enumerate(prompts):
        ref, safe = _hf_greedy(qwen3, prompt, 16, repetition_penalty=penalty)
        assert safe >= 8, "reference has near-ties too early; the test would prove little"
        got = outs[f"req_{i}"].generated_tokens
        assert got[:safe] == ref[:safe]
        assert via_config[f"req_{i}"].generated_tokens[:safe] == ref[:safe]
        changed += got != plain[f"req_{i}"].generated_tokens
    assert changed, "the penalty never changed the output: the test proves nothing"


def test_repetition_penalty_processor_row_matches_transformers():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 32, generator=g) * 3
    history = [[1, 5, 5, 9, 31], [0, 2, 4]]
    rows = [SampleRow(resolved(temperature=0.0, repetition_penalty=p), tokens=h, num_generated=1)
            for p, h in zip([1.3, 0.6], history)]
    res = Sampler(seed=0).sample(logits, rows)
    for i, (p, h) in enumerate(zip([1.3, 0.6], history)):
        ref = RepetitionPenaltyLogitsProcessor(p)(torch.tensor([h]), logits[i:i + 1].clone())
        assert res.tokens[i] == int(ref.argmax())


def test_sampled_logprobs_include_the_repetition_penalty():
    """With a penalty, `logprobs` are under the distribution actually sampled from: penalty, temperature, top-k."""
    g = torch.Generator().manual_seed(4)
    vocab = 40
    logits = torch.randn(64, vocab, generator=g) * 2
    history = [torch.randint(vocab, (6,), generator=g).tolist() for _ in range(64)]
    rows = [SampleRow(resolved(temperature=0.9, top_k=8, repetition_penalty=1.8, seed=i), tokens=h, num_generated=2)
            for i, h in enumerate(history)]
    res = Sampler(seed=0).sample(logits, rows)
    ids = torch.zeros(1, 1, dtype=torch.long)
    for i, h in enumerate(history):
        scores = RepetitionPenaltyLogitsProcessor(1.8)(torch.tensor([h]), logits[i:i + 1].clone()) / 0.9
        scores = TopKLogitsWarper(8)(ids, scores)[0]
        token = res.tokens[i]
        assert torch.isfinite(scores[token]), f"row {i}: token outside the penalised top-k set"
        assert res.logprobs[i] == pytest.approx(float(torch.log_softmax(scores, -1)[token]), abs=TOL)
        assert res.policy_logprobs[i] == pytest.approx(float(torch.log_softmax(logits[i] / 0.9, -1)[token]), abs=TOL)


# ----------------------------------------------------------------------------------------------------- stopping


@pytest.fixture(scope="module")
def greedy_run(qwen3):
    """A prompt, its greedy continuation, and a token `s` first produced at index k >= 2."""
    prompt = random_prompts([10], seed=2)[0]
    tokens = gen(qwen3, [prompt], SamplingParams(temperature=0.0, max_new_tokens=16))["req_0"].generated_tokens
    k = next(i for i in range(2, 12) if tokens[i] not in tokens[:i])
    return prompt, tokens, k, tokens[k]


@pytest.mark.parametrize("how", ["stop_token_ids", "eos_token_id", "eos_list", "generation_config_eos",
                                 "stop_despite_ignore_eos"])
def test_stop_and_eos_end_the_sequence_with_the_token_included(qwen3, greedy_run, how):
    prompt, tokens, k, s = greedy_run
    gen_config = GenerationConfig(max_new_tokens=16, do_sample=False)
    params = {
        "stop_token_ids": SamplingParams(stop_token_ids=[s]),
        "eos_token_id": SamplingParams(eos_token_id=s),
        "eos_list": SamplingParams(eos_token_id=[VOCAB - 1 if s != VOCAB - 1 else 0, s]),
        "generation_config_eos": None,
        "stop_despite_ignore_eos": SamplingParams(stop_token_ids=[s], ignore_eos=True),
    }[how]
    if how == "generation_config_eos":
        gen_config.eos_token_id = s
    out = gen(qwen3, [prompt], params, gen_config)["req_0"]
    assert out.finish_reason == "stop" and out.error is None
    assert out.generated_tokens == tokens[:k + 1]
    assert len(out.logprobs) == len(out.policy_logprobs) == k + 1


def test_ignore_eos_runs_to_max_new_tokens(qwen3, greedy_run):
    prompt, tokens, _, s = greedy_run
    out = gen(qwen3, [prompt], SamplingParams(temperature=0.0, eos_token_id=s, ignore_eos=True, max_new_tokens=16))
    out = out["req_0"]
    assert out.finish_reason == "length" and out.generated_tokens == tokens


def test_no_stop_token_means_length(qwen3, greedy_run):
    prompt, tokens, k, s = greedy_run
    absent = next(t for t in range(VOCAB) if t not in tokens)
    out = gen(qwen3, [prompt], SamplingParams(temperature=0.0, stop_token_ids=[absent], max_new_tokens=16))["req_0"]
    assert out.finish_reason == "length" and out.generated_tokens == tokens
    # A stop token that would come only after max_new_tokens does not count either.
    out = gen(qwen3, [prompt], SamplingParams(temperature=0.0, eos_token_id=s, max_new_tokens=k))["req_0"]
    assert out.finish_reason == "length" and out.generated_tokens == tokens[:k]


def test_min_new_tokens_holds_back_eos_like_transformers(qwen3, greedy_run):
    prompt, tokens, k, s = greedy_run
    min_new = k + 2
    out = gen(qwen3, [prompt], SamplingParams(temperature=0.0, eos_token_id=s, min_new_tokens=min_new,
                                              max_new_tokens=16))["req_0"]
    got = out.generated_tokens
    assert got[:k] == tokens[:k]
    assert s not in got[:min_new], "eos was generated before min_new_tokens"
    assert len(got) >= min_new
    if out.finish_reason == "stop":
        assert got[-1] == s and len(got) > min_new
    else:
        assert out.finish_reason == "length" and len(got) == 16
    ref, safe = _hf_greedy(qwen3, prompt, 16, eos_token_id=s, min_new_tokens=min_new)
    ref = ref[:ref.index(s) + 1] if s in ref[min_new:] else ref
    assert safe >= k + 2
    assert got[:safe] == ref[:safe]
    # With stop_token_ids the guard applies too, and min_new_tokens == max_new_tokens can never stop early.
    out = gen(qwen3, [prompt], SamplingParams(temperature=0.0, stop_token_ids=[s], min_new_tokens=16,
                                              max_new_tokens=16))["req_0"]
    assert out.finish_reason == "length" and len(out.generated_tokens) == 16 and s not in out.generated_tokens


def test_sampled_min_new_tokens_never_emits_eos_early(flat):
    """Sampling from a flat distribution would hit a banned id quickly without the guard."""
    banned = list(range(0, VOCAB, 2))  # half of the vocabulary
    prompts = random_prompts([5] * 6, seed=61)
    outs = gen(flat, prompts, SamplingParams(temperature=1.0, seed=4, stop_token_ids=banned[:64],
                                             eos_token_id=banned[64:], min_new_tokens=6, max_new_tokens=10))
    for out in outs.values():
        assert not set(out.generated_tokens[:6]) & set(banned)
        if out.finish_reason == "stop":
            assert out.generated_tokens[-1] in banned and len(out.generated_tokens) > 6
        assert sum(t in banned for t in out.generated_tokens) <= 1
    assert any(o.finish_reason == "stop" for o in outs.values())


# -------------------------------------------------------------------------------------- steps that sample nothing


def test_sampler_accepts_a_batch_with_no_rows():
    res = Sampler(seed=0).sample(torch.zeros(0, 8), [])
    assert res.tokens == [] and res.logprobs == [] and res.policy_logprobs == [] and res.kept_logmass == []


def test_prompt_longer_than_the_token_budget_is_chunked(qwen3):
    prompt = random_prompts([300], seed=71)[0]
    out = gen(qwen3, [prompt], SamplingParams(temperature=0.0, max_new_tokens=4), max_batch_tokens=256,
              page_size=16)["req_0"]
    ref = gen(qwen3, [prompt], SamplingParams(temperature=0.0, max_new_tokens=4), page_size=16)["req_0"]
    assert out.error is None and out.generated_tokens == ref.generated_tokens


def one_level_draw(logprobs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """The draw's rule over the whole row at once: the first token whose cumulative units of 2^-40 pass
    floor(u * total units)."""
    cum = lp_units(logprobs).cumsum(dim=-1)
    threshold = (uniforms[:, None] * cum[:, -1:].double()).floor().long()
    return torch.searchsorted(cum, threshold, right=True).squeeze(1)


def draw_cases(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(vocab)
    logprobs = torch.log_softmax(torch.randn(12, vocab, generator=g) * 3, dim=-1)
    logprobs[::3, ::2] = float("-inf")  # masked tokens are never drawn
    logprobs[2, 1::2] = -27.999  # just above LOWEST_LP, and below 2^-40 anyway: no units
    if vocab > 4:
        logprobs[4, 1], logprobs[5, 3] = float("nan"), 3e-7  # NaN weighs nothing; rounded above 0 counts as 0
    uniforms = torch.rand(12, generator=g, dtype=torch.float64)
    uniforms[0], uniforms[1] = 0.0, 1.0 - 2**-53
    return logprobs, uniforms


@pytest.mark.parametrize("vocab", [7, 1024, 2049, 151_936])
def test_two_level_inverse_cdf_draws_what_one_cumulative_sum_draws(vocab):
    """The blockwise search (and the C kernel where it is built) finds the token an int64 cumulative sum over the
    whole row finds, for vocabularies that are and are not a multiple of the block, with masked (-inf) tokens and
    ones that weigh nothing (NaN, below 2^-40), and at u = 0 and u -> 1."""
    logprobs, uniforms = draw_cases(vocab)
    expected = one_level_draw(logprobs, uniforms)
    assert torch.equal(inverse_cdf(logprobs, uniforms), expected)
    with mock.patch("rollout.engine.sample.sampler.draw_tokens", lambda *args: None):
        assert torch.equal(inverse_cdf(logprobs, uniforms), expected)
    assert bool((logprobs.gather(1, expected[:, None]) > -27.7).all())


@pytest.mark.skipif(load_kernel() is None, reason="no kernel library on this machine: the PyTorch path is the only one")
def test_the_draw_kernel_serves_cpu_rows_and_refuses_bad_uniforms():
    logprobs, uniforms = draw_cases(300)
    assert torch.equal(draw_tokens(logprobs, uniforms), one_level_draw(logprobs, uniforms))
    with pytest.raises(ValueError, match="one float64 CPU uniform per row"):
        draw_tokens(logprobs, uniforms.float())
    assert draw_tokens(logprobs.double(), uniforms) is None


def test_a_row_without_units_draws_its_argmax():
    logprobs = torch.tensor([[-30.0, -29.0, -29.0, float("-inf")], [-40.0, float("nan"), -31.0, float("nan")]])
    uniforms = torch.tensor([0.5, 0.9], dtype=torch.float64)
    assert inverse_cdf(logprobs, uniforms).tolist() == [1, 1]
    with mock.patch("rollout.engine.sample.sampler.draw_tokens", lambda *args: None):
        assert inverse_cdf(logprobs, uniforms).tolist() == [1, 1]


@pytest.mark.parametrize("seed", range(3))
def test_units_follow_exp_to_its_rounding(seed):
    """lp_units is floor(exp(lp) * 2^40) up to its polynomial's error: within one unit of float64's exp, never above
    2^40 for a log-probability of at most 0."""
    g = torch.Generator().manual_seed(seed)
    logprobs = -torch.rand(100_000, generator=g) * 28
    logprobs[:4] = torch.tensor([0.0, -1e-30, -27.7, 3e-7])
    exact = (logprobs.double().clamp_max(0.0).exp() * 2**40).floor().long()  # rounded above 0: counts as 0
    units = lp_units(logprobs[None])[0]
    assert int((units - exact).abs().max()) <= 1
    assert int(units.max()) <= 2**40
