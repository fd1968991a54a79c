"""Structured outputs (xgrammar): a random-weight model under a JSON schema, a regex, an EBNF grammar or a list of
choices must produce text that the schema validator / `re` / the choice list accepts, greedy and sampled; specs
compile once; all constrained rows of a step are filled in one call; the matcher survives preemption and rolls back
with its sequence; the logprob contract holds; bad specs fail with the field named.
"""

from __future__ import annotations

import json
import re
import sys

import jsonschema
import pytest
import torch
import xgrammar as xgr
from transformers import GenerationConfig

from rollout import ContinuousBatchingConfig, SamplingParams
from rollout.engine.core.request import ErrorKind
from rollout.engine.engine import LLMEngine
from rollout.engine.sample.structured_output import StructuredOutput, allowed_tokens
from rollout.validation import InvalidRequestError
from tests.helpers.models import random_prompts, run_engine, tiny_model
from tests.helpers.tokenizers import json_tokenizer

TOL = 1e-5
MODEL_VOCAB = 384  # larger than the tokenizer's 320: the padded ids must never be sampled
EOS = 1

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,6}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["name", "age", "ok", "tags", "unit"],
}
REGEX = r"\d{3}-[a-z]{2,4}"
GRAMMAR = 'root ::= "(" item ("," item){0,3} ")"\nitem ::= [a-z] | [0-9] [0-9]'
GRAMMAR_AS_REGEX = r"\((?:[a-z]|\d\d)(?:,(?:[a-z]|\d\d)){0,3}\)"
CHOICES = ["positive", "negative", "neutral", 'say "hi"']


@pytest.fixture(scope="module")
def tok():
    return json_tokenizer()


@pytest.fixture(scope="module")
def model():
    """Flat next-token distributions (unscaled head): samples wander, so only the grammar keeps them valid."""
    return tiny_model("qwen3", seed=1, lm_head_scale=1.0, vocab_size=MODEL_VOCAB)


def engine_for(model, tok, **cfg) -> LLMEngine:
    cfg.setdefault("page_size", 8)
    cfg.setdefault("num_blocks", 256)
    return LLMEngine(model, GenerationConfig(), ContinuousBatchingConfig(**cfg), tokenizer=tok)


def run(model, tok, prompts, params_list, **cfg) -> dict:
    engine = engine_for(model, tok, **cfg)
    for j, (prompt, params) in enumerate(zip(prompts, params_list)):
        engine.add_request(prompt, f"r{j}", params)
    return run_engine(engine)


def text_of(tok, out) -> str:
    return tok.decode(out.generated_tokens, skip_special_tokens=True)


def valid(kind: str, text: str) -> bool:
    if kind == "json_schema":
        try:
            jsonschema.validate(json.loads(text), SCHEMA)
        except (json.JSONDecodeError, jsonschema.ValidationError):
            return False
        return True
    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    if kind == "grammar":
        return re.fullmatch(GRAMMAR_AS_REGEX, text) is not None
    return text in CHOICES


SPECS = {"json_schema": SCHEMA, "regex": REGEX, "grammar": GRAMMAR, "choice": CHOICES}


# ------------------------------------------------------------------------------------------- outputs follow specs


@pytest.mark.parametrize("kind", list(SPECS))
def test_greedy_and_sampled_outputs_follow_the_spec(model, tok, kind):
    prompts = random_prompts([5, 13, 8], seed=3, vocab=320)
    params = [SamplingParams(temperature=0.0, max_new_tokens=80, eos_token_id=EOS, **{kind: SPECS[kind]}),
              SamplingParams(temperature=1.0, seed=11, n=4, max_new_tokens=80, eos_token_id=EOS,
                             **{kind: SPECS[kind]}),
              SamplingParams(temperature=1.3, top_k=40, seed=5, n=2, max_new_tokens=80, eos_token_id=EOS,
                             **{kind: SPECS[kind]})]
    outs = run(model, tok, prompts, params)
    assert len(outs) == 7
    texts = set()
    for rid, out in outs.items():
        text = text_of(tok, out)
        assert out.error is None and out.finish_reason == "stop", (rid, out.finish_reason, text)
        assert valid(kind, text), f"{rid}: {text!r} does not follow the {kind}"
        assert max(out.generated_tokens) < len(tok), "a padded vocabulary id was sampled"
        texts.add(text)
    assert len(texts) > 2, "samples should differ: the grammar, not the model, made them valid"


