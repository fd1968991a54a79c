"""bf16 end to end, on whatever CPU runs the suite: the generator, the server and the TRL hook.

On AVX2-only CPUs oneDNN cannot pack bf16 weights; the engine must then keep F.linear for them, or compute them on
fp32 copies or bf16 panels where the start-up probe timed those faster, and give the same tokens (up to bf16
near-ties). Each test
runs both with this machine's real capabilities and with bf16 packing reported unsupported, so the AVX2 path is
exercised on every machine (and `benchmarks/emulated_cpu_check.sh -c EPYC-Rome tests/engine/cpu/test_bf16.py` runs it
on an emulated AVX2 CPU for real).
"""

import pytest
import torch
from datasets import Dataset
from fastapi.testclient import TestClient

from rollout import ContinuousBatchingConfig, RolloutGenerator, SamplingParams
from rollout.engine.cpu.features import ENV_BF16_PANELS, cpu_features
from rollout.engine.cpu.kernel import load_kernel
from rollout.engine.cpu.panel_packed import PanelWeight
from rollout.server import create_app
from tests.helpers.models import greedy_reference, tiny_model
from tests.helpers.tokenizers import tiny_tokenizer

CB = ContinuousBatchingConfig(page_size=8, num_blocks=128)
NEW = 6


@pytest.fixture(params=["this-cpu", "avx2", "panels"])
def cpu(request, fresh_detection, monkeypatch):
    """This CPU as detected, oneDNN behaving as on an AVX2-only CPU (bf16 packing raises torch's error), or bf16
    linears on panels (ROLLOUT_BF16_PANELS=1, where the C library builds)."""
    if request.param == "avx2":
        request.getfixturevalue("avx2_machine")
    if request.param == "panels":
        if load_kernel() is None:
            pytest.skip("the C kernels do not build here")
        monkeypatch.setenv(ENV_BF16_PANELS, "1")
    return request.param


def _bf16_model():
    return tiny_model("qwen3", lm_head_scale=2.0).to(torch.bfloat16)


def test_generator_bf16_greedy_equals_generate(cpu):
    model = _bf16_model()
    prompts = [[3, 14, 15, 92, 65], [35, 89, 79]]
    with RolloutGenerator(model, continuous_batching_config=CB, share_weights=True) as gen:
        batch = gen.generate(prompts, sampling_params=SamplingParams(temperature=0, max_new_tokens=NEW,
                                                                      ignore_eos=True))
        packs = gen.manager.engine.runner.linears
    for sample, prompt in zip(batch.samples, prompts):
        ref, safe = greedy_reference(model, prompt, NEW)
        assert sample.completion_ids[:safe] == ref[:safe]
    features = cpu_features()
    if cpu == "avx2":
        assert not features.packs(torch.bfloat16)
    copies = getattr(packs, "_packs", {})
    assert bool(copies) == (torch.bfloat16 in features.served_dtypes), \
        "bf16 weights packed iff this CPU packs them or their fp32 copies"
    # the copies compute in fp32 where the probe chose that route, else in bf16 (panels, or oneDNN's bf16 copies)
    assert {entry.packed.dtype for entry in copies.values()} <= {
        torch.float32 if features.bf16_via_fp32 else torch.bfloat16}
    assert features.bf16_route.panels or cpu != "panels"  # elsewhere as timed
    assert {isinstance(entry.packed, PanelWeight) for entry in copies.values()} <= {features.bf16_route.panels}


def test_server_bf16_completion_and_health(cpu):
    model, tok = _bf16_model(), tiny_tokenizer()
    prompt = [5, 6, 7, 8]
    ref, safe = greedy_reference(model, prompt, NEW)
    with TestClient(create_app(model, tok, "tiny-bf16", CB), base_url="http://localhost") as client:
        reply = client.post("/v1/completions", json={"model": "tiny-bf16", "prompt": prompt, "max_tokens": NEW,
                                                     "temperature": 0, "ignore_eos": True,
                                                     "return_token_ids": True})
        assert reply.status_code == 200, reply.text
        tokens = reply.json()["choices"][0]["token_ids"]
        assert tokens[:safe] == ref[:safe]
        health = client.get("/health")
        assert health.status_code == 200 and health.json()["status"] == "ok"


def test_trl_grpo_step_with_a_bf16_engine(cpu, tmp_path):
    trl = pytest.importorskip("trl")
    from trainer_hooks import RolloutGRPOTrainer

    model, tok = tiny_model("qwen3", lm_head_scale=2.0), tiny_tokenizer()
    model.config.eos_token_id = model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    args = trl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, per_device_train_batch_size=4,
                          num_generations=4, max_completion_length=6, max_steps=1, logging_steps=1,
                          report_to="none", save_strategy="no", seed=0, disable_tqdm=True)
    trainer = RolloutGRPOTrainer(model=model, reward_funcs=lambda completions, **kw: [len(c) / 10 for c in completions],
                                 args=args, train_dataset=Dataset.from_dict({"prompt": ["w1 w2", "w3 w4"] * 4}),
                                 processing_class=tok, rollout_config=CB, rollout_dtype=torch.bfloat16)
    assert next(trainer.rollout_generator.model.parameters()).dtype == torch.bfloat16
    trainer.train()
    (log,) = [h for h in trainer.state.log_history if "rollout/generated_tokens" in h]
    assert log["rollout/generated_tokens"] > 0 and log["rollout/weight_version"] == 1
