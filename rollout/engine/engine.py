"""One engine step: schedule -> run -> sample -> update requests. No threads and no I/O here; the manager owns those."""

from __future__ import annotations

import dataclasses
import gc
import itertools
import logging
import threading
import time
from collections.abc import Collection, Sequence

import torch
from transformers import GenerationConfig, PreTrainedModel

from rollout.config import DEFAULT_MAX_REQUESTS, ContinuousBatchingConfig
from rollout.engine.core.block_pool import BlockPool
from rollout.engine.core.kv_groups import KVGroups
from rollout.engine.core.request import ErrorKind, Request, RequestOutput, sequence_ids
from rollout.engine.core.scheduler import Scheduler
from rollout.engine.core.sequence_group import SequenceGroup
from rollout.engine.core.stats import EngineStats
from rollout.engine.core.stopping import StopChecker
from rollout.engine.core.swap_space import SwapSpace
from rollout.engine.cpu.core_budget import CoreBudget
from rollout.engine.sample import prompt_logprobs
from rollout.engine.sample.resolve import ResolvedSampling, resolve_sampling
from rollout.engine.sample.rows import SampleRow
from rollout.engine.sample.sampler import Sampler
from rollout.engine.sample.structured_output import GrammarCompiler
from rollout.engine.tensor_parallel import TensorParallelGroup, check_tp_config, kv_heads_per_rank, tp_size
from rollout.engine.worker import flash_backend
from rollout.engine.worker.compiled_forward import build_compiled_forward
from rollout.engine.worker.kv_cache import HostKVStorage, KVShape, PagedKVCache
from rollout.engine.worker.model_runner import ModelRunner
from rollout.sampling_params import SamplingParams
from rollout.validation import InvalidRequestError, check_prompt

logger = logging.getLogger(__name__)


def uses_sliding_window(config) -> bool:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    layer_types = getattr(text, "layer_types", None) or []
    return getattr(text, "sliding_window", None) is not None and (
        not layer_types or any(t == "sliding_attention" for t in layer_types)
    )


@dataclasses.dataclass(frozen=True)
class EngineHealth:
    """How the engine's recent model forwards went, so a server can report a broken model (say, a dtype the device
    cannot run) instead of saying "ok" while every request fails. `step()` replaces the record after each forward
    and never mutates one, so a reader on another thread always sees a consistent snapshot."""

    consecutive_failures: int = 0  # forwards failed since the last one that succeeded
    last_error: str | None = None  # repr of the most recent forward exception (kept after a recovery)
    last_error_time: float | None = None  # time.time() of that failure
    last_success_time: float | None = None  # time.time() of the most recent successful forward

    @property
    def failing(self) -> bool:
        """True while the most recent forward failed; one successful forward clears it."""
        return self.consecutive_failures > 0


