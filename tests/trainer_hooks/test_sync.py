"""WeightSync for hand-written loops and WeightSyncCallback for any transformers Trainer."""

import torch
from datasets import Dataset
from transformers import Trainer, TrainingArguments

from rollout import ContinuousBatchingConfig, RolloutGenerator, SamplingParams
from tests.helpers.models import greedy_reference, random_prompts, tiny_model
from trainer_hooks import WeightSync, WeightSyncCallback, rollout_metrics

CB = ContinuousBatchingConfig(page_size=8, num_blocks=256)
GREEDY = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)


def _assert_in_sync(gen, model, prompts):
    for s in gen.generate(prompts, sampling_params=GREEDY).samples:
        ref, safe = greedy_reference(model, s.prompt_ids, 8)
        assert s.completion_ids[:safe] == ref[:safe]


def test_weight_sync_every_k_steps_in_a_plain_loop():
    model = tiny_model("qwen3")
    prompts = random_prompts([7, 12], seed=1)
    wrapped = torch.nn.parallel.DistributedDataParallel.__new__(torch.nn.parallel.DistributedDataParallel)
    torch.nn.Module.__init__(wrapped)
    wrapped.module = model  # a DDP-shaped wrapper: WeightSync must unwrap it
    with RolloutGenerator(model, continuous_batching_config=CB) as gen:
        sync = WeightSync(gen, wrapped, every=2)
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        ptrs = gen.manager.engine.cache.data_ptrs()
        synced = []
        for step in range(4):
            batch = gen.generate(prompts, n=2, sampling_params=SamplingParams(temperature=1.0, max_new_tokens=6,
                                                                              seed=step, ignore_eos=True))
            t = batch.to_tensors()
            ids = torch.cat([t["prompt_ids"], t["completion_ids"]], dim=1)
            model.train()
            model(ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
            model.eval()
            synced.append(sync())
            metrics = sync.log(batch, step=step)
            assert metrics["rollout/weight_version"] == gen.weight_version - (1 if synced[-1] else 0)
        assert synced == [False, True, False, True] and gen.weight_version == 2
        assert sync.last_seconds is not None and metrics["rollout/weight_sync_seconds"] == sync.last_seconds
        _assert_in_sync(gen, model, prompts)
        assert gen.manager.engine.cache.data_ptrs() == ptrs


def test_weight_sync_callback_with_hf_trainer(tmp_path):
    model = tiny_model("qwen3")
    data = random_prompts([16] * 8, seed=2)
    ds = Dataset.from_dict({"input_ids": data, "labels": data})
    with RolloutGenerator(model, continuous_batching_config=CB) as gen:
        callback = WeightSyncCallback(gen, every=1)
        args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=2,
                                 learning_rate=1e-2, use_cpu=True, report_to="none", save_strategy="no",
                                 logging_steps=1, disable_tqdm=True)
        trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[callback])
        trainer.train()
        assert gen.weight_version == 2
        assert any("rollout/weight_sync_seconds" in h for h in trainer.state.log_history)
        model.eval()
        _assert_in_sync(gen, model, data[:2])


def test_rollout_metrics_shape():
    model = tiny_model("qwen3")
    with RolloutGenerator(model, continuous_batching_config=CB) as gen:
        batch = gen.generate(random_prompts([9], seed=3), n=4,
                             sampling_params=SamplingParams(temperature=1.0, max_new_tokens=5, seed=1,
                                                            ignore_eos=True))
    m = rollout_metrics(batch, sync_seconds=0.5)
    assert m["rollout/completion_length/mean"] == 5 and m["rollout/finish_reason/length"] == 1.0
    assert m["rollout/prefill_tokens"] == 9 and m["rollout/generated_tokens"] == 20
    assert 0 < m["rollout/kv_cache_usage"] <= 1 and m["rollout/weight_sync_seconds"] == 0.5
