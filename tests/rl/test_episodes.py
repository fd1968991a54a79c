"""Multi-turn episodes: token in / token out, exact logprobs, KV kept across turns, interleaving, failures alone."""

import asyncio
import random
import threading

import pytest
import torch

from rollout import ContinuousBatchingConfig, RolloutGenerator, SamplingParams
from rollout.rl.agents import EnvResponse, per_episode
from tests.helpers.models import VOCAB, random_prompts, tiny_model
from tests.helpers.tokenizers import tiny_tokenizer

CB = ContinuousBatchingConfig(page_size=8, num_blocks=512)
SAMPLED = SamplingParams(temperature=1.0, max_new_tokens=6, seed=3, ignore_eos=True)


class ScriptedEnv:
    """Each episode lasts 3-6 turns; every answer appends 1-10 random tokens. Remembers what it appended."""

    def __init__(self, seed: int = 0):
        self.seed = seed
        self.appended: dict[int, list[list[int]]] = {}
        self.turns_of: dict[int, int] = {}

    def step(self, turn):
        rng = random.Random(hash((self.seed, turn.episode, turn.turn)))
        last = self.turns_of.setdefault(turn.episode, random.Random(hash((self.seed, turn.episode))).randint(3, 6))
        if turn.turn + 1 >= last:
            return EnvResponse(reward=1.0, done=True)
        tokens = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 10))]
        self.appended.setdefault(turn.episode, []).append(tokens)
        return EnvResponse(token_ids=tokens, reward=0.25)


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen3")


@torch.no_grad()
def _forward_logprobs(model, ids: list[int]) -> torch.Tensor:
    """log_softmax of one plain forward over the whole sequence: row p scores token p + 1."""
    logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def test_episodes_are_exact_token_sequences_scored_as_one_forward(model):
    prompts = random_prompts([11, 7, 20], seed=1)
    env = ScriptedEnv()
    with RolloutGenerator(model, continuous_batching_config=CB) as gen:
        batch = gen.run_episodes(prompts, env, n=2, sampling_params=SAMPLED, max_turns=10)
    assert len(batch) == 6 and batch.group_sizes == [2, 2, 2]
    for e in batch.episodes:
        assert e.finish_reason == "done" and e.error is None
        assert e.token_ids[:len(e.prompt_ids)] == prompts[e.prompt_index]
        assert 3 <= len(e.turns) <= 6 and e.rewards == [0.25] * (len(e.turns) - 1) + [1.0]
        # environment tokens are exactly what the environment gave, masked out; model tokens are the rest
        env_tokens = [e.token_ids[t.model_end:t.end] for t in e.turns if t.end > t.model_end]
        assert env_tokens == env.appended[batch.episodes.index(e)]
        expected_mask = [0] * len(e.prompt_ids)
        for t in e.turns:
            expected_mask += [1] * (t.model_end - t.start) + [0] * (t.end - t.model_end)
        assert e.model_mask == expected_mask and len(e.token_ids) == len(e.model_mask)
        # model-token logprobs: what one forward over the final sequence gives (fp32, temperature 1)
        positions = [p for p, m in enumerate(e.model_mask) if m]
        assert len(positions) == len(e.logprobs) == len(e.weight_versions) == 6 * len(e.turns)
        ref = _forward_logprobs(model, e.token_ids)
        expected = torch.tensor([ref[p - 1, e.token_ids[p]].item() for p in positions])
        assert torch.allclose(torch.tensor(e.policy_logprobs), expected, atol=1e-5, rtol=0)
        assert e.weight_versions == [0] * len(positions)
    # no re-prefill: each prompt once (its group shares it), then per continued turn the appended tokens plus the
    # previous turn's last token (sampled, never run through the model yet)
    appended = sum(len(a) + 1 for turns in env.appended.values() for a in turns)
    assert batch.stats["prefill_tokens"] == sum(map(len, prompts)) + appended
    # every token but each episode's last runs through the model once; a group's second episode forks off the
    # first one's prompt
    assert batch.stats["prefill_tokens"] + batch.stats["decode_tokens"] == sum(
        len(e.token_ids) - 1 for e in batch.episodes) - sum(map(len, prompts))
    assert batch.stats["turns"] == sum(len(e.turns) for e in batch.episodes)


def test_episodes_reproduce_and_resubmission_would_prefill_far_more(model):
    """Same seed, same episodes; and the conversation re-submitted as a new prompt every turn (no prefix cache)
    prefills the whole conversation again each turn."""
    prompts = random_prompts([15, 9], seed=4)
    with RolloutGenerator(model, continuous_batching_config=CB) as gen:
        first = gen.run_episodes(prompts, ScriptedEnv(1), n=3, sampling_params=SAMPLED)
        again = gen.run_episodes(prompts, ScriptedEnv(1), n=3, sampling_params=SAMPLED)
    assert [e.token_ids for e in first.episodes] == [e.token_ids for e in again.episodes]
    resubmitted = sum(t.start for e in first.episodes for t in e.turns)  # each turn's prompt: the conversation so far
    assert first.stats["prefill_tokens"] * 3 < resubmitted


