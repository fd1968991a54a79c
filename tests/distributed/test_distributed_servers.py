"""RolloutServerPool over real `rollout serve` apps on 127.0.0.1: the same results as one RolloutGenerator, weights
streamed to every server and applied by all or none, failover from a stopped or hung server, and TRL training
across several servers."""

import contextlib
import copy
import logging

import pytest
import torch

pytest.importorskip("fastapi", reason="the server pool tests need the serve extra: pip install 'rollout[serve]'")
from rollout import ContinuousBatchingConfig, RolloutGenerator, SamplingParams, WeightUpdateError
from rollout.client import RolloutClient
from rollout.distributed import RolloutServerPool
from rollout.server import create_app
from tests.helpers.models import perturbed, random_prompts, tiny_model
from tests.helpers.server import running_server
from trainer_hooks import rollout_metrics

CB = ContinuousBatchingConfig(page_size=8, num_blocks=128)
GREEDY = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, top_k=50, max_new_tokens=8, seed=321, ignore_eos=True)


@pytest.fixture(autouse=True)
def one_thread():
    """The servers' engines, the references and the clients share two cores: one intra-op thread is fastest."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@contextlib.contextmanager
def _servers(model, tok, count, dtypes=None):
    """`count` servers of `model` (each its own copy), as a list of URLs and the stack that stops them."""
    with contextlib.ExitStack() as stack:
        urls = []
        for i in range(count):
            copy_ = copy.deepcopy(model).to((dtypes or {}).get(i, torch.float32))
            urls.append(stack.enter_context(running_server(create_app(copy_, tok, "tiny", CB))))
        yield urls, stack


def _reference(model, tok, prompts, n, params):
    with RolloutGenerator(model, tokenizer=tok, continuous_batching_config=CB) as gen:
        return gen.generate(prompts, n=n, sampling_params=params)


def _assert_same_batch(got, expected, version=0):
    assert got.group_sizes == expected.group_sizes
    assert [(s.prompt_index, s.prompt_ids, s.completion_ids) for s in got.samples] == [
        (s.prompt_index, s.prompt_ids, s.completion_ids) for s in expected.samples]
    for a, b in zip(got.samples, expected.samples):
        assert a.weight_versions == [v + version for v in b.weight_versions]
        assert torch.allclose(torch.tensor(a.policy_logprobs), torch.tensor(b.policy_logprobs), atol=1e-5)


def _versions(urls) -> list[int]:
    out = []
    for url in urls:
        with RolloutClient(url, timeout=30) as client:
            out.append(client.weight_version())
    return out


def test_servers_return_what_one_generator_returns_and_take_weights_together(model, tok):
    prompts = ["w1 w2 w3", random_prompts([14], seed=1)[0], "w9 w8", random_prompts([5], seed=2)[0], "w4"]
    sizes = [2, 3, 1, 2, 4]
    with _servers(model, tok, 2) as (urls, _), RolloutServerPool(urls, chunk_bytes=64 * 1024) as pool:
        for params in (GREEDY, SEEDED):
            batch = pool.generate(prompts, n=sizes, sampling_params=params)
            _assert_same_batch(batch, _reference(model, tok, prompts, sizes, params))
        workers = batch.stats["workers"]
        assert sorted(w["url"] for w in workers) == sorted(urls) and sum(w["groups"] for w in workers) == 5
        assert rollout_metrics(batch)["rollout/worker1/generated_tokens"] > 0
        assert pool.stats().num_blocks == 2 * CB.num_blocks

        new = perturbed(model, seed=4)
        assert pool.update_weights(new) == 1 and pool.weight_version == 1
        assert _versions(urls) == [1, 1] and {s.weight_version for s in pool.worker_stats().values()} == {1}
        after = pool.generate(prompts, n=sizes, sampling_params=GREEDY)
        _assert_same_batch(after, _reference(new, tok, prompts, sizes, GREEDY), version=1)


def test_an_update_one_server_refuses_is_applied_by_none(model, tok):
    """A float16 server refuses a value float16 cannot hold; the float32 server must not apply the update either."""
    state = perturbed(model, seed=5).state_dict()
    state["model.norm.weight"][0] = 1e6
    prompts = random_prompts([9, 12], seed=6)
    with _servers(model, tok, 2, dtypes={1: torch.float16}) as (urls, _):
        with RolloutServerPool(urls, chunk_bytes=64 * 1024) as pool:
            before = pool.generate(prompts[:1], sampling_params=GREEDY)
            with pytest.raises(WeightUpdateError) as info:
                pool.update_weights(state)
            assert _versions(urls) == [0, 0] and pool.weight_version == 0 and pool.urls == urls
        with RolloutServerPool(urls[:1]) as fp32_only:  # the float32 server still holds the old weights
            again = fp32_only.generate(prompts[:1], sampling_params=GREEDY)
    message = str(info.value)
    assert "rejected by 1 of 2" in message and urls[1] in message and "float16" in message
    assert urls[0] not in message
    assert again.samples[0].completion_ids == before.samples[0].completion_ids


def test_a_stopped_servers_groups_run_on_the_others_and_a_replacement_joins(model, tok, caplog):
    prompts = random_prompts([7, 15, 10, 4, 12, 9], seed=7)
    expected = _reference(model, tok, prompts, 2, SEEDED)
    with _servers(model, tok, 2) as (urls, _), RolloutServerPool(urls, timeout=30) as pool:
        with running_server(create_app(copy.deepcopy(model), tok, "tiny", CB)) as doomed:
            pool.add_server(doomed)
        # `doomed` has stopped: its connections are refused from now on
        with caplog.at_level(logging.WARNING, logger="rollout.distributed.server_pool"):
            batch = pool.generate(prompts, n=2, sampling_params=SEEDED)
        _assert_same_batch(batch, expected)
        assert pool.urls == urls and pool.lost[-1][0] == doomed
        assert any("left the pool" in r.getMessage() for r in caplog.records)

        pool.update_weights(model)  # version 1 everywhere, same weights
        with running_server(create_app(copy.deepcopy(model), tok, "tiny", CB)) as fresh:  # a restart: version 0
            with pytest.raises(ValueError, match="weight version 0, the pool at 1"):
                pool.add_server(fresh)
            pool.add_server(fresh, weights=model)
            again = pool.generate(prompts, n=2, sampling_params=SEEDED)
            assert fresh in {w["url"] for w in again.stats["workers"]}
        _assert_same_batch(again, expected, version=1)  # the fresh server's own version 1 reads as the pool's 1


def test_a_hung_server_is_detected_by_its_timeout(model, tok):
    prompts = random_prompts([8, 11, 6, 13], seed=8)
    expected = _reference(model, tok, prompts, 2, GREEDY)
    with _servers(model, tok, 2) as (urls, _), RolloutServerPool(urls, timeout=8.0) as pool:
        with RolloutClient(urls[0], timeout=30) as hung:
            hung.pause()  # it accepts requests but generates nothing
            try:
                batch = pool.generate(prompts, n=2, sampling_params=GREEDY)
            finally:
                hung.resume()
    _assert_same_batch(batch, expected)
    assert pool.lost == [(urls[0], pool.lost[0][1])] and "no answer in time" in pool.lost[0][1]


def _length_reward(completion_ids, **kwargs):
    return [len(ids) / 8 for ids in completion_ids]


def test_grpo_trains_across_several_servers(tmp_path, tok):
    pytest.importorskip("trl")
    from datasets import Dataset
    from trl import GRPOConfig

    from trainer_hooks import RolloutGRPOTrainer

    policy = tiny_model("qwen3", lm_head_scale=2.0)
    for config in (policy.config, policy.generation_config):
        config.eos_token_id = tok.eos_token_id
    policy.generation_config.pad_token_id = tok.pad_token_id
    args = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, per_device_train_batch_size=8,
                      num_generations=4, max_completion_length=8, max_steps=2, logging_steps=1, report_to="none",
                      save_strategy="no", learning_rate=5e-3, seed=0, disable_tqdm=True)
    with _servers(policy, tok, 2) as (urls, _):
        data = Dataset.from_dict({"prompt": [f"w{i} w{i + 1}" for i in range(16)]})
        trainer = RolloutGRPOTrainer(model=policy, reward_funcs=_length_reward, args=args, processing_class=tok,
                                     train_dataset=data, rollout_server=urls)
        trainer.train()
        trainer.vllm_generation.sync_weights()
        assert _versions(urls) == [3, 3]
    logs = [h for h in trainer.state.log_history if "sampling/sampling_logp_difference/max" in h]
    assert len(logs) == 2 and max(h["sampling/sampling_logp_difference/max"] for h in logs) < 1e-4
    assert logs[-1]["rollout/workers"] == 2 and "rollout/worker1/tokens_per_second" in logs[-1]


def test_an_async_producer_over_servers_keeps_the_bound_with_updates_in_flight(model, tok):
    from rollout import AsyncRollouts

    prompts = random_prompts([5, 9, 3, 12, 7, 4, 8, 6], seed=5)
    params = SamplingParams(temperature=1.0, max_new_tokens=16, ignore_eos=True)
    with _servers(model, tok, 2) as (urls, _), RolloutServerPool(urls, chunk_bytes=64 * 1024) as pool:
        with AsyncRollouts(pool, prompts, _length_reward, groups_per_batch=2, n=2, sampling_params=params,
                           max_staleness=1, seed=3) as producer:
            batches = []
            for k, batch in enumerate(producer):
                batches.append(batch)
                producer.update_weights(perturbed(model, seed=k + 1))
        assert _versions(urls) == [len(batches)] * 2
    groups = [g for b in batches for g in b.groups]
    assert sorted(g.index for g in groups) == list(range(8)) and all(len(b) == 2 for b in batches)
    for batch in batches:
        assert max(batch.versions_behind()) <= 1
        for group in batch.groups:
            assert group.rewards == [len(s.completion_ids) / 8 for s in group.samples] == [2.0, 2.0]
            assert group.admitted_version <= group.oldest_version <= group.newest_version <= batch.trainer_version
