"""GPU paths: the CUDA SDPA path must be exact like the CPU one; flash-attn (when installed) must agree with
model.generate. Skipped on machines without CUDA (like CI); run them where a GPU is lent."""

import pytest
import torch
from transformers import GenerationConfig

from rollout import ContinuousBatchingConfig, generate_batch
from rollout.engine.worker.flash_backend import HAVE_FLASH
from tests.helpers.models import greedy_reference, random_prompts, tiny_model

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@cuda
@pytest.mark.parametrize("page_size", [16, 256])
def test_cuda_sdpa_greedy_equals_generate(page_size):
    model = tiny_model("qwen3").cuda()
    prompts = random_prompts([5, 40, 300, 17], seed=3)
    out = generate_batch(model, prompts, GenerationConfig(max_new_tokens=16, do_sample=False),
                         ContinuousBatchingConfig(page_size=page_size, max_batch_tokens=128), progress_bar=False)
    for p, o in zip(prompts, out.values()):
        ref, safe = greedy_reference(model, p, 16)
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


@cuda
def test_cuda_processors_and_structured_outputs():
    """Built-in processors, a request's own processor and xgrammar bitmasks applied on CUDA logits."""
    import re

    from rollout import SamplingParams
    from tests.helpers.tokenizers import json_tokenizer

    tok = json_tokenizer()
    model = tiny_model("qwen3", seed=1, lm_head_scale=1.0, vocab_size=384).cuda()
    prompts = random_prompts([5, 40], seed=3, vocab=320)
    regex = r"\d{3}-[a-z]{2,4}"
    constrained = SamplingParams(temperature=1.0, seed=3, n=4, max_new_tokens=40, eos_token_id=1, regex=regex,
                                 logit_bias={5: 2.0}, bad_words_ids=[[7], [8, 9]])
    masked = SamplingParams(temperature=0.8, top_p=0.9, seed=1, max_new_tokens=8,
                            allowed_token_ids=list(range(0, 384, 3)), logits_processors=[lambda generated, row: row])
    out = generate_batch(model, prompts, GenerationConfig(), ContinuousBatchingConfig(page_size=16),
                         [constrained, masked], progress_bar=False, tokenizer=tok)
    for rid, o in out.items():
        assert o.error is None, o.error
        if rid.startswith("req_0"):
            assert re.fullmatch(regex, tok.decode(o.generated_tokens, skip_special_tokens=True))
        else:
            assert all(t % 3 == 0 for t in o.generated_tokens)
            for lp, policy, kept in zip(o.logprobs, o.policy_logprobs, o.kept_logmass):
                assert abs(lp - (policy - kept)) < 1e-4
