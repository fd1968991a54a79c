"""TRL GRPO/RLOO on the engine: weights really synced, logprobs agree with the trainer, KV cache kept, W&B logged."""

import importlib

import pytest
import torch
from datasets import Dataset

pytest.importorskip("trl")
from trl import GRPOConfig, RLOOConfig  # noqa: E402

from models import greedy_reference, tiny_model  # noqa: E402
from rollout import ContinuousBatchingConfig, SamplingParams  # noqa: E402
from tokenizer_utils import tiny_tokenizer  # noqa: E402
from trainer_hooks import RolloutGRPOTrainer, RolloutRLOOTrainer  # noqa: E402
from wandb_reader import history_keys  # noqa: E402

CB = ContinuousBatchingConfig(page_size=8, num_blocks=256)
PROMPTS = [f"w{i} w{i + 1} w{i + 2}" for i in range(32)]


def reward_w7(completions, **kwargs):
    return [c.count("w7") / 8 for c in completions]


def _policy():
    model = tiny_model("qwen3", lm_head_scale=2.0)
    tok = tiny_tokenizer()
    model.config.eos_token_id = tok.eos_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    return model, tok


def _common(tmp_path, report_to="none"):
    return dict(output_dir=str(tmp_path), use_cpu=True, bf16=False, per_device_train_batch_size=8,
                num_generations=4, max_completion_length=8, max_steps=3, logging_steps=1, report_to=report_to,
                save_strategy="no", learning_rate=5e-3, seed=0, disable_tqdm=True)


def _assert_engine_matches_trained_model(trainer, tok):
    trainer.vllm_generation.sync_weights()
    model = trainer.model.eval()
    prompts = [tok(p)["input_ids"] for p in PROMPTS[:3]]
    batch = trainer.rollout_generator.generate(prompts, sampling_params=SamplingParams(
        temperature=0, max_new_tokens=8, min_new_tokens=8))  # EOS masked, as in the forced-length reference
    for s in batch.samples:
        ref, safe = greedy_reference(model, s.prompt_ids, 8)
        assert s.completion_ids[:safe] == ref[:safe]
    return batch


@pytest.mark.parametrize("share_weights", [False, True])
def test_grpo_three_steps(tmp_path, share_weights, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    model, tok = _policy()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    report_to = "none" if share_weights else "wandb"  # one offline W&B run per process is enough
    trainer = RolloutGRPOTrainer(
        model=model, reward_funcs=reward_w7, args=GRPOConfig(**_common(tmp_path, report_to)),
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}), processing_class=tok, rollout_config=CB,
        share_weights=share_weights)
    gen = trainer.rollout_generator
    assert (gen.model is model) == share_weights
    cache_ptrs = gen.manager.engine.cache.data_ptrs()
    trainer.train()
    if report_to == "wandb":
        import wandb

        wandb.finish()
    logs = [h for h in trainer.state.log_history if "sampling/sampling_logp_difference/max" in h]
    assert len(logs) == 3
    assert max(h["sampling/sampling_logp_difference/max"] for h in logs) < 1e-4
    assert [h["rollout/weight_version"] for h in logs] == [1, 2, 3]
    assert all(h["rollout/prefill_tokens"] <= 2 * 3 for h in logs)  # 2 prompts x 3 tokens: each group prefilled once
    assert any(not torch.equal(initial[k], v) for k, v in model.state_dict().items()), "training changed nothing"
    _assert_engine_matches_trained_model(trainer, tok)
    assert gen.manager.engine.cache.data_ptrs() == cache_ptrs
    keys = history_keys(str(tmp_path)) if report_to == "wandb" else set()
    for key in [] if report_to == "none" else ["tokens_per_second", "prefill_tokens", "decode_tokens", "prefix_cache_hit_rate", "kv_cache_usage",
                "weight_sync_seconds", "weight_version", "completion_length/mean", "finish_reason/length"]:
        assert f"train/rollout/{key}" in keys, key
    gen.close()


