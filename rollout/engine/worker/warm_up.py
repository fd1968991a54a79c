"""Warming an engine up before it serves: one forward per step size its first requests will meet.

Why: the first step of each new size pays one-off costs on the request that happens to bring it. On CPU oneDNN generates
its kernels per row count of a packed matmul, and at compile level 1 the very first step compiles the forward, which
takes seconds (benchmarks/RESULTS.md, "Serving" and "Compile levels"). A server that warms up before it listens answers
its first requests as fast as its later ones, as vLLM's does after its start-up runs.

How: throwaway greedy requests of random token ids, one at a time, each prefilling exactly one row bucket of the packed
linears (`row_buckets.padded_rows`: powers of two, then multiples of 8 and 64) up to `max_tokens`, then one decode
step. Then nothing of them is left: their prefix-cache entries are dropped (random prompts would only crowd the cache),
and the counters that /metrics reports (steps, tokens, peak blocks) and the sampler's random state are put back as
they were, so the warm-up is invisible except in the time it took.
"""

from __future__ import annotations

import copy
import logging
import random
import time
from dataclasses import dataclass

from rollout.engine.cpu.row_buckets import padded_rows
from rollout.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

WARM_UP_PREFIX = "warm-up-"
NEW_TOKENS = 2  # the second token is a one-row decode step


@dataclass(frozen=True)
class WarmUp:
    """What a warm-up ran: the prompt lengths (one request each) and how long it took."""

    prompt_lengths: tuple[int, ...]
    seconds: float


def bucket_lengths(max_tokens: int) -> list[int]:
    """Every row bucket of the packed linears up to `max_tokens`: the prompt lengths a warm-up runs."""
    return sorted(rows for rows in {padded_rows(n) for n in range(1, max_tokens + 1)} if rows <= max_tokens)


def warm_up(engine, max_tokens: int, seed: int = 0) -> WarmUp:
    """Run one throwaway request per row bucket up to `max_tokens` prompt tokens (fewer where the context or the KV
    cache is shorter) through `engine`, which must be idle and is left as it was (no cached blocks; counters and random
    state restored). Returns what ran."""
    if engine.has_unfinished():
        raise RuntimeError("warm_up needs an idle engine: it has unfinished requests; warm up before serving")
    room = engine.pool.num_blocks * engine.cache.page_size  # a request must fit the cache on its own
    if engine.max_positions is not None:
        room = min(room, engine.max_positions)
    lengths = [n for n in bucket_lengths(max_tokens) if n + NEW_TOKENS <= room]
    saved = _counters(engine)
    rng_state = engine.sampler.generator.get_state()
    rng = random.Random(seed)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    start = time.perf_counter()
    try:
        for i, length in enumerate(lengths):
            engine.add_request([rng.randrange(engine.vocab_size) for _ in range(length)],
                               request_id=f"{WARM_UP_PREFIX}{i}", sampling_params=greedy)
            while engine.has_unfinished():
                engine.step()
    finally:
        for request_id in [rid for rid in engine.requests if rid.startswith(WARM_UP_PREFIX)]:
            engine.cancel(request_id)
        engine.reset_prefix_cache()
        _restore(engine, saved)
        engine.sampler.generator.set_state(rng_state)
    report = WarmUp(tuple(lengths), time.perf_counter() - start)
    logger.info("warmed up %d step sizes (prompts of 1-%d tokens) in %.1fs", len(lengths), max(lengths, default=0),
                report.seconds)
    return report


def _counters(engine) -> dict:
    sched = engine.scheduler
    return dict(engine=copy.copy(engine.counters), scheduler=copy.copy(sched.counters),
                preemptions=sched.num_preemptions, chunked=sched.num_chunked_prefills)


def _restore(engine, saved: dict) -> None:
    engine.counters.update(saved["engine"])
    engine.scheduler.counters.update(saved["scheduler"])
    engine.scheduler.num_preemptions = saved["preemptions"]
    engine.scheduler.num_chunked_prefills = saved["chunked"]