def test_without_a_spec_the_same_model_does_not_produce_valid_json(model, tok):
    """The control: the constraint is what makes the outputs above valid."""
    prompts = random_prompts([5, 13, 8], seed=3, vocab=320)
    outs = run(model, tok, prompts, [SamplingParams(temperature=1.0, seed=11, n=4, max_new_tokens=80)] * 3)
    assert not any(valid("json_schema", text_of(tok, o)) for o in outs.values())


def test_the_request_ends_when_only_eos_remains_without_a_step_for_it(model, tok):
    engine = engine_for(model, tok)
    engine.add_request([5, 6, 7], "c", SamplingParams(temperature=1.0, seed=1, max_new_tokens=50, eos_token_id=EOS,
                                                      choice=["positive"]))
    out = run_engine(engine)["c"]
    assert text_of(tok, out) == "positive" and out.finish_reason == "stop"
    assert EOS not in out.generated_tokens
    assert engine.counters["steps"] == len(out.generated_tokens), "no step may be spent sampling the forced EOS"
    # Several tokenizations spell the choice, so tokens are sampled among them: the grammar only masks.
    assert torch.tensor(out.logprobs) == pytest.approx(torch.tensor(out.policy_logprobs) - torch.tensor(
        out.kept_logmass), abs=TOL)


def test_a_regex_that_may_go_on_stops_on_a_sampled_eos(model, tok):
    """Once `[a-z]{2,4}` has 2 letters EOS is allowed next to more letters; sampling picks (a logit bias makes EOS
    likely), the stop rule applies."""
    outs = run(model, tok, [[9, 10]] * 2, [SamplingParams(temperature=1.0, seed=s, n=8, max_new_tokens=20,
                                                          eos_token_id=EOS, regex=REGEX, logit_bias={EOS: 3.0})
                                           for s in (1, 2)])
    ends = {o.generated_tokens[-1] == EOS for o in outs.values()}
    assert all(valid("regex", text_of(tok, o)) and o.finish_reason == "stop" for o in outs.values())
    assert ends == {True, False}, "some samples should stop on EOS, some on the grammar's end"


# ---------------------------------------------------------------------------------------- compiling and filling


def test_each_distinct_spec_compiles_once(model, tok):
    engine = engine_for(model, tok)
    for j in range(3):
        engine.add_request([3, 4, j], f"s{j}", SamplingParams(max_new_tokens=4, n=2, json_schema=SCHEMA))
    engine.add_request([3, 4], "text", SamplingParams(max_new_tokens=4, json_schema=json.dumps(SCHEMA)))
    engine.add_request([3, 4], "re", SamplingParams(max_new_tokens=4, regex=REGEX))
    run_engine(engine)
    assert engine.grammars().num_compiled == 2
    engine.add_request([8], "again", SamplingParams(max_new_tokens=4, regex=REGEX))
    run_engine(engine)
    assert engine.grammars().num_compiled == 2


