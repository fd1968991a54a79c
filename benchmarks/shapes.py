"""Real small-LM shapes with random weights: the sizes people train, built from configs (there is no model hub here).

Each entry is the published config's shape (layers, widths, heads, vocabulary); weights are drawn at random, so the
numbers measure the engine, not the model. `build_real("qwen3-0.6b", "bfloat16")` gives an eval-mode model.
"""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from benchmarks.common import MODEL_CONFIG, build_model

QWEN3_0_6B = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
                  max_position_embeddings=40960, rope_theta=1000000.0)
LLAMA_3_2_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                    num_attention_heads=32, num_key_value_heads=8, head_dim=64, tie_word_embeddings=True,
                    max_position_embeddings=131072, rope_theta=500000.0)
SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, head_dim=64, tie_word_embeddings=True,
                    max_position_embeddings=8192, rope_theta=100000.0)

REAL_SHAPES = {
    "smollm2-135m": (LlamaConfig, LlamaForCausalLM, SMOLLM2_135M),
    "qwen3-0.6b": (Qwen3Config, Qwen3ForCausalLM, QWEN3_0_6B),
    "llama-3.2-1b": (LlamaConfig, LlamaForCausalLM, LLAMA_3_2_1B),
}
MODEL_CHOICES = ["w1", *REAL_SHAPES]  # what the benchmarks' --model takes: W1's toy model or a real shape


def model_shape(name: str) -> dict:
    """The config fields of `name` that set its FLOPs (layers, widths, heads, vocabulary)."""
    return dict(MODEL_CONFIG) if name == "w1" else dict(REAL_SHAPES[name][2])


def build_named(name: str, dtype: torch.dtype | str = torch.float32, seed: int = 0, **kwargs):
    """W1's model or a real shape by `--model` name; `kwargs` go to the builder."""
    return build_model(dtype, seed=seed, **kwargs) if name == "w1" else build_real(name, dtype, seed=seed, **kwargs)


def build_real(name: str, dtype: torch.dtype | str = torch.float32, seed: int = 0, **overrides):
    """An eval-mode model of a real shape with random weights (`overrides` replace config fields)."""
    if name not in REAL_SHAPES:
        raise SystemExit(f"unknown model shape {name!r}; choose one of {sorted(REAL_SHAPES)}")
    config_class, model_class, shape = REAL_SHAPES[name]
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    torch.manual_seed(seed)
    config = config_class(**{**shape, "eos_token_id": None, "bos_token_id": None, "pad_token_id": None, **overrides})
    model = model_class(config).eval().requires_grad_(False)
    return model.to(dtype)
