"""AsyncRolloutGRPOTrainer: TRL's GRPO fed by the async producer, within the staleness bound, with TRL's own
importance-sampling correction computed from the engine's sampling logprobs."""

import math

import pytest
import torch
from datasets import Dataset

pytest.importorskip("trl")
from trl import GRPOConfig

from tests.trainer_hooks.test_trl import CB, PROMPTS, _common, _policy, reward_w7
from trainer_hooks import AsyncRolloutGRPOTrainer


@pytest.fixture(autouse=True)
def restore_threads():
    """The async trainer splits this process's intra-op threads between the engine and itself."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("max_staleness", [0, 1])
def test_async_grpo_trains_within_the_bound_and_frees_the_engine(tmp_path, max_staleness):
    model, tok = _policy()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    args = GRPOConfig(**{**_common(tmp_path), "max_steps": 4, "vllm_importance_sampling_correction": True})
    trainer = AsyncRolloutGRPOTrainer(model=model, reward_funcs=reward_w7, args=args,
                                      train_dataset=Dataset.from_dict({"prompt": PROMPTS}), processing_class=tok,
                                      rollout_config=CB, rollout_max_staleness=max_staleness)
    gen = trainer.rollout_generator
    threads = torch.get_num_threads()
    trainer.train()
    assert torch.get_num_threads() == max(1, threads - max(1, threads // 2)), "the trainer keeps the other half"
    logs = [h for h in trainer.state.log_history if "async/versions_behind/max" in h]
    assert len(logs) == 4
    assert all(h["async/versions_behind/max"] <= max_staleness for h in logs)
    if max_staleness == 1:
        assert max(h["async/versions_behind/max"] for h in logs) == 1, "generation never ran ahead"
    else:  # synchronous: the engine's logprobs are exact, so TRL's ratio is 1
        assert all(h["sampling/importance_sampling_ratio/max"] == pytest.approx(1.0, abs=1e-4) for h in logs)
    assert all(math.isfinite(h["loss"]) for h in trainer.state.log_history if "loss" in h)
    assert any(not torch.equal(initial[k], v) for k, v in model.state_dict().items()), "training changed nothing"
    assert trainer.rollout_producer is None, "train() closes its producer"
    stats = gen.manager.stats()
    assert stats.free_blocks == stats.num_blocks and not gen.manager.engine.has_unfinished()
    gen.close()


def test_unsupported_setups_are_refused(tmp_path):
    model, tok = _policy()
    with pytest.raises(ValueError, match="share_weights=False"):
        AsyncRolloutGRPOTrainer(model=model, reward_funcs=reward_w7, args=GRPOConfig(**_common(tmp_path)),
                                train_dataset=Dataset.from_dict({"prompt": PROMPTS}), processing_class=tok,
                                rollout_config=CB, share_weights=True)