def test_all_constrained_rows_of_a_step_are_filled_in_one_call(model, tok, monkeypatch):
    calls: list[list[int]] = []
    real = xgr.BatchGrammarMatcher.batch_fill_next_token_bitmask

    def spy(self, matchers, bitmask, indices=None, debug_print=False):
        calls.append(list(indices))
        return real(self, matchers, bitmask, indices, debug_print)

    monkeypatch.setattr(xgr.BatchGrammarMatcher, "batch_fill_next_token_bitmask", spy)
    engine = engine_for(model, tok)
    engine.add_request([1, 2, 3], "plain", SamplingParams(temperature=1.0, seed=0, max_new_tokens=12))
    engine.add_request([4, 5], "json", SamplingParams(temperature=1.0, seed=1, n=3, max_new_tokens=12,
                                                      json_schema=SCHEMA))
    engine.add_request([6], "re", SamplingParams(temperature=1.0, seed=2, max_new_tokens=12, regex=REGEX))
    steps = []
    real_sample = engine.sampler.sample

    def sample(logits, rows):
        before = len(calls)
        result = real_sample(logits, rows)
        steps.append(([i for i, r in enumerate(rows) if r.grammar is not None], calls[before:]))
        return result

    engine.sampler.sample = sample
    run_engine(engine)
    batched = [(rows, made) for rows, made in steps if len(rows) > 1]
    assert len(batched) >= 5, "too few steps with several constrained rows: the test proves little"
    for rows, made in batched:
        assert made == [rows], "one fill call per step, covering every constrained row"


# --------------------------------------------------------------------------------- the logprob contract, batches


@torch.no_grad()
def fresh_logits(model, prompt, generated):
    full = torch.tensor([prompt + generated])
    return model(full).logits[0, len(prompt) - 1:full.shape[1] - 1].float()


def test_logprob_contract_under_a_grammar(model, tok):
    prompts = random_prompts([6, 11], seed=4, vocab=320)
    params = SamplingParams(temperature=0.7, top_p=0.95, seed=3, n=2, max_new_tokens=60, eos_token_id=EOS,
                            json_schema=SCHEMA)
    outs = run(model, tok, prompts, [params, params])
    for rid, out in outs.items():
        prompt = prompts[int(rid[1])]
        logits = fresh_logits(model, prompt, out.generated_tokens)
        tokens = torch.tensor(out.generated_tokens)
        policy_ref = torch.log_softmax(logits / 0.7, -1).gather(1, tokens[:, None]).squeeze(1)
        policy, sampled, kept = (torch.tensor(x) for x in (out.policy_logprobs, out.logprobs, out.kept_logmass))
        assert policy == pytest.approx(policy_ref, abs=TOL), "policy_logprobs are the raw policy's"
        assert sampled == pytest.approx(policy - kept, abs=TOL), "a grammar only masks: the identity holds"
        assert bool((kept <= 1e-6).all()) and bool((kept < -0.5).any())


def test_seeded_constrained_request_is_batch_invariant(model, tok):
    target = SamplingParams(temperature=1.0, seed=99, max_new_tokens=80, eos_token_id=EOS, json_schema=SCHEMA)
    prompt = random_prompts([9], seed=8, vocab=320)[0]
    alone = run(model, tok, [prompt], [target])["r0"]
    prompts = random_prompts([3 + i for i in range(12)], seed=9, vocab=320)
    crowd = [SamplingParams(temperature=t, seed=i, max_new_tokens=30, **spec) for i, (t, spec) in enumerate(
        [(1.0, {}), (0.0, {"regex": REGEX}), (1.2, {"choice": CHOICES}), (0.8, {"logit_bias": {5: 9.0}})] * 3)]
    prompts.insert(5, prompt)
    crowd.insert(5, target)
    among = run(model, tok, prompts, crowd)["r5"]
    assert among.generated_tokens == alone.generated_tokens
    assert among.logprobs == pytest.approx(alone.logprobs, abs=TOL)


def test_constrained_requests_leave_unconstrained_ones_alone(model, tok):
    prompts = random_prompts([7, 12], seed=12, vocab=320)
    plain = SamplingParams(temperature=0.0, max_new_tokens=10)
    alone = run(model, tok, prompts, [plain, plain])
    mixed = run(model, tok, prompts + prompts, [plain, plain, SamplingParams(temperature=0.0, max_new_tokens=10,
                                                                             regex=REGEX),
                                                SamplingParams(temperature=1.0, seed=1, json_schema=SCHEMA)])
    assert [mixed[r].generated_tokens for r in ("r0", "r1")] == [alone[r].generated_tokens for r in ("r0", "r1")]


