"""Tiny random causal LMs built from configs (no hub), and a greedy reference that knows where ties make it unsafe."""

from __future__ import annotations

import copy

import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from rollout.sampling_params import SamplingParams

VOCAB = 256
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, eos_token_id=None, bos_token_id=None,
              pad_token_id=None)


def _build(kind: str, vocab_size: int = VOCAB):
    common = {**COMMON, "vocab_size": vocab_size}
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(**common))
    if kind == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**common))
    if kind == "qwen3":
        return Qwen3ForCausalLM(Qwen3Config(head_dim=16, **common))
    if kind == "mistral":
        return MistralForCausalLM(MistralConfig(sliding_window=None, **common))
    if kind == "gpt2":
        return GPT2LMHeadModel(GPT2Config(vocab_size=vocab_size, n_embd=64, n_layer=2, n_head=4, n_positions=512,
                                          eos_token_id=None, bos_token_id=None))
    raise ValueError(kind)


def tiny_model(kind: str = "qwen3", seed: int = 0, lm_head_scale: float = 8.0, vocab_size: int = VOCAB):
    """A tiny fp32 model; the output head is scaled so greedy argmax margins are clear."""
    torch.manual_seed(seed)
    model = _build(kind, vocab_size).eval()
    with torch.no_grad():
        head = model.get_output_embeddings()
        if model.config.tie_word_embeddings:
            # Scale a separate copy so the input embeddings keep their scale.
            head.weight = torch.nn.Parameter(head.weight.detach().clone() * lm_head_scale)
            model.config.tie_word_embeddings = False
        else:
            head.weight.mul_(lm_head_scale)
    return model


def random_prompts(lengths, seed: int = 0, vocab: int = VOCAB) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


@torch.no_grad()
def greedy(max_new_tokens: int = 5, **kw) -> SamplingParams:
    """Greedy sampling settings (tests pass the rest, e.g. n or ignore_eos)."""
    return SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, **kw)


def greedy_reference(model, prompt: list[int], max_new_tokens: int, tie_gap: float = 1e-4, force_length: bool = True,
                     **generate_kwargs) -> tuple[list[int], int]:
    """model.generate's greedy tokens and how many of them are safe to compare (before the first near-tie).

    force_length: generate exactly max_new_tokens (EOS masked); extra kwargs go to generate (e.g. a penalty).
    """
    if force_length:
        generate_kwargs.setdefault("min_new_tokens", max_new_tokens)
    device = next(model.parameters()).device  # the inputs go where the model is (CUDA too)
    out = model.generate(torch.tensor([prompt], device=device),
                         attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=device),
                         max_new_tokens=max_new_tokens, do_sample=False, output_scores=True,
                         return_dict_in_generate=True, pad_token_id=0, **generate_kwargs)
    tokens = out.sequences[0, len(prompt):].tolist()
    safe = len(tokens)
    for i, scores in enumerate(out.scores):
        top2 = scores[0].float().topk(2).values
        if float(top2[0] - top2[1]) < tie_gap:
            safe = i
            break
    return tokens, safe


def perturbed(model, seed: int = 1, scale: float = 0.05):
    """A copy of `model` with every weight nudged: a stand-in for "the trainer took a step"."""
    new = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in new.parameters():
            # drawn on the CPU (the same nudges whatever the device), then moved to the weight
            p.add_(torch.randn(p.shape, generator=g).to(p.device) * scale * p.abs().mean().clamp_min(1e-3))
    return new


def run_engine(engine, max_steps: int = 2000) -> dict:
    """Step to completion, checking block accounting after every step; returns the terminal outputs by id."""
    done = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            if out.is_finished():
                assert out.request_id not in done, f"{out.request_id} finished twice"
                done[out.request_id] = out
        engine.check_invariants()
    assert not engine.has_unfinished(), "the engine did not finish"
    stats = engine.stats()
    assert stats.free_blocks == stats.num_blocks, "KV blocks leaked"
    return done


def long_context_model(seed: int = 0, max_positions: int = 1 << 15):
    """A tiny Llama with a long context: a generation can then run far longer than the script that started it."""
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**{**COMMON, "max_position_embeddings": max_positions})).eval()


def tiny_unsupported_model(kind: str = "falcon"):
    """A tiny model whose attention bypasses transformers' attention interface: Falcon (new decoder architecture)
    does its own attention math; BLOOM never calls an attention function at all."""
    from transformers import BloomConfig, BloomForCausalLM, FalconConfig, FalconForCausalLM

    torch.manual_seed(0)
    if kind == "falcon":
        return FalconForCausalLM(FalconConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                                              num_attention_heads=4, num_kv_heads=2, new_decoder_architecture=True,
                                              max_position_embeddings=512)).eval()
    if kind == "bloom":
        return BloomForCausalLM(BloomConfig(vocab_size=VOCAB, hidden_size=64, n_layer=2, n_head=4)).eval()
    raise ValueError(kind)
