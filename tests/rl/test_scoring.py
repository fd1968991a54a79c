"""RolloutGenerator.score: per-token logprobs of given completions through the engine, against a fresh forward."""

from __future__ import annotations

import pytest
import torch

from rollout import ContinuousBatchingConfig, SamplingParams
from rollout.rl.generator import RolloutGenerator
from tests.helpers.models import perturbed, random_prompts, tiny_model
from tests.helpers.tokenizers import tiny_tokenizer

TOL = 1e-5


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen3")


@pytest.fixture()
def gen(model):
    with RolloutGenerator(model, tokenizer=tiny_tokenizer(),
                          continuous_batching_config=ContinuousBatchingConfig(page_size=8, num_blocks=96,
                                                                              max_batch_tokens=48)) as g:
        yield g


@torch.no_grad()
def fresh_logprobs(model, prompt: list[int], completion: list[int], temperature: float = 1.0) -> torch.Tensor:
    logits = model(torch.tensor([prompt + completion])).logits[0].float() / temperature
    rows = logits[len(prompt) - 1:len(prompt) - 1 + len(completion)].log_softmax(-1)
    return rows.gather(1, torch.tensor(completion)[:, None]).squeeze(1) if completion else torch.zeros(0)


def test_scores_equal_a_fresh_forward_and_share_the_prompt(gen, model):
    prompt, other = random_prompts([29, 6], seed=1)
    completions = random_prompts([12, 40, 1], seed=2) + [[]]
    batch = gen.score([prompt, prompt, prompt, other], completions)
    assert len(batch) == 4 and batch.weight_version == gen.weight_version
    for s, p, c in zip(batch.samples, [prompt, prompt, prompt, other], completions):
        assert s.prompt_ids == p and s.completion_ids == c and len(s.logprobs) == len(c)
        assert torch.allclose(torch.tensor(s.logprobs), fresh_logprobs(model, p, c), atol=TOL)
    # The prompt's 3 full blocks are computed once and reused by the other completions of it.
    assert batch.stats["prefix_hit_tokens"] >= 2 * 3 * 8
    tensors = batch.to_tensors()
    assert tensors["logprobs"].shape == (4, 40) and tensors["completion_mask"].sum() == 53
    assert torch.equal(tensors["logprobs"][1], torch.tensor(batch.samples[1].logprobs))


def test_scores_reproduce_the_policy_logprobs_of_generation(gen):
    prompts = random_prompts([11, 17], seed=3)
    rollout = gen.generate(prompts, n=2, sampling_params=SamplingParams(temperature=0.7, top_p=0.9, seed=4,
                                                                        max_new_tokens=10))
    scored = gen.score([s.prompt_ids for s in rollout.samples], [s.completion_ids for s in rollout.samples],
                       temperature=0.7, top_logprobs=3)
    for sample, score in zip(rollout.samples, scored.samples):
        assert torch.allclose(torch.tensor(score.logprobs), torch.tensor(sample.policy_logprobs), atol=TOL)
        assert len(score.top_logprobs) == len(score.completion_ids)
        assert all(len(top) == 3 and max(top.values()) >= lp - TOL
                   for top, lp in zip(score.top_logprobs, score.logprobs))


def test_scores_follow_weight_updates(gen, model):
    prompt, completion = random_prompts([20, 15], seed=5)
    before = gen.score([prompt], [completion]).samples[0].logprobs
    new = perturbed(model, seed=3, scale=0.2)
    version = gen.update_weights(new)
    after = gen.score([prompt], [completion])
    assert after.weight_version == version
    assert torch.allclose(torch.tensor(after.samples[0].logprobs), fresh_logprobs(new, prompt, completion), atol=TOL)
    assert not torch.allclose(torch.tensor(after.samples[0].logprobs), torch.tensor(before), atol=1e-3)


def test_text_pairs_and_bad_pairs(gen, model):
    tok = gen.tokenizer
    batch = gen.score(["w1 w2 w3"], ["w4 w5"])
    prompt, completion = tok("w1 w2 w3")["input_ids"], tok("w4 w5", add_special_tokens=False)["input_ids"]
    assert batch.samples[0].completion_ids == completion
    assert torch.allclose(torch.tensor(batch.samples[0].logprobs), fresh_logprobs(model, prompt, completion),
                          atol=TOL)
    with pytest.raises(ValueError, match="one completion per prompt"):
        gen.score([[1, 2]], [[3], [4]])
    with pytest.raises(ValueError, match="pair 1"):
        gen.score([[1, 2], [3]], [[4], [5, 999]])
    with pytest.raises(ValueError, match="prompt_logprobs_temperature"):
        gen.score([[1, 2]], [[3]], temperature=0.0)
    assert gen.manager.stats().running == 0