class _FastFirst:
    """Episode 0's first environment call blocks until every other episode has finished (at most 60 s): if one slow
    environment stalled the others, it would wait the full 60 s and `others_finished_first` would be False."""

    def __init__(self, others: int, last_turn: int) -> None:
        self.others, self.last_turn = others, last_turn
        self.finished = 0
        self.all_finished = threading.Event()
        self.lock = threading.Lock()
        self.others_finished_first: bool | None = None

    def done(self, turn) -> bool:
        done = turn.turn == self.last_turn
        if done and turn.episode != 0:
            with self.lock:
                self.finished += 1
                if self.finished == self.others:
                    self.all_finished.set()
        return done


def test_a_slow_environment_does_not_stall_the_other_episodes(model):
    class Env(_FastFirst):
        def step(self, turn):
            if turn.episode == 0 and turn.turn == 0:
                self.others_finished_first = self.all_finished.wait(60)
            return EnvResponse(token_ids=[5, 6, 7], done=self.done(turn))

    with RolloutGenerator(model, continuous_batching_config=CB) as gen:
        env = Env(others=3, last_turn=2)
        batch = gen.run_episodes(random_prompts([12, 10, 8, 14], seed=2), env, sampling_params=SAMPLED)
    assert all(e.finish_reason == "done" and len(e.turns) == 3 for e in batch.episodes)
    assert env.others_finished_first, "the fast episodes waited for the slow environment"


def test_async_environments_interleave_too(model):
    class Env(_FastFirst):
        async def step(self, turn):
            if turn.episode == 0 and turn.turn == 0:
                for _ in range(6000):  # the other episodes' calls run on this same event loop meanwhile
                    if self.all_finished.is_set():
                        break
                    await asyncio.sleep(0.01)
                self.others_finished_first = self.all_finished.is_set()
            return EnvResponse(token_ids=[9], reward=1.0, done=self.done(turn))

    with RolloutGenerator(model, continuous_batching_config=CB) as gen:
        env = Env(others=2, last_turn=1)
        batch = gen.run_episodes(random_prompts([12, 10, 8], seed=2), env, sampling_params=SAMPLED)
    assert [e.finish_reason for e in batch.episodes] == ["done"] * 3
    assert env.others_finished_first, "the fast episodes waited for the slow environment"


def test_an_environment_error_or_timeout_ends_that_episode_alone(model):
    release, hung_call_returned = threading.Event(), threading.Event()

    class Env:
        def step(self, turn):
            if turn.episode == 0 and turn.turn == 1:
                raise RuntimeError("tool crashed")
            if turn.episode == 1:
                release.wait(60)  # hangs past env_timeout, until the test releases it
                hung_call_returned.set()
            return EnvResponse(token_ids=[3, 4], done=turn.turn == 2)

    with RolloutGenerator(model, continuous_batching_config=CB) as gen:
        batch = gen.run_episodes(random_prompts([12, 10, 8], seed=2), Env(), sampling_params=SAMPLED,
                                 env_timeout=3.0)
        assert gen.stats().used_blocks == 0, "an ended episode kept its KV"
        assert not hung_call_returned.is_set(), "run_episodes waited for the hung call instead of timing it out"
    release.set()
    broken, hung, fine = batch.episodes
    assert broken.finish_reason == "error" and "tool crashed" in broken.error and len(broken.turns) == 2
    assert hung.finish_reason == "error" and "env_timeout=3.0" in hung.error and len(hung.turns) == 1
    assert fine.finish_reason == "done" and fine.error is None and len(fine.turns) == 3


def test_bad_answers_end_the_episode_with_a_reason(model):
    class Env:
        def step(self, turn):
            return {0: EnvResponse(token_ids=[VOCAB + 5]), 1: "not a response",
                    2: EnvResponse(token_ids=[1], text="w1")}[turn.episode]

    with RolloutGenerator(model, continuous_batching_config=CB) as gen:
        batch = gen.run_episodes(random_prompts([5, 6, 7], seed=2), Env(), sampling_params=SAMPLED)
    errors = [e.error for e in batch.episodes]
    assert all(e.finish_reason == "error" for e in batch.episodes)
    assert "outside the model's vocabulary" in errors[0]
    assert "must return an EnvResponse" in errors[1]
    assert "at most one of token_ids, text and messages" in errors[2]