class LLMEngine:
    """Continuous-batching engine over a paged KV cache for any transformers causal LM, driven by `step()`."""

    def __init__(self, model: PreTrainedModel, generation_config: GenerationConfig | None = None,
                 config: ContinuousBatchingConfig | None = None, tokens_hint: int | None = None,
                 tokenizer=None) -> None:
        self.model = model
        self.tokenizer = tokenizer  # only needed for stop strings and structured outputs
        self.generation_config = generation_config or getattr(model, "generation_config", None) or GenerationConfig()
        text = model.config.get_text_config()
        self.vocab_size = int(text.vocab_size)
        self.max_positions = getattr(text, "max_position_embeddings", None)
        self.model_eos = getattr(text, "eos_token_id", None)

        param = next(model.parameters())
        device, dtype = param.device, param.dtype
        self.config = (config or ContinuousBatchingConfig()).for_device(device, dtype, flash_backend.HAVE_FLASH)
        shape = KVShape.from_config(model.config)
        ranks = tp_size(model)
        self.tp_group: TensorParallelGroup | None = None  # the ranks this engine steps in lock step with
        if ranks > 1:
            self.config = check_tp_config(self.config, ranks)
            shape = dataclasses.replace(shape, num_kv_heads=kv_heads_per_rank(model, shape.num_kv_heads))
            self.tp_group = TensorParallelGroup(self.config.cpu_group_timeout)
        page = self.config.page_size
        batch_tokens = self.config.resolve_batch_tokens(device)
        self.kv_groups = self._kv_groups(shape, page, dtype, device)
        bytes_per_block = shape.bytes_per_token(dtype, self.kv_groups.num_slots) * page
        num_blocks = self.config.resolve_num_blocks(bytes_per_block, device, tokens_hint, batch_tokens,
                                                    self.vocab_size)
        if self.tp_group is not None:  # sized by each rank's free memory: every rank takes the smallest
            num_blocks, batch_tokens = self.tp_group.min_ints(num_blocks, batch_tokens)
        max_requests = self.config.max_requests_per_batch or DEFAULT_MAX_REQUESTS
        compiled = build_compiled_forward(self.config, device, batch_tokens)
        self.cache = PagedKVCache(shape, num_blocks, page, dtype, device, scratch_page=compiled is not None,
                                  layer_slots=self.kv_groups.layer_slot)
        self.runner = ModelRunner(model, self.cache, self.config.prepack_weights, self.config.cpu_attention_kernel,
                                  compiled, self.kv_groups)
        self.sliding_window = any(w is not None for w in self.kv_groups.windows)
        self.runner.fast_path_blocks = self.config.resolve_fast_path_blocks(self.runner.use_flash, self.sliding_window)
        # sliding groups give pages behind their window back to the pool as sequences grow; a prefix hit needs every
        # block of a full group and only what the window reads of a sliding one
        self.pool = BlockPool(num_blocks, enable_prefix_cache=self.config.allow_block_sharing)
        self.scheduler = Scheduler(
            self.pool, page, batch_tokens, max_requests,
            policy=self.config.scheduler_type, safety_margin=self.config.safety_margin,
            stop=StopChecker(self.max_positions, tokenizer), copy_block=self.cache.copy_block,
            share_prefills=self.config.allow_block_sharing, windows=self.kv_groups.windows,
            swap=self._swap_space(device, bytes_per_block))
        seed = self.config.seed if self.tp_group is None else self.tp_group.shared_seed(self.config.seed)
        self.sampler = Sampler(seed)
        use_budget = self.config.cpu_threads is not None and device.type == "cpu"
        self.core_budget = CoreBudget(self.config.cpu_threads) if use_budget else None
        self._grammars: GrammarCompiler | None = None  # built on the first structured-output request
        self._grammars_lock = threading.Lock()
        self._auto_ids = itertools.count()
        self.counters = dict(steps=0, forward_errors=0, peak_used_blocks=0)

    def _kv_groups(self, shape: KVShape, page: int, dtype: torch.dtype, device: torch.device) -> KVGroups:
        """Check that every layer's attention reaches the engine (UnsupportedModelError now, not a failed forward per
        request later) and group the layers by the window each slides over, in a one-token dry run on a one-block
        cache: the real cache's layout depends on the groups."""
        probe = ModelRunner(self.model, PagedKVCache(shape, 1, page, dtype, device), prepack_weights=False,
                            attention_kernel=False)
        probe.check_attention()
        if not uses_sliding_window(self.model.config):
            return KVGroups.single(shape.num_layers)
        groups = KVGroups.from_layer_windows(probe.layer_windows())
        if groups.num_groups > 1:
            logger.info("%s mixes attention kinds (windows %s): %d KV groups of %d layers, one block table each",
                        type(self.model).__name__, groups.windows, groups.num_groups, groups.num_slots)
        return groups

    def _swap_space(self, device: torch.device, bytes_per_block: int) -> SwapSpace | None:
        """The CPU swap space `cpu_offload_space` asks for (None when it is off or too small for one block)."""
        blocks = self.config.resolve_swap_blocks(bytes_per_block, self.cache.nbytes if device.type == "cpu" else 0)
        if blocks < 1:
            if self.config.cpu_offload_space != 0:
                logger.warning("CPU offload is off: the swap space asked for holds no whole KV block (%d bytes)",
                               bytes_per_block)
            return None
        storage = HostKVStorage(self.cache, blocks)
        return SwapSpace(blocks, storage.copy_out, storage.copy_in)

    # ------------------------------------------------------------------ weights
    @property
    def weight_version(self) -> int:
        return self.scheduler.weight_version

    def set_weight_version(self, version: int, recompute: bool = False, fresh: Collection[int] = ()) -> None:
        """New weights are in place: key new prefix-cache entries by `version`; optionally recompute running KV.
        `fresh`: the weights `load_weights` wrote with their packed copies (the other copies are refreshed on the next
        forward)."""
        self.scheduler.weight_version = version
        self.runner.weights_changed(fresh)
        if recompute:
            self.scheduler.preempt_all()

    def load_weights(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], recompute: bool = False) -> int:
        """Copy validated new values (live tensor, value) into the model in place and bump the weight version;
        returns it. On CPU a linear weight's packed copy is written in the same pass as the weight, from the value,
        so a sync reads the new values once instead of copying them and re-reading the weights on the next forward."""
        self.set_weight_version(self.weight_version + 1, recompute, self.runner.load_weights(pairs))
        return self.weight_version

    def reset_prefix_cache(self) -> int:
        return self.pool.reset_prefix_cache()

    # ----------------------------------------------------------------- requests
    def new_request_id(self) -> str:
        """The next id for a request submitted without one: `req_0`, `req_1`, ... per engine (the manager's
        requests take theirs from here too, so the two never collide)."""
        return f"req_{next(self._auto_ids)}"

    @property
    def requests(self) -> dict[str, Request]:
        """Live sequences by id (owned by the scheduler)."""
        return self.scheduler.requests

    def add_request(self, prompt_ids: list[int], request_id: str | None = None,
                    sampling_params: SamplingParams | ResolvedSampling | None = None, streaming: bool = False,
                    keep_kv: bool = False, continues: str | None = None) -> list[str]:
        """Queue a prompt (n sequences if `sampling_params.n > 1`, ids `{id}#{i}`); returns the sequence ids.

        `sampling_params` may already be resolved (`validate_sampling`), as a caller submitting many requests with
        the same settings does: they are then not resolved again. An invalid prompt or invalid settings do not raise:
        the request fails alone, with the reason in its output. A duplicate id is the caller's bug and raises
        ValueError. `keep_kv`: when a sequence finishes, keep its KV for a continuation until `release_kept` (or
        until the cache needs the blocks). `continues`: a kept sequence whose tokens this prompt extends; only the
        tokens after its KV are prefilled (see rollout.engine.core.kept_kv).
        """
        request_id = request_id if request_id is not None else self.new_request_id()
        n = sampling_params.n if sampling_params is not None else 1
        ids = sequence_ids(request_id, n)  # n < 1 fails under its own id
        self.scheduler.check_ids_free(request_id, ids)
        try:
            sampling = (sampling_params if isinstance(sampling_params, ResolvedSampling)
                        else self.validate_sampling(sampling_params))
            prompt = self.validate_prompt(prompt_ids, prefill_only=sampling.max_new_tokens == 0)
        except ValueError as err:
            self.scheduler.reject(RequestOutput.group_failure(request_id, n, _safe_list(prompt_ids), str(err),
                                                              ErrorKind.INVALID_REQUEST))
            return ids
        if keep_kv:
            self.scheduler.keep_kv(ids)
        self.scheduler.add(SequenceGroup.create(request_id, prompt, sampling, n, streaming), continues=continues)
        return ids

    def release_kept(self, sequence_id: str) -> bool:
        """Free the KV a finished `keep_kv` sequence still holds; False if it holds none (never kept, continued,
        released, or evicted when the cache needed room)."""
        return self.scheduler.release_kept(sequence_id)

    def validate_sampling(self, sampling_params: SamplingParams | None) -> ResolvedSampling:
        """Settings merged over the generation config, as `add_request` would use them; ValueError naming the bad
        field otherwise. Queues nothing, so callers can check a whole batch before submitting any of it."""
        sampling = resolve_sampling(sampling_params, self.generation_config, self.model_eos)
        if sampling.stop_strings and self.tokenizer is None:
            raise InvalidRequestError("stop_strings need a tokenizer: pass tokenizer= to the engine/manager/generator",
                                      "stop_strings")
        if sampling.processors is not None:
            sampling.processors.check_vocab(self.vocab_size)
        if sampling.structured is not None:
            sampling = dataclasses.replace(sampling, constraint=self.grammars(sampling.structured.kind).compile(
                sampling.structured, sampling.stop_ids))
        return sampling

    def grammars(self, param: str = "json_schema") -> GrammarCompiler:
        """The engine's structured-output compiler (built once, for its tokenizer and the model's vocabulary)."""
        if self.tokenizer is None:
            raise InvalidRequestError(f"{param} (a structured output) needs a tokenizer: pass tokenizer= to the "
                                      "engine/manager/generator", param)
        with self._grammars_lock:
            if self._grammars is None:
                try:
                    self._grammars = GrammarCompiler(self.tokenizer, self.vocab_size)
                except ImportError as err:
                    raise InvalidRequestError(str(err), param) from err
            return self._grammars

    def validate_prompt(self, prompt_ids, prefill_only: bool = False) -> list[int]:
        """The prompt as a list of ints, or ValueError saying what is wrong with it (the rule `add_request` applies;
        `prefill_only`: for max_new_tokens=0). Queues nothing, so callers can check a whole batch before submitting
        any of it."""
        return check_prompt(prompt_ids, self.vocab_size, self.max_positions, prefill_only)

    def cancel(self, request_id: str) -> list[RequestOutput]:
        """Cancel a live sequence, or every live sequence of a request id, and free their blocks now ([] if none)."""
        return self.scheduler.cancel(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # --------------------------------------------------------------------- step
    health: EngineHealth = EngineHealth()  # immutable; step() assigns a new one per forward

    def step(self) -> list[RequestOutput]:
        """Schedule -> run -> sample -> update. Returns outputs of requests that finished or failed, and (if
        streaming) of those that got a token."""
        if self.core_budget is None:
            return self._step()
        with self.core_budget.applied():  # cpu_threads: this step's intra-op threads
            return self._step()

    def _step(self) -> list[RequestOutput]:
        plan = self.scheduler.schedule()
        if not plan.requests:
            return self.scheduler.take_outputs()
        self.counters["steps"] += 1
        self.counters["peak_used_blocks"] = max(self.counters["peak_used_blocks"], self.pool.num_used)
        started = time.perf_counter()
        try:  # a failed forward or draw fails this step's requests; the engine keeps serving
            logits = self.runner.run(plan)
            prompt_records: list[prompt_logprobs.PromptLogprobs] = []
            if plan.prompt_rows:
                logits, prompt_records = prompt_logprobs.compute(plan.prompt_rows, plan.requests, logits,
                                                                 len(plan.sample_rows))
            if len(plan.logit_rows) != logits.shape[0] or plan.logit_rows != list(range(len(plan.logit_rows))):
                logits = logits[torch.tensor(plan.logit_rows, dtype=torch.long, device=logits.device)]
            sampled = self.sampler.sample(logits, [SampleRow(m.sampling, m.tokens, m.num_generated, m.grammar)
                                                   for m in plan.sampled])
        except Exception as err:
            logger.exception("the step's forward or sampling failed; failing the %d requests of this step", len(plan))
            self.counters["forward_errors"] += 1
            h = self.health
            self.health = EngineHealth(h.consecutive_failures + 1, repr(err), time.time(), h.last_success_time)
            return self.scheduler.fail_step(plan, repr(err))
        self.health = EngineHealth(0, self.health.last_error, self.health.last_error_time, time.time())
        if self.scheduler.kv.swap is not None:  # what a recompute would cost, for the swap-or-recompute choice
            self.scheduler.kv.swap.costs.observe_forward(sum(plan.query_lens), time.perf_counter() - started)
        return self.scheduler.update(plan, sampled, self.weight_version, prompt_records)

    def fail_all(self, error: str) -> list[RequestOutput]:
        """Fail every live request (hard stop): blocks are released, outputs carry `error`."""
        return self.scheduler.fail_all(error)

    # -------------------------------------------------------------------- stats
    def stats(self) -> EngineStats:
        sched = self.scheduler
        return EngineStats(
            num_blocks=self.pool.num_blocks, page_size=self.cache.page_size, free_blocks=self.pool.num_free,
            cached_blocks=self.pool.num_cached, used_blocks=self.pool.num_used,
            peak_used_blocks=self.counters["peak_used_blocks"], running=len(sched.running),
            waiting=len(sched.waiting), weight_version=self.weight_version, steps=self.counters["steps"],
            forward_errors=self.counters["forward_errors"], preemptions=sched.num_preemptions,
            chunked_prefills=sched.num_chunked_prefills, **sched.counters, **self._swap_stats())

    def _swap_stats(self) -> dict[str, int]:
        swap = self.scheduler.kv.swap
        if swap is None:
            return {}
        return dict(swap_blocks=swap.num_blocks, swap_free_blocks=swap.num_free,
                    swapped=sum(bool(r.host_blocks) for r in self.scheduler.waiting), **swap.counters)

    def reset_peak(self) -> None:
        """Start a new window for `peak_used_blocks` (e.g. one rollout call)."""
        self.counters["peak_used_blocks"] = self.pool.num_used

    def check_invariants(self) -> None:
        """Queues and block pool consistency (used by tests)."""
        self.scheduler.check_invariants()


def release_device_memory(device: torch.device) -> None:
    """Called once the last reference to an engine is dropped: on CUDA its KV cache goes back from torch's caching
    allocator to the driver, so a trainer on the same GPU (or another process) can use it. A compiled forward leaves
    a reference cycle to the cache, collected first; on CPU the next automatic collection frees it."""
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()


def _safe_list(prompt_ids) -> list:
    try:
        return [int(t) for t in prompt_ids]
    except (TypeError, ValueError):
        return []

