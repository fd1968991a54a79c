"""One engine step: schedule -> run -> sample -> update requests. No threads and no I/O here; the manager owns those."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import numbers

import torch
from transformers import GenerationConfig, PreTrainedModel

from rollout.config import DEFAULT_MAX_REQUESTS, ContinuousBatchingConfig
from rollout.engine.block_pool import BlockPool
from rollout.engine.kv_cache import KVShape, PagedKVCache
from rollout.engine.model_runner import ModelRunner
from rollout.engine.request import Request, RequestOutput, RequestStatus
from rollout.engine.sampler import Sampler, SampleRow
from rollout.engine.scheduler import Scheduler
from rollout.sampling_params import SamplingParams, resolve_sampling

logger = logging.getLogger(__name__)


def uses_sliding_window(config) -> bool:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    layer_types = getattr(text, "layer_types", None) or []
    return getattr(text, "sliding_window", None) is not None and (
        not layer_types or any(t == "sliding_attention" for t in layer_types)
    )


def derive_seed(seed: int, index: int) -> int:
    """Seed of sample `index` in an n-sample group: distinct per sample, stable across runs."""
    return seed if index == 0 else hash((seed, index, 0x6E)) & 0x7FFF_FFFF_FFFF_FFFF


class LLMEngine:
    """Continuous-batching engine over a paged KV cache for any transformers causal LM, driven by `step()`."""

    def __init__(self, model: PreTrainedModel, generation_config: GenerationConfig | None = None,
                 config: ContinuousBatchingConfig | None = None, tokens_hint: int | None = None,
                 tokenizer=None) -> None:
        self.model = model
        self.tokenizer = tokenizer  # only needed for stop strings
        self.config = config or ContinuousBatchingConfig()
        self.generation_config = generation_config or getattr(model, "generation_config", None) or GenerationConfig()
        text = model.config.get_text_config()
        self.vocab_size = int(text.vocab_size)
        self.max_positions = getattr(text, "max_position_embeddings", None)
        self.model_eos = getattr(text, "eos_token_id", None)

        param = next(model.parameters())
        device, dtype = param.device, param.dtype
        shape = KVShape.from_config(model.config)
        page = self.config.page_size
        num_blocks = self.config.resolve_num_blocks(shape.bytes_per_token(dtype) * page, device, tokens_hint)
        self.sliding_window = uses_sliding_window(model.config)
        self.cache = PagedKVCache(shape, num_blocks, page, dtype, device)
        self.pool = BlockPool(num_blocks, enable_prefix_cache=self.config.allow_block_sharing
                              and not self.sliding_window)
        self.scheduler = Scheduler(
            self.pool, page, self.config.resolve_batch_tokens(device),
            self.config.max_requests_per_batch or DEFAULT_MAX_REQUESTS,
            policy=self.config.scheduler_type, safety_margin=self.config.safety_margin)
        self.runner = ModelRunner(model, self.cache, self.config.prepack_weights, self.config.cpu_attention_kernel)
        self.sampler = Sampler(self.config.seed)
        self.requests: dict[str, Request] = {}
        self._pending_outputs: list[RequestOutput] = []
        # prompt -> the queued leader that identical prompts join (one prefill, then forks), while it has not started
        self._open_groups: dict[tuple[int, ...], Request] = {}
        self._arrivals = itertools.count()
        self._auto_ids = itertools.count()
        self.counters = dict(steps=0, prompt_tokens=0, generated_tokens=0, prefill_tokens=0, decode_tokens=0,
                             prefix_hit_tokens=0, forward_errors=0, peak_used_blocks=0)
        logger.info("KV cache: %d blocks x %d tokens (%.1f MiB)", num_blocks, page, self.cache.nbytes / 2**20)

    # ------------------------------------------------------------------ weights
    @property
    def weight_version(self) -> int:
        return self.scheduler.weight_version

    def set_weight_version(self, version: int, recompute: bool = False) -> None:
        """New weights are in place: key new prefix-cache entries by `version`; optionally recompute running KV."""
        self.scheduler.weight_version = version
        self.runner.weights_changed()
        if recompute:
            self.scheduler.preempt_all()

    def reset_prefix_cache(self) -> int:
        return self.pool.reset_prefix_cache()

    # ----------------------------------------------------------------- requests
    def new_request_id(self) -> str:
        return f"req_{next(self._auto_ids)}"

    def add_request(self, prompt_ids: list[int], request_id: str | None = None,
                    sampling_params: SamplingParams | None = None, streaming: bool = False) -> list[str]:
        """Queue a prompt (n sequences if `sampling_params.n > 1`, ids `{id}#{i}`); returns the sequence ids.

        An invalid prompt or invalid settings do not raise: the request fails alone, with the reason in its output.
        A duplicate id is the caller's bug and raises ValueError.
        """
        request_id = request_id if request_id is not None else self.new_request_id()
        n = sampling_params.n if sampling_params is not None else 1
        ids = [request_id] if n <= 1 else [f"{request_id}#{i}" for i in range(n)]  # n < 1 fails under its own id
        for rid in ids:
            if rid in self.requests:
                raise ValueError(f"request id {rid!r} is already in use; pass a unique request_id or None")
        try:
            prompt = self._validate_prompt(prompt_ids)
            sampling = resolve_sampling(sampling_params, self.generation_config, self.model_eos)
            if sampling.stop_strings and self.tokenizer is None:
                raise ValueError("stop_strings need a tokenizer: pass tokenizer= to the engine/manager/generator")
        except ValueError as err:
            for rid in ids:
                self._pending_outputs.append(RequestOutput(
                    request_id=rid, prompt_ids=_safe_list(prompt_ids), status=RequestStatus.FAILED,
                    finish_reason="error", error=f"request {rid!r}: {err}"))
            return ids
        group = []
        for i, rid in enumerate(ids):
            sample_sampling = sampling
            if sampling.seed is not None and i:
                sample_sampling = dataclasses.replace(sampling, seed=derive_seed(sampling.seed, i))
            req = Request(rid, prompt, sample_sampling, arrival=next(self._arrivals), streaming=streaming)
            self.requests[rid] = req
            group.append(req)
        key = tuple(prompt)
        leader = self._open_group(key)
        if leader is not None:  # the same prompt is already queued: prefill it once for both (see _fork)
            leader.followers.extend(group)
        else:
            group[0].followers = group[1:]  # one prefill for the group; the others fork off it (see _fork)
            self.scheduler.add(group[0])
            if self.config.allow_block_sharing:
                self._open_groups[key] = group[0]
        self.counters["prompt_tokens"] += len(prompt)
        return ids

    def _open_group(self, key: tuple[int, ...]) -> Request | None:
        """The queued leader a prompt equal to `key` can join: still waiting, nothing computed or sampled yet."""
        leader = self._open_groups.get(key)
        if leader is None:
            return None
        if leader.status == RequestStatus.PENDING and leader.num_computed == 0 and not leader.num_generated:
            return leader
        del self._open_groups[key]
        return None

    def _close_group(self, req: Request) -> bool:
        """Stop identical prompts from joining `req`; True if they could until now."""
        key = tuple(req.prompt_ids)
        if self._open_groups.get(key) is req:
            del self._open_groups[key]
            return True
        return False

    def _validate_prompt(self, prompt_ids) -> list[int]:
        if prompt_ids is None or len(prompt_ids) == 0:
            raise ValueError("the prompt is empty; pass at least one token id")
        if isinstance(prompt_ids, torch.Tensor):
            prompt_ids = prompt_ids.flatten().tolist()
        wrong = next((t for t in prompt_ids if isinstance(t, bool) or not isinstance(t, numbers.Integral)), None)
        if wrong is not None:
            raise ValueError(f"token ids must be integers, got {wrong!r} ({type(wrong).__name__})")
        prompt = [int(t) for t in prompt_ids]
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the model's vocabulary [0, {self.vocab_size}) "
                             f"({len(bad)} such ids in the prompt)")
        if self.max_positions is not None and len(prompt) >= self.max_positions:
            raise ValueError(f"the prompt has {len(prompt)} tokens but the model allows at most "
                             f"{self.max_positions} positions (prompt plus at least one new token)")
        return prompt

    def cancel(self, request_id: str) -> RequestOutput | None:
        """Cancel a live request and free its blocks now; None if the id is unknown or already finished."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        leader = next((r for r in itertools.chain(self.scheduler.waiting, self.scheduler.running)
                       if req in r.followers), None)
        if leader is not None:
            leader.followers.remove(req)
        else:
            was_open = self._close_group(req)
            heir = self._detach_followers(req)
            if was_open and heir is not None:  # identical prompts arriving later still join the group
                self._open_groups[tuple(heir.prompt_ids)] = heir
            self.scheduler.finish(req)
        return self._finish(req, RequestStatus.CANCELLED, "cancelled")

    def _detach_followers(self, req: Request) -> Request | None:
        """A leader leaves before forking: its first follower takes over the group's place in the queue."""
        if not req.followers:
            return None
        heir, heir.followers = req.followers[0], req.followers[1:]
        req.followers = []
        self.scheduler.waiting.appendleft(heir)
        return heir

    def has_unfinished(self) -> bool:
        return bool(self.scheduler.has_work() or self._pending_outputs)

    # --------------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """Run one step; returns outputs of requests that finished or (if streaming) got a token."""
        outputs, self._pending_outputs = self._pending_outputs, []
        plan = self.scheduler.schedule()
        for req in plan.failed:
            self._close_group(req)
            for member in [req] + req.followers:
                outputs.append(self._finish(member, RequestStatus.FAILED, "error", req.error))
            req.followers = []
        if not plan.requests:
            return outputs
        for req in plan.requests:
            if req.num_computed == 0:  # starts now: later identical prompts queue a group of their own
                self._close_group(req)
        self.counters["steps"] += 1
        self.counters["peak_used_blocks"] = max(self.counters["peak_used_blocks"], self.pool.num_used)
        try:
            logits = self.runner.run(plan)
        except Exception as err:  # a forward error fails this step's requests; the engine keeps serving
            logger.exception("model forward failed; failing the %d requests of this step", len(plan))
            self.counters["forward_errors"] += 1
            self.pool.unregister(plan.registered_blocks)
            for req in plan.requests:
                self._detach_followers(req)
                self.scheduler.finish(req)
                outputs.append(self._finish(req, RequestStatus.FAILED, "error",
                                            f"request {req.request_id!r}: model forward failed: {err!r}"))
            return outputs

        for req, num in zip(plan.requests, plan.query_lens):
            req.num_computed += num
            self.counters["decode_tokens" if num == 1 and req.num_generated else "prefill_tokens"] += num
        if not plan.sample_rows:  # only partial prefill chunks ran: nothing to sample yet
            return outputs
        members, logit_rows = [], []
        for row, entry in enumerate(plan.sample_rows):
            leader = plan.requests[entry]
            for member in [leader] + leader.followers:
                members.append(member)
                logit_rows.append(row)
        if len(logit_rows) != logits.shape[0]:
            logits = logits[torch.tensor(logit_rows)]
        result = self.sampler.sample(logits, [SampleRow(m.sampling, m.tokens, m.num_generated) for m in members])
        version = self.weight_version
        for i, req in enumerate(members):
            req.tokens.append(result.tokens[i])
            req.logprobs.append(result.logprobs[i])
            req.policy_logprobs.append(result.policy_logprobs[i])
            req.kept_logmass.append(result.kept_logmass[i])
            req.weight_versions.append(version)
            req.status = RequestStatus.DECODING
        self.counters["generated_tokens"] += len(members)

        for entry in plan.sample_rows:
            leader = plan.requests[entry]
            if leader.followers:
                self._fork(leader)
        for req in members:
            reason = self._stop_reason(req)
            if reason is not None:
                self.scheduler.finish(req)
                outputs.append(self._finish(req, RequestStatus.FINISHED, reason))
            elif req.streaming:
                outputs.append(req.to_output())
        return outputs

    def _fork(self, leader: Request) -> None:
        followers, leader.followers = leader.followers, []
        for follower in followers:
            if self._stop_reason(follower) is not None:
                continue  # finished on its first token; nothing to allocate
            if not self.scheduler.fork(leader, follower, self.cache.copy_block):
                follower.status = RequestStatus.PENDING  # no room for its partial block: recompute later
                self.scheduler.waiting.appendleft(follower)

    def _stop_reason(self, req: Request) -> str | None:
        p = req.sampling
        token = req.tokens[-1]
        if req.num_generated >= p.min_new_tokens and (token in p.eos_token_ids or token in p.stop_token_ids):
            return "stop"
        if p.stop_strings and req.num_generated >= p.min_new_tokens and self._hit_stop_string(req):
            return "stop"
        if req.num_generated >= p.max_new_tokens:
            return "length"
        if self.max_positions is not None and len(req.tokens) >= self.max_positions:
            return "length"
        return None

    def _hit_stop_string(self, req: Request) -> bool:
        """Decode just enough of the tail to see a stop string that ends at the newest token."""
        window = max(len(s) for s in req.sampling.stop_strings) + 2
        tail = self.tokenizer.decode(req.generated_tokens[-window:], skip_special_tokens=False)
        return any(s in tail for s in req.sampling.stop_strings)

    def _finish(self, req: Request, status: RequestStatus, reason: str, error: str | None = None) -> RequestOutput:
        req.finish(status, reason, error)
        self.requests.pop(req.request_id, None)
        if req.num_prefix_hit_tokens:
            self.counters["prefix_hit_tokens"] += req.num_prefix_hit_tokens
        return req.to_output()

    def fail_all(self, error: str) -> list[RequestOutput]:
        """Fail every live request (hard stop): blocks are released, outputs carry `error`."""
        outputs = []
        for req in list(self.requests.values()):
            self.scheduler.finish(req)
            req.followers = []
            outputs.append(self._finish(req, RequestStatus.FAILED, "error", error))
        self.scheduler.waiting.clear()
        self._open_groups.clear()
        return outputs

    # -------------------------------------------------------------------- stats
    def stats(self) -> dict:
        return dict(
            num_blocks=self.pool.num_blocks, free_blocks=self.pool.num_free, cached_blocks=self.pool.num_cached,
            used_blocks=self.pool.num_used, running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting), weight_version=self.weight_version,
            preemptions=self.scheduler.num_preemptions, chunked_prefills=self.scheduler.num_chunked_prefills,
            page_size=self.cache.page_size, **self.counters)

    def reset_peak(self) -> None:
        """Start a new window for `peak_used_blocks` (e.g. one rollout call)."""
        self.counters["peak_used_blocks"] = self.pool.num_used

    def check_invariants(self) -> None:
        """Block pool consistency against every live block table (used by tests)."""
        tables = [r.block_table for r in self.scheduler.running] + [r.block_table for r in self.scheduler.waiting]
        self.pool.check_invariants(tables)


def _safe_list(prompt_ids) -> list:
    try:
        return [int(t) for t in prompt_ids]
    except (TypeError, ValueError):
        return []