def test_max_turns_and_max_length_end_episodes(model):
    class Endless:
        def step(self, turn):
            return EnvResponse(token_ids=[1, 2, 3])

    with RolloutGenerator(model, continuous_batching_config=CB) as gen:
        capped = gen.run_episodes(random_prompts([5], seed=2), Endless(), sampling_params=SAMPLED, max_turns=3)
        short = gen.run_episodes(random_prompts([5], seed=2), Endless(), sampling_params=SAMPLED, max_length=30)
        with pytest.raises(ValueError, match="max_turns must be an int >= 1"):
            gen.run_episodes(random_prompts([5], seed=2), Endless(), max_turns=0)
        with pytest.raises(ValueError, match="leave no room for a model turn"):
            gen.run_episodes(random_prompts([40], seed=2), Endless(), max_length=30)
        with pytest.raises(ValueError, match="env must have a step"):
            gen.run_episodes(random_prompts([5], seed=2), object())
    (e,) = capped.episodes
    assert e.finish_reason == "max_turns" and len(e.turns) == 3 and e.turns[-1].end == len(e.token_ids)
    (e,) = short.episodes
    assert e.finish_reason == "length" and len(e.token_ids) <= 30
    assert e.turns[-1].model_end - e.turns[-1].start <= 6


def test_text_and_message_answers_are_tokenized_on_their_own(model):
    tok = tiny_tokenizer()

    class Env:
        def step(self, turn):
            if turn.turn == 0:
                return EnvResponse(text="w5 w6")
            return EnvResponse(messages=[{"role": "user", "content": "w7 w8"}], done=turn.turn == 2)

    params = SamplingParams(temperature=1.0, max_new_tokens=4, seed=0, eos_token_id=tok.eos_token_id,
                            min_new_tokens=4)
    with RolloutGenerator(model, tok, continuous_batching_config=CB) as gen:
        batch = gen.run_episodes([[{"role": "user", "content": "w1 w2"}]], Env(), sampling_params=params)
    (e,) = batch.episodes
    t0, t1, _ = e.turns
    assert e.token_ids[t0.model_end:t0.end] == tok("w5 w6", add_special_tokens=False)["input_ids"]
    # the message framed as the template frames it, then the next assistant turn's generation prompt
    assert e.token_ids[t1.model_end:t1.end] == tok("<user> w7 w8 </s> <assistant>", add_special_tokens=False)[
        "input_ids"]
    assert e.token_ids[:len(e.prompt_ids)] == tok.apply_chat_template([{"role": "user", "content": "w1 w2"}],
                                                                       add_generation_prompt=True)["input_ids"]


def test_a_template_that_rewrites_history_is_refused_for_messages(model):
    tok = tiny_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}{{ messages | length }}"

    class Env:
        def step(self, turn):
            return EnvResponse(messages=[{"role": "tool", "content": "w3"}])

    with RolloutGenerator(model, tok, continuous_batching_config=CB) as gen:
        batch = gen.run_episodes([[1, 2, 3]], Env(), sampling_params=SAMPLED)
    assert "not prefix-preserving" in batch.episodes[0].error


def test_per_episode_environments_reset_and_close(model):
    made, closed = [], []

    class Counter:
        def __init__(self):
            self.steps = 0
            made.append(self)

        def reset(self, info):
            self.info = info

        def step(self, turn):
            assert turn.episode == self.info.episode
            self.steps += 1
            return EnvResponse(token_ids=[7], reward=self.steps, done=self.steps == 2)

        def close(self, info):
            closed.append(info.episode)

    env = per_episode(Counter)
    with RolloutGenerator(model, continuous_batching_config=CB) as gen:
        batch = gen.run_episodes(random_prompts([6, 9], seed=5), env, n=2, sampling_params=SAMPLED)
    assert len(made) == 4 and all(e.rewards == [1.0, 2.0] for e in batch.episodes)
    assert sorted(closed) == [0, 1, 2, 3]  # every close ran before run_episodes returned


def test_to_tensors_masks_environment_tokens(model):
    with RolloutGenerator(model, continuous_batching_config=CB) as gen:
        batch = gen.run_episodes(random_prompts([11, 7], seed=1), ScriptedEnv(), sampling_params=SAMPLED)
    t = batch.to_tensors(pad_token_id=0)
    for i, e in enumerate(batch.episodes):
        c = len(e.completion_ids)
        assert t["completion_ids"][i, :c].tolist() == e.completion_ids
        assert t["completion_mask"][i].sum() == c
        assert t["model_mask"][i, :c].tolist() == e.completion_mask
        assert t["model_mask"][i].sum() == len(e.logprobs)
        assert torch.equal(t["policy_logprobs"][i][t["model_mask"][i].bool()], torch.tensor(e.policy_logprobs))
        assert (t["logprobs"][i][~t["model_mask"][i].bool()] == 0).all()
        assert t["rewards"][i] == pytest.approx(e.reward)