def test_the_grammar_survives_preemption_and_recompute(model, tok):
    prompts = random_prompts([14, 30, 9, 22, 17, 26], seed=91, vocab=320)
    params = [SamplingParams(temperature=1.0, seed=100 + i, max_new_tokens=40, eos_token_id=EOS,
                             **{kind: SPECS[kind]}) for i, kind in enumerate(list(SPECS) * 2)]
    roomy = run(model, tok, prompts, params)
    engine = engine_for(model, tok, page_size=4, num_blocks=22)
    for j, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(prompt, f"r{j}", p)
    tight = run_engine(engine)
    assert engine.stats().preemptions > 0, "the tight cache must force preemption"
    for rid, out in roomy.items():
        assert tight[rid].generated_tokens == out.generated_tokens, rid
        assert out.error is None


def test_the_matcher_rolls_back_to_its_sequence(model, tok):
    engine = engine_for(model, tok)
    constraint = engine.validate_sampling(SamplingParams(json_schema=SCHEMA, eos_token_id=EOS)).constraint
    tokens = tok('{"name": "ab", "age": 7')["input_ids"]
    state = constraint.new_state()
    for t in tokens:
        assert state.accept(t)

    def mask(s) -> torch.Tensor:
        bitmask = xgr.allocate_token_bitmask(1, MODEL_VOCAB)
        s.matcher.fill_next_token_bitmask(bitmask)
        return allowed_tokens(bitmask[0], MODEL_VOCAB)

    for keep in (len(tokens) - 1, 3, 0):
        state.sync(keep)
        fresh = constraint.new_state()
        for t in tokens[:keep]:
            fresh.accept(t)
        assert state.num_accepted == keep and torch.equal(mask(state), mask(fresh))
    with pytest.raises(RuntimeError, match="behind"):
        state.sync(2)


# ----------------------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize("kw, param, message", [
    (dict(regex="(unclosed"), "regex", "could not be compiled"),
    (dict(json_schema={"type": "objekt"}), "json_schema", "could not be compiled"),
    (dict(json_schema="{not json"), "json_schema", "not valid JSON"),
    (dict(json_schema=[1, 2]), "json_schema", "must be a JSON schema object"),
    (dict(grammar="root ::= undefined_rule"), "grammar", "could not be compiled"),
    (dict(choice=[]), "choice", "non-empty list"),
    (dict(choice="yes"), "choice", "non-empty list"),
    (dict(regex=REGEX, choice=["a"]), "choice", "are both set"),
])
def test_bad_specs_name_the_field(model, tok, kw, param, message):
    engine = engine_for(model, tok)
    with pytest.raises(InvalidRequestError) as err:
        engine.validate_sampling(SamplingParams(**kw))
    assert err.value.param == param and message in str(err.value)
    engine.add_request([1, 2], "bad", SamplingParams(**kw))  # through add_request: the request fails alone
    out = run_engine(engine)["bad"]
    assert out.error_kind == ErrorKind.INVALID_REQUEST and message in out.error


def test_structured_outputs_need_a_tokenizer_and_xgrammar(model, tok, monkeypatch):
    no_tokenizer = LLMEngine(model, GenerationConfig(), ContinuousBatchingConfig(page_size=8, num_blocks=16))
    with pytest.raises(InvalidRequestError, match=r"regex .*needs a tokenizer"):
        no_tokenizer.validate_sampling(SamplingParams(regex=REGEX))
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # as if it were not installed
    with pytest.raises(InvalidRequestError, match=r"pip install 'rollout\[structured\]'"):
        engine_for(model, tok).validate_sampling(SamplingParams(regex=REGEX))


def test_json_schema_text_and_dict_are_one_spec(model, tok):
    engine = engine_for(model, tok)
    as_dict = engine.validate_sampling(SamplingParams(json_schema=SCHEMA)).structured
    as_text = engine.validate_sampling(SamplingParams(json_schema=json.dumps(SCHEMA))).structured
    assert as_dict == as_text == StructuredOutput("json_schema", json.dumps(SCHEMA))