def test_rloo_three_steps(tmp_path):
    model, tok = _policy()
    args = RLOOConfig(**_common(tmp_path), beta=0.0)  # no reference model: it would be loaded from a hub path
    trainer = RolloutRLOOTrainer(model=model, reward_funcs=reward_w7, args=args,
                                 train_dataset=Dataset.from_dict({"prompt": PROMPTS}), processing_class=tok,
                                 rollout_config=CB)
    cache_ptrs = trainer.rollout_generator.manager.engine.cache.data_ptrs()
    trainer.train()
    versions = [h["rollout/weight_version"] for h in trainer.state.log_history if "rollout/weight_version" in h]
    assert versions == [1, 2, 3]
    _assert_engine_matches_trained_model(trainer, tok)
    assert trainer.rollout_generator.manager.engine.cache.data_ptrs() == cache_ptrs
    trainer.rollout_generator.close()


def test_trl_sampling_settings_reach_the_engine(tmp_path):
    model, tok = _policy()
    args = GRPOConfig(**{**_common(tmp_path), "temperature": 0.7, "top_k": 5, "top_p": 0.9, "min_p": 0.01,
                         "generation_kwargs": {"max_tokens": 5, "stop": ["w9"]}})
    trainer = RolloutGRPOTrainer(model=model, reward_funcs=reward_w7, args=args,
                                 train_dataset=Dataset.from_dict({"prompt": PROMPTS}), processing_class=tok)
    p = trainer.vllm_generation.sampling_params
    assert (p.temperature, p.top_k, p.top_p, p.min_p, p.max_new_tokens) == (0.7, 5, 0.9, 0.01, 5)
    assert p.stop_strings == ["w9"] and list(p.eos_token_id) == [tok.eos_token_id]
    bad = GRPOConfig(**{**_common(tmp_path), "generation_kwargs": {"guided_json": "{}"}})
    with pytest.raises(ValueError, match="guided_json"):
        RolloutGRPOTrainer(model=model, reward_funcs=reward_w7, args=bad,
                           train_dataset=Dataset.from_dict({"prompt": PROMPTS}), processing_class=tok)
    with pytest.raises(ValueError, match="use_vllm"):
        RolloutGRPOTrainer(model=model, reward_funcs=reward_w7,
                           args=GRPOConfig(**{**_common(tmp_path), "use_vllm": True}),
                           train_dataset=Dataset.from_dict({"prompt": PROMPTS}), processing_class=tok)


def test_unsupported_trl_version_fails_clearly(monkeypatch):
    import trl

    import trainer_hooks.trl as hook

    monkeypatch.setattr(trl, "__version__", "1.18.0")
    with pytest.raises(ImportError, match="supports trl>=1.16.0,<1.17.0"):
        importlib.reload(hook)
    monkeypatch.undo()
    importlib.reload(hook)


def test_grpo_with_a_separate_rollout_server(tmp_path):
    """Trainer and engine in separate places: TRL streams weights to `rollout serve` and generates there."""
    import copy

    pytest.importorskip("fastapi")
    from rollout.client import RolloutClient
    from rollout.server import create_app
    from server_utils import running_server

    model, tok = _policy()
    app = create_app(copy.deepcopy(model), tok, "tiny", CB)
    with running_server(app) as url:
        trainer = RolloutGRPOTrainer(model=model, reward_funcs=reward_w7,
                                     args=GRPOConfig(**{**_common(tmp_path), "max_steps": 2}),
                                     train_dataset=Dataset.from_dict({"prompt": PROMPTS}), processing_class=tok,
                                     rollout_server=url)
        assert trainer.rollout_generator is None
        trainer.train()
        logs = [h for h in trainer.state.log_history if "sampling/sampling_logp_difference/max" in h]
        assert len(logs) == 2 and max(h["sampling/sampling_logp_difference/max"] for h in logs) < 1e-4
        trainer.vllm_generation.sync_weights()
        with RolloutClient(url) as client:
            assert client.weight_version() == 3
            prompt = tok(PROMPTS[0])["input_ids"]
            out = client.generate([prompt], temperature=0, max_tokens=8, min_tokens=8)[0]
        ref, safe = greedy_reference(trainer.model.eval(), prompt, 8)
        assert out["completion_ids"][:safe] == ref[:safe]
