"""The pieces of the scale-out layer, in one process: spreading groups, packing and gathering weights, the one
rejection message, pooled metrics, and a worker's numbering of prompts (which is what makes a pool's results
independent of which worker ran a group)."""

import dataclasses

import pytest
import torch

from rollout import ContinuousBatchingConfig, RolloutGenerator, SamplingParams, WeightUpdateError
from rollout.distributed.balance import group_cost, spread
from rollout.distributed.broadcast import collect_weights, pack, rejection, unpack
from rollout.distributed.metrics import batch_stats, pooled, worker_metrics
from rollout.distributed.pool import RolloutPool
from rollout.distributed.server_pool import REMOTE_FIELDS, RolloutServerPool, refused_fields, remote_fields
from rollout.distributed.spec import ModelSpec
from rollout.engine.core.stats import EngineStats
from rollout.rl.backend import RolloutBackend
from rollout.rl.batch import RolloutBatch
from tests.helpers.models import random_prompts, tiny_model
from trainer_hooks.metrics import rollout_metrics

CB = ContinuousBatchingConfig(page_size=8, num_blocks=256)


# ------------------------------------------------------------------ spreading
def test_spread_keeps_groups_whole_and_the_busiest_worker_within_one_group_of_even():
    costs = [group_cost(p, n, 16) for p, n in [(30, 4), (5, 8), (100, 1), (7, 2), (64, 4), (12, 8), (9, 1)]]
    assigned = spread(costs, {"a": 0, "b": 0, "c": 0})
    assert sorted(i for groups in assigned.values() for i in groups) == list(range(len(costs)))  # each group once
    loads = {w: sum(costs[i] for i in groups) for w, groups in assigned.items()}
    assert max(loads.values()) - min(loads.values()) <= max(costs)
    assert all(groups == sorted(groups) for groups in assigned.values())


def test_spread_counts_what_a_worker_already_has_queued_and_is_deterministic():
    assigned = spread([10, 10, 10], {"busy": 15, "idle": 0})
    assert assigned == {"busy": [2], "idle": [0, 1]}
    assert spread([10, 10, 10], {"busy": 15, "idle": 0}) == assigned
    assert spread([10, 10, 10], {"busy": 25, "idle": 0}) == {"busy": [], "idle": [0, 1, 2]}
    assert spread([], {"a": 0}) == {"a": []}
    with pytest.raises(ValueError, match="no worker"):
        spread([1], {})


# -------------------------------------------------------------------- weights
def test_pack_round_trips_every_dtype_without_copying_on_unpack():
    state = {"w": torch.randn(3, 4), "h": torch.randn(5).bfloat16(), "i": torch.arange(6).reshape(2, 3),
             "s": torch.tensor(2.5, dtype=torch.float16), "e": torch.empty(0, 7)}
    packed = pack(state)
    back = unpack(packed)
    for name, tensor in state.items():
        assert back[name].dtype == tensor.dtype and back[name].shape == tensor.shape
        assert torch.equal(back[name], tensor), name
    assert back["w"].data_ptr() == packed["w"][2].ctypes.data  # a view of the packed bytes


def test_collect_weights_copies_a_stream_whose_buffers_are_reused_and_sends_tied_weights_once():
    model = tiny_model("qwen3")
    model.lm_head.weight = model.model.embed_tokens.weight  # tied
    state = model.state_dict()
    expected = {k: v.clone() for k, v in state.items()}

    def gathered_one_at_a_time():  # as ZeRO-3: the buffer is freed (here: overwritten) once the next one is asked for
        for name, tensor in state.items():
            buffer = tensor.clone()
            yield name, buffer
            buffer.fill_(float("nan"))

    collected = collect_weights(gathered_one_at_a_time())
    assert list(collected) == list(state)  # none skipped: a freed buffer's address says nothing about ties
    for name, tensor in collected.items():
        assert torch.equal(tensor, expected[name]), name
    by_module = collect_weights(model)
    assert "lm_head.weight" not in by_module and "model.embed_tokens.weight" in by_module
    view = collect_weights({"half": torch.arange(10.0)[:5]})["half"]  # a view must not drag its whole storage along
    assert view.untyped_storage().nbytes() == 5 * 4


def test_rejection_names_every_refusal_and_says_nobody_applied_it():
    err = rejection({"worker 0": "shape mismatch for 'x'", "worker 3": "non-finite values in 'y'"}, version=4, total=5)
    assert isinstance(err, WeightUpdateError)
    message = str(err)
    for part in ("2 of 5", "none applied", "version 4", "worker 0: shape mismatch", "worker 3: non-finite"):
        assert part in message, message


@pytest.mark.parametrize("tied", [False, True])
def test_model_spec_builds_the_same_model_from_config_and_weights(tied):
    model = tiny_model("llama")
    if tied:  # the lm_head is the embedding matrix: shipped once, tied again in the built model
        model.config.tie_word_embeddings = True
        model.tie_weights()
    built = ModelSpec.from_model(model).build(collect_weights(model))
    assert type(built) is type(model) and not built.training
    assert (built.lm_head.weight.data_ptr() == built.model.embed_tokens.weight.data_ptr()) == tied
    ids = torch.tensor([random_prompts([9], seed=1)[0]])
    assert torch.equal(built(ids).logits, model(ids).logits)
    partial = {k: v for k, v in model.state_dict().items() if "layers.1." not in k}
    with pytest.raises(ValueError, match="lack"):
        ModelSpec.from_model(model).build(partial)
    with pytest.raises(TypeError, match="PreTrainedModel"):
        ModelSpec.from_model(torch.nn.Linear(2, 2))


