"""Identical prompts submitted as separate requests (TRL's repeated prompts, per-sample budgets) are prefilled once:
later ones join the first while it is still queued, keep their own settings, and give what separate runs give."""


from transformers import GenerationConfig

from rollout import ContinuousBatchingConfig, LLMEngine, SamplingParams
from tests.helpers.models import greedy_reference, random_prompts, run_engine


def _engine(model, **config):
    return LLMEngine(model, GenerationConfig(do_sample=False), ContinuousBatchingConfig(page_size=8, num_blocks=96,
                                                                                        **config))


def test_identical_prompts_prefill_once_with_their_own_settings(qwen3):
    prompt, other = random_prompts([21, 13], seed=7)
    engine = _engine(qwen3)
    budgets = [5, 9, 3, 12]
    ids = [engine.add_request(prompt, sampling_params=SamplingParams(max_new_tokens=b))[0] for b in budgets]
    ids.append(engine.add_request(other, sampling_params=SamplingParams(max_new_tokens=4))[0])
    # a sampled member among greedy ones: its own temperature and seed apply from its first token
    ids.append(engine.add_request(prompt, sampling_params=SamplingParams(max_new_tokens=6, temperature=1.0,
                                                                         seed=11))[0])
    outs = run_engine(engine)
    assert engine.stats().prefill_tokens == len(prompt) + len(other), "each distinct prompt is computed once"
    ref, safe = greedy_reference(qwen3, prompt, max(budgets))
    for rid, budget in zip(ids, budgets):
        tokens = outs[rid].generated_tokens
        assert len(tokens) == budget and tokens[:min(safe, budget)] == ref[:min(safe, budget)]
    assert len(outs[ids[-1]].generated_tokens) == 6

    alone = _engine(qwen3)
    alone.add_request(prompt, sampling_params=SamplingParams(max_new_tokens=6, temperature=1.0, seed=11))
    assert next(iter(run_engine(alone).values())).generated_tokens == outs[ids[-1]].generated_tokens


def test_no_joining_once_the_first_has_started_or_without_sharing(qwen3):
    prompt = random_prompts([19], seed=8)[0]
    engine = _engine(qwen3)
    engine.add_request(prompt, sampling_params=SamplingParams(max_new_tokens=6))
    engine.step()  # the first copy is prefilled: a later identical prompt queues on its own (prefix-cache hits only)
    engine.add_request(prompt, sampling_params=SamplingParams(max_new_tokens=6))
    outs = run_engine(engine)
    assert len(outs) == 2 and len({tuple(o.generated_tokens) for o in outs.values()}) == 1
    assert engine.stats().prefill_tokens == len(prompt) + len(prompt) % 8  # the partial block is recomputed

    no_sharing = _engine(qwen3, allow_block_sharing=False)
    for _ in range(3):
        no_sharing.add_request(prompt, sampling_params=SamplingParams(max_new_tokens=4))
    run_engine(no_sharing)
    assert no_sharing.stats().prefill_tokens == 3 * len(prompt)


def test_cancelling_the_first_hands_the_group_to_the_next(qwen3):
    prompt = random_prompts([17], seed=9)[0]
    engine = _engine(qwen3)
    first, second, third = (engine.add_request(prompt, sampling_params=SamplingParams(max_new_tokens=5))[0]
                            for _ in range(3))
    (out,) = engine.cancel(first)
    assert out.finish_reason == "cancelled"
    fourth = engine.add_request(prompt, sampling_params=SamplingParams(max_new_tokens=5))[0]
    outs = run_engine(engine)
    assert sorted(outs) == sorted([second, third, fourth])
    assert len({tuple(o.generated_tokens) for o in outs.values()}) == 1
    assert engine.stats().prefill_tokens == len(prompt), "the fourth joined the group the second took over"


def _count_queue_scans(scheduler) -> dict:
    """Make the scheduler's waiting/running queues count membership tests and removals (each a linear scan)."""
    scans = {"count": 0}

    def counting(base):
        class Counting(base):
            def __contains__(self, item):
                scans["count"] += 1
                return super().__contains__(item)

            def remove(self, item):
                scans["count"] += 1
                return super().remove(item)

        return Counting

    scheduler.waiting = counting(type(scheduler.waiting))(scheduler.waiting)
    scheduler.running = counting(type(scheduler.running))(scheduler.running)
    return scans


def test_cancelling_a_huge_group_costs_linear_time(qwen3):
    """Cancellation runs under the engine lock: a group of n sequences must leave in O(n), not O(n^2) (which at this
    size is minutes), and a second request sharing its prefill keeps running."""
    prompt = random_prompts([9], seed=10)[0]
    engine = _engine(qwen3)
    (huge,) = {rid.split("#")[0] for rid in engine.add_request(prompt, "huge", SamplingParams(max_new_tokens=3,
                                                                                              n=10_000))}
    (joined,) = engine.add_request(prompt, "joined", SamplingParams(max_new_tokens=3))
    scans = _count_queue_scans(engine.scheduler)
    outs = engine.cancel(huge)
    # O(n^2) cancellation is a queue scan per sequence (or a fork-set scan per sequence): a handful of scans for the
    # whole group is O(n).
    assert scans["count"] <= 8, f"{scans['count']} queue scans to cancel one group"
    assert len(outs) == 10_000 and all(o.finish_reason == "cancelled" for o in outs)
    engine.check_invariants()
    assert list(run_engine(engine)) == [joined]
    assert engine.pool.num_used == 0
