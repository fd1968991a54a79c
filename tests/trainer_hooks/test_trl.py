"""TRL GRPO/RLOO on the engine: weights really synced, logprobs agree with the trainer, KV cache kept, W&B logged."""

import importlib
import logging

import pytest
import torch
from datasets import Dataset

pytest.importorskip("trl")
from trl import GRPOConfig, RLOOConfig

from rollout import ContinuousBatchingConfig, SamplingParams
from tests.helpers.models import greedy_reference, tiny_model
from tests.helpers.tokenizers import tiny_tokenizer
from tests.helpers.wandb_reader import history_keys
from trainer_hooks import RolloutGRPOTrainer, RolloutRLOOTrainer

CB = ContinuousBatchingConfig(page_size=8, num_blocks=256)
PROMPTS = [f"w{i} w{i + 1} w{i + 2}" for i in range(32)]


def reward_w7(completions, **kwargs):
    return [c.count("w7") / 8 for c in completions]


def _policy(kind: str = "qwen3"):
    model = tiny_model(kind, lm_head_scale=2.0)
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
    trainer = RolloutGRPOTrainer(  # TRL recomputes old logprobs, so its logp difference checks the engine
        model=model, reward_funcs=reward_w7, args=GRPOConfig(**_common(tmp_path, report_to)),
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}), processing_class=tok, rollout_config=CB,
        share_weights=share_weights, rollout_old_logprobs="recompute")
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
    for key in [] if report_to == "none" else [
            "tokens_per_second", "prefill_tokens", "decode_tokens", "prefix_cache_hit_rate", "kv_cache_usage",
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


def test_trl_structured_output_settings_reach_the_engine(tmp_path):
    """TRL's vllm_structured_outputs_regex and vLLM-style generation_kwargs (structured_outputs, logit_bias) constrain
    the engine's rollouts."""
    model, tok = _policy()
    args = GRPOConfig(**{**_common(tmp_path), "vllm_structured_outputs_regex": "(w7|w9)+",
                         "generation_kwargs": {"logit_bias": {str(tok.eos_token_id): -100}}})
    trainer = RolloutGRPOTrainer(model=model, reward_funcs=reward_w7, args=args,
                                 train_dataset=Dataset.from_dict({"prompt": PROMPTS}), processing_class=tok)
    p = trainer.vllm_generation.sampling_params
    assert p.regex == "(w7|w9)+" and p.logit_bias == {str(tok.eos_token_id): -100}
    batch = trainer.rollout_generator.generate([tok(q)["input_ids"] for q in PROMPTS[:3]], n=2, sampling_params=p)
    words = {tok.convert_tokens_to_ids("w7"), tok.convert_tokens_to_ids("w9")}
    assert all(set(s.completion_ids) <= words and len(s.completion_ids) == 8 for s in batch.samples)
    trainer.rollout_generator.close()
    args = GRPOConfig(**{**_common(tmp_path), "generation_kwargs": {"structured_outputs": {"choice": ["w3", "w4"]}}})
    trainer = RolloutGRPOTrainer(model=model, reward_funcs=reward_w7, args=args,
                                 train_dataset=Dataset.from_dict({"prompt": PROMPTS}), processing_class=tok)
    assert trainer.vllm_generation.sampling_params.choice == ["w3", "w4"]
    trainer.rollout_generator.close()


def test_unsupported_trl_version_fails_clearly(monkeypatch):
    import trl

    import trainer_hooks.trl as hook

    monkeypatch.setattr(trl, "__version__", "1.18.0")
    with pytest.raises(ImportError, match=r"supports trl>=1\.16\.0,<1\.17\.0"):
        importlib.reload(hook)
    monkeypatch.undo()
    importlib.reload(hook)


def test_grpo_with_a_separate_rollout_server(tmp_path):
    """Trainer and engine in separate places: TRL streams weights to `rollout serve` and generates there."""
    import copy

    pytest.importorskip("fastapi")
    from rollout.client import RolloutClient
    from rollout.server import create_app
    from tests.helpers.server import running_server

    model, tok = _policy()
    app = create_app(copy.deepcopy(model), tok, "tiny", CB)
    with running_server(app) as url:
        trainer = RolloutGRPOTrainer(model=model, reward_funcs=reward_w7,
                                     args=GRPOConfig(**{**_common(tmp_path), "max_steps": 2}),
                                     train_dataset=Dataset.from_dict({"prompt": PROMPTS}), processing_class=tok,
                                     rollout_server=url)
        assert trainer.rollout_generator is None and trainer.rollout_backend.shared_by_processes
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
        local_only = GRPOConfig(**{**_common(tmp_path), "generation_kwargs": {"allowed_token_ids": [5, 6]}})
        with pytest.raises(ValueError, match=r"allowed_token_ids \(token-id masks need the engine in this process\)"):
            RolloutGRPOTrainer(model=model, reward_funcs=reward_w7, args=local_only, processing_class=tok,
                               train_dataset=Dataset.from_dict({"prompt": PROMPTS}), rollout_server=url)


# ------------------------------------------------------------------- old_per_token_logps from the engine
def _grpo(tmp_path, model, tok, config: dict | None = None, reward_funcs=reward_w7, **kwargs):
    args = GRPOConfig(**{**_common(tmp_path), **(config or {})})
    return RolloutGRPOTrainer(model=model, reward_funcs=reward_funcs, args=args,
                              train_dataset=Dataset.from_dict({"prompt": PROMPTS}), processing_class=tok,
                              rollout_config=CB, **kwargs)


class _OldPassCounter:
    """Counts forwards of the trained model made without grad: TRL's old-logprob pass, however it is batched (the
    engine generates from its own copy)."""

    def __init__(self, model):
        self.calls = 0

        def count(module, args, kwargs):
            if not torch.is_grad_enabled():
                self.calls += 1

        model.register_forward_pre_hook(count, with_kwargs=True)


@pytest.mark.parametrize("config, kwargs, reason", [
    ({}, {}, None),
    ({}, {"share_weights": True}, None),
    ({}, {"rollout_dtype": torch.bfloat16}, "bfloat16"),
    ({"num_iterations": 2}, {}, "num_iterations=2"),
    ({"repetition_penalty": 1.2}, {}, "repetition_penalty"),
    ({"steps_per_generation": 2}, {}, "steps_per_generation=2"),
    ({"generation_kwargs": {"temperature": 0.5}}, {}, "temperature"),
])
def test_auto_rule_says_when_the_engine_is_exact(tmp_path, config, kwargs, reason):
    model, tok = _policy()
    trainer = _grpo(tmp_path, model, tok, config, **kwargs)
    found = trainer.vllm_generation.old_logprobs_static_reason
    assert (found is None) if reason is None else (reason in found), found
    trainer.rollout_generator.close()


def test_auto_rule_checks_the_weights_of_each_batch(tmp_path):
    """Exact setup, but a batch generated without the step's sync (or under other weights) keeps TRL's pass."""
    model, tok = _policy()
    trainer = _grpo(tmp_path, model, tok)
    adapter = trainer.vllm_generation
    prompts = [tok(p)["input_ids"] for p in PROMPTS[:2]]
    adapter.generate(prompts, None, 2)
    pending = adapter.take_old_logprobs()
    assert not pending.use_engine and "not synced" in pending.reason
    adapter.sync_weights()
    adapter.generate(prompts, None, 2)
    assert adapter.take_old_logprobs().use_engine
    trainer.rollout_generator.update_weights(trainer.model)  # an update the trainer did not make through the adapter
    adapter.generate(prompts, None, 2)
    pending = adapter.take_old_logprobs()
    assert not pending.use_engine and "other weights" in pending.reason
    assert adapter.take_old_logprobs() is None  # handed out once
    trainer.rollout_generator.close()


def test_old_logprob_pass_skipped_when_exact(tmp_path, caplog):
    model, tok = _policy()
    trainer = _grpo(tmp_path, model, tok, {"max_steps": 2})
    counter = _OldPassCounter(trainer.model)  # after the engine copied the model
    with caplog.at_level(logging.INFO, logger="trainer_hooks.trl"):
        trainer.train()
    logs = [h for h in trainer.state.log_history if "rollout/old_logprobs_from_engine" in h]
    assert [h["rollout/old_logprobs_from_engine"] for h in logs] == [1.0, 1.0]
    assert counter.calls == 0, "TRL ran its old-logprob forward although the engine was exact"
    assert all(h["sampling/importance_sampling_ratio/min"] == h["sampling/importance_sampling_ratio/max"] == 1.0
               for h in logs)
    assert sum("TRL's recompute skipped" in r.getMessage() for r in caplog.records) == 1  # once, not every step
    trainer.rollout_generator.close()


@pytest.mark.parametrize("mode, engine_dtype, from_engine", [
    ("auto", torch.bfloat16, 0.0),  # a bf16 engine for an fp32 trainer: TRL's correction stays
    ("engine", torch.bfloat16, 1.0),  # forced
    ("recompute", None, 0.0),  # forced, although exact
])
def test_old_logprob_pass_used_when_not_exact_or_forced(tmp_path, caplog, mode, engine_dtype, from_engine):
    model, tok = _policy()
    trainer = _grpo(tmp_path, model, tok, {"max_steps": 2}, rollout_dtype=engine_dtype, rollout_old_logprobs=mode)
    counter = _OldPassCounter(trainer.model)  # after the engine copied the model
    with caplog.at_level(logging.INFO, logger="trainer_hooks.trl"):
        trainer.train()
    logs = [h for h in trainer.state.log_history if "rollout/old_logprobs_from_engine" in h]
    assert [h["rollout/old_logprobs_from_engine"] for h in logs] == [from_engine] * 2
    assert (counter.calls == 0) if from_engine else (counter.calls >= 2)  # one pass per step, maybe chunked
    expected = "TRL's recompute skipped" if from_engine else "recomputed by TRL"
    assert any(expected in r.getMessage() for r in caplog.records)
    diff = max(h["sampling/sampling_logp_difference/max"] for h in logs)
    if mode == "auto":  # bf16 sampling vs the fp32 trainer: a real correction
        assert diff > 1e-4
    if from_engine:
        assert diff == 0.0
    trainer.rollout_generator.close()


def test_loss_with_and_without_the_skip_equals_trls(tmp_path):
    """Same seeds, so the same completions: TRL's loss (its own forward, its own old-logprob pass) and ours agree."""
    from trl import GRPOTrainer

    def reward_even(completions, completion_ids, **kwargs):
        return [sum(t % 2 == 0 for t in ids) / len(ids) for ids in completion_ids]

    config = {"max_completion_length": 12, "loss_type": "bnpo"}
    trainers, batches = {}, {}
    for mode in ("engine", "recompute"):
        model, tok = _policy()
        model.generation_config.eos_token_id = list(range(200, 240))  # ~1 in 6 tokens ends a completion
        trainer = _grpo(tmp_path, model, tok, config, rollout_old_logprobs=mode, reward_funcs=reward_even)
        rows = [{"prompt": p} for p in PROMPTS[:2] for _ in range(4)]
        trainer.vllm_generation.sync_weights()
        trainer._last_loaded_step = trainer.state.global_step
        trainers[mode], batches[mode] = trainer, trainer._generate_and_score_completions(rows)
    engine, trl_pass = batches["engine"], batches["recompute"]
    assert torch.equal(engine["completion_ids"], trl_pass["completion_ids"])
    mask = engine["completion_mask"].bool()
    assert mask.sum() > 8 and len(set(mask.sum(1).tolist())) > 1  # several lengths: the loss is not trivially 0
    assert torch.allclose(engine["old_per_token_logps"][mask], trl_pass["old_per_token_logps"][mask], atol=1e-5)
    assert torch.equal(engine["importance_sampling_ratio"], torch.ones_like(engine["importance_sampling_ratio"]))

    def loss_and_grad(trainer, inputs, trl_forward=False):
        model = trainer.model
        model.zero_grad()
        if trl_forward:  # TRL's unmodified per-token forward, for the reference
            trainer._get_per_token_logps_and_entropies = GRPOTrainer._get_per_token_logps_and_entropies.__get__(trainer)
        loss = trainer.compute_loss(model, inputs)
        loss.backward()
        vars(trainer).pop("_get_per_token_logps_and_entropies", None)
        return loss.item(), torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

    reference_loss, reference_grad = loss_and_grad(trainers["recompute"], trl_pass, trl_forward=True)
    assert abs(reference_loss) > 1e-3
    for mode, inputs in (("engine", engine), ("recompute", trl_pass)):
        loss, grad = loss_and_grad(trainers[mode], inputs)
        assert abs(loss - reference_loss) <= 1e-5, (mode, loss, reference_loss)
        assert torch.allclose(grad, reference_grad, atol=1e-5, rtol=1e-4), mode
    for trainer in trainers.values():
        trainer.rollout_generator.close()


@pytest.mark.parametrize("kind", ["qwen3", "gpt2"])  # rotary and absolute positions
def test_trimmed_padding_scores_like_trls_forward(tmp_path, monkeypatch, kind):
    """Rows of very different prompt and completion lengths: per-token logprobs, entropies and gradients match TRL's
    single padded forward, whether the rows land in one chunk or in several."""
    from trl import GRPOTrainer

    import trainer_hooks.padding as padding
    import trainer_hooks.trl as hook

    model, tok = _policy(kind)
    trainer = _grpo(tmp_path, model, tok, {"disable_dropout": True})  # gpt2's dropout would differ run to run
    gen = torch.Generator().manual_seed(0)
    prompts, completions = [3, 9, 3, 14, 6, 1], [12, 2, 7, 12, 0, 5]  # a fully masked completion included
    width_p, width_c = max(prompts), max(completions)
    ids = torch.randint(5, 256, (len(prompts), width_p + width_c), generator=gen)
    mask = torch.zeros_like(ids)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        mask[i, width_p - p:width_p + c] = 1
    ids = ids.masked_fill(mask == 0, tok.pad_token_id)
    trainer.model.train()

    def run(fn):
        trainer.model.zero_grad()
        logps, entropy, _ = fn(trainer.model, ids, mask, width_c, compute_entropy=True)
        (logps * torch.linspace(0.5, 1.5, width_c)).sum().backward()  # not a plain sum: every position matters
        grad = torch.cat([p.grad.flatten() for p in trainer.model.parameters() if p.grad is not None])
        return logps.detach(), entropy.detach(), grad

    reference = run(GRPOTrainer._get_per_token_logps_and_entropies.__get__(trainer))
    assert (reference[0][mask[:, width_p:] == 1] < 0).all()
    chunks = []
    original = hook.unpadded_logps

    def spy(*args, **kwargs):
        out = original(*args, **kwargs)
        chunks.append(out is not None)
        return out

    monkeypatch.setattr(hook, "unpadded_logps", spy)
    forwards = []
    trainer.model.register_forward_pre_hook(lambda module, args: forwards.append(1))
    for min_tokens in (10_000, 0):  # one chunk with the shared padding cut; several chunks of similar rows
        monkeypatch.setattr(padding, "MIN_CHUNK_TOKENS", min_tokens)
        forwards.clear()
        ours = run(trainer._get_per_token_logps_and_entropies)
        assert (len(forwards) == 1) if min_tokens else (len(forwards) > 1)
        for a, b in zip(ours, reference):
            assert torch.allclose(a, b, atol=1e-5, rtol=1e-5)
    assert chunks == [True, True], "the trimmed path did not run"
    trainer.rollout_generator.close()


def test_engine_thread_follows_the_trainers_thread_count(tmp_path):
    """The engine's loop thread keeps the OpenMP team size it started with unless told; the manager adopts the
    submitting (trainer's) thread count at every step."""
    model, tok = _policy()
    trainer = _grpo(tmp_path, model, tok)
    seen = []
    trainer.rollout_generator.model.get_output_embeddings().register_forward_pre_hook(
        lambda module, args: seen.append(torch.get_num_threads()))
    prompts = [tok(p)["input_ids"] for p in PROMPTS[:2]]
    before = torch.get_num_threads()
    try:
        for threads in (1, 2, 1):
            torch.set_num_threads(threads)
            seen.clear()
            trainer.vllm_generation.generate(prompts, None, 2)
            assert set(seen) == {threads}
    finally:
        torch.set_num_threads(before)
        trainer.rollout_generator.close()