# -------------------------------------------------------------------- metrics
def _stats(**kw) -> EngineStats:
    base = dict(num_blocks=100, page_size=8, free_blocks=100, cached_blocks=0, used_blocks=0, peak_used_blocks=0,
                running=0, waiting=0, weight_version=3)
    return EngineStats(**{**base, **kw})


def test_pooled_stats_sum_engines_and_keep_the_definitions():
    a = _stats(used_blocks=30, peak_used_blocks=50, prefix_hit_tokens=10, prefill_tokens=30, generated_tokens=7)
    b = _stats(num_blocks=300, used_blocks=10, peak_used_blocks=10, prefill_tokens=60, generated_tokens=5)
    both = pooled([a, b])
    assert both.num_blocks == 400 and both.generated_tokens == 12 and both.page_size == 8
    assert both.weight_version == 3
    assert both.kv_cache_usage == 40 / 400
    assert both.prefix_cache_hit_rate == 10 / 100


def test_pool_batch_metrics_reach_the_trainer_per_worker():
    workers = [{"worker": 0, "groups": 2, "queued_tokens": 40, "seconds": 0.5, "tokens_per_second": 20.0,
                "peak_kv_cache_usage": 0.25, "weight_version": 3},
               {"worker": 2, "groups": 1, "queued_tokens": 30, "seconds": 0.25, "tokens_per_second": 40.0,
                "peak_kv_cache_usage": 0.5, "weight_version": 3}]
    stats = batch_stats([_stats(generated_tokens=10), _stats(generated_tokens=10)], 0.5, workers, live_workers=2)
    assert stats["tokens_per_second"] == 40.0 and stats["generated_tokens"] == 20
    metrics = rollout_metrics(RolloutBatch(samples=[], group_sizes=[], stats=stats))
    assert metrics["rollout/tokens_per_second"] == 40.0 and metrics["rollout/workers"] == 2.0
    assert metrics["rollout/worker2/queued_tokens"] == 30.0 and metrics["rollout/worker0/peak_kv_cache_usage"] == 0.25
    assert worker_metrics({"steps": 3}) == {}  # one generator's batch: no per-worker keys


# --------------------------------------------------------------------- worker
def test_a_worker_given_some_groups_generates_what_one_generator_given_all_does():
    """Seeds derive from a prompt's index in the whole batch, so any split of the groups gives the same samples."""
    pytest.importorskip("ray", reason="RolloutWorker is a Ray actor class: pip install 'rollout[ray]'")
    from rollout.distributed.worker import RolloutWorker

    model = tiny_model("qwen3")
    prompts = random_prompts([6, 11, 4, 9, 15], seed=5)
    sizes = [2, 1, 3, 2, 2]
    params = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=8, seed=99, ignore_eos=True)
    with RolloutGenerator(model, continuous_batching_config=CB) as gen:
        whole = gen.generate(prompts, n=sizes, sampling_params=params)
    worker = RolloutWorker(ModelSpec.from_model(model), pack(collect_weights(model)), continuous_batching_config=CB)
    try:
        ids, got_sizes, max_new = worker.prepare(prompts, sizes, params)
        assert ids == prompts and got_sizes == sizes and max_new == 8
        samples, stats = worker.generate([(j, prompts[j], sizes[j]) for j in (3, 0, 4)], params)
        assert stats["prefill_tokens"] == sum(len(prompts[j]) for j in (3, 0, 4))
        expected = [s for s in whole.samples if s.prompt_index in (3, 0, 4)]
        assert sorted((s.prompt_index, s.completion_ids) for s in samples) == sorted(
            (s.prompt_index, s.completion_ids) for s in expected)
        with pytest.raises(ValueError, match="prompt 2"):
            worker.prepare([[1], [2], [3, 9999]], 1, params)
    finally:
        worker.close()


# ------------------------------------------------------- what travels to servers
def test_every_sampling_field_has_a_rule_for_servers():
    """A new SamplingParams field cannot be dropped silently on the way to a server: the table must name it."""
    assert set(REMOTE_FIELDS) == {f.name for f in dataclasses.fields(SamplingParams)}


def test_server_fields_are_sent_translated_or_refused():
    fields = remote_fields(SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=5, seed=3, n=4,
                                          stop_token_ids=[9], eos_token_id=[2, 9], do_sample=False))
    assert fields == {"temperature": 0.0, "top_p": 0.9, "max_new_tokens": 5, "stop_token_ids": [2, 9]}
    assert remote_fields(SamplingParams(do_sample=True, eos_token_id=7)) == {"stop_token_ids": [7]}
    with pytest.raises(ValueError, match=r"allowed_token_ids .*; logprobs .*generate with an engine in this process"):
        remote_fields(SamplingParams(allowed_token_ids=[1, 2], logprobs=2))
    assert refused_fields(SamplingParams(logits_processors=[print])) == {
        "logits_processors": "callables do not travel over HTTP"}


def test_every_backend_says_what_it_is():
    assert isinstance(RolloutGenerator(tiny_model("qwen3"), continuous_batching_config=CB), RolloutBackend)
    for backend in (RolloutGenerator, RolloutPool, RolloutServerPool):
        assert isinstance(backend.shared_by_processes, bool) and isinstance(backend.keeps_kv, bool)
        assert callable(backend.check_sampling) and callable(backend.generate) and callable(backend.update_weights)
