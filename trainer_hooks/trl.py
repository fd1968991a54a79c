"""TRL GRPO and RLOO on the rollout engine: subclasses that swap TRL's vLLM wrapper for ours.

TRL 1.16 routes generation through one object, `trainer.vllm_generation`, with `sync_weights()` (called lazily once
per global step, before generation) and `generate(prompts, images, num_generations, profiler)`. We install an adapter
with that contract, so everything else in TRL (its sampling settings, the importance-sampling correction, profiling,
metrics, eval, the tool-calling loop) runs unchanged. Weight sync walks TRL's own parameter iteration, so ZeRO-3
gathering, FSDP and PEFT merge/unmerge keep working. This touches TRL internals, hence the pinned version range.

Sampling settings come from TRL's arguments plus `generation_kwargs`, under vLLM's names (rollout.openai_params):
`max_tokens`, `stop`, `seed`, `logit_bias`, `allowed_token_ids`, `bad_words_ids`, `logits_processors`, and
structured outputs as `{"structured_outputs": {"regex" | "json" | "choice" | "grammar" | "json_object": ...}}` or flat
as `structured_outputs_regex` (`_json`, `_choice`, `_grammar`); TRL's `vllm_structured_outputs_regex` takes
precedence, as in TRL. Structured outputs need the tokenizer the trainer passes and `pip install "rollout[structured]"`.
Processors leave `policy_logprobs` (what TRL's old-logprob pass recomputes) the raw policy's.

In vLLM mode TRL recomputes `old_per_token_logps` with a forward pass over the whole generation batch, for its
importance-sampling correction. When the engine computed exactly that (see `_RolloutMixin`), the trainer hands TRL the
engine's per-token policy logprobs instead: `_get_per_token_logps_and_entropies` answers that one call from them, and
TRL computes its correction from them as usual (the ratio is then exactly 1). The same override scores the loss's
forward on rows of similar length with their shared padding cut off, so varied completion lengths stop costing the
padded batch's compute.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Sequence
from itertools import groupby

import torch
from packaging.version import Version

from rollout.config import ContinuousBatchingConfig
from rollout.distributed.server_pool import RolloutServerPool
from rollout.openai_params import STRUCTURED_KWARGS, sampling_overrides
from rollout.rl.backend import RolloutBackend
from rollout.rl.batch import RolloutBatch
from rollout.rl.generator import RolloutGenerator
from rollout.sampling_params import SamplingParams
from trainer_hooks.conversation_kv import ConversationKV
from trainer_hooks.metrics import rollout_metrics
from trainer_hooks.old_logprobs import PendingOldLogps, inexact_reason
from trainer_hooks.padding import unpadded_logps
from trainer_hooks.sync import unwrap

logger = logging.getLogger(__name__)

SUPPORTED_TRL = (Version("1.16.0"), Version("1.17.0"))


def _require_trl():
    try:
        import trl
    except ImportError as err:
        raise ImportError("trainer_hooks.trl needs TRL: pip install 'rollout[trl]'") from err
    version = Version(trl.__version__)
    if not SUPPORTED_TRL[0] <= version < SUPPORTED_TRL[1]:
        raise ImportError(f"rollout's TRL hook supports trl>={SUPPORTED_TRL[0]},<{SUPPORTED_TRL[1]} (it replaces TRL's "
                          f"generation wrapper, whose internals change between releases); found trl {version}. "
                          f"Install a supported TRL: pip install 'trl>={SUPPORTED_TRL[0]},<{SUPPORTED_TRL[1]}'")
    return trl


_trl = _require_trl()
from trl import GRPOTrainer, RLOOTrainer  # noqa: E402
from trl.generation.vllm_generation import VLLMGeneration  # noqa: E402

# Where TRL's old_per_token_logps come from: see _RolloutMixin.
OLD_LOGPROB_MODES = ("auto", "engine", "recompute")


class RolloutTRLGeneration(VLLMGeneration):
    """TRL's generation-wrapper contract, served by a RolloutGenerator, a RolloutPool, or `rollout serve` servers.

    It inherits only TRL's parameter iteration (`_iter_named_params`); vLLM is never started.
    """

    def __init__(self, trainer, rollout_config: ContinuousBatchingConfig | None, share_weights: bool,
                 dtype: torch.dtype | None, logprobs: str = "policy",
                 server_url: str | Sequence[str] | None = None, old_logprobs: str = "auto",
                 pool=None):  # no super(): it starts vLLM
        if logprobs not in ("policy", "sampled"):
            raise ValueError(f"rollout_logprobs must be 'policy' or 'sampled', got {logprobs!r}")
        if old_logprobs not in OLD_LOGPROB_MODES:
            raise ValueError(f"rollout_old_logprobs must be one of {OLD_LOGPROB_MODES}, got {old_logprobs!r}")
        self.trainer = trainer
        self.model = trainer.model
        self.accelerator = trainer.accelerator
        self._dist = trainer._dist
        self.processing_class = trainer.processing_class
        self.mode = "rollout"
        self.logprobs_kind = logprobs
        if share_weights and (self._dist.is_zero3 or self._dist.is_fsdp):
            raise ValueError("share_weights=True needs the full module on this process; with ZeRO-3 or FSDP the "
                             "weights are sharded. Use share_weights=False (the default).")
        if getattr(trainer, "_is_vlm", False):
            raise NotImplementedError("rollout's TRL hook does not support vision-language models yet")
        self.share_weights = share_weights
        self.backend: RolloutBackend = self._backend(trainer, rollout_config, share_weights, dtype, server_url, pool)
        self.sampling_params = self._sampling_params(trainer)
        try:
            self.backend.check_sampling(self.sampling_params)
        except ValueError as err:
            raise ValueError(f"the trainer's sampling settings (its arguments and generation_kwargs): {err}") from None
        self.last_sync_seconds: float | None = None
        self.last_batch: RolloutBatch | None = None
        self.old_logprobs_mode = old_logprobs
        self.old_logprobs_static_reason = self._inexact_reason(trainer)
        self._synced_step: int | None = None  # trainer.state.global_step at our last sync
        self._synced_version: int | None = None  # engine weight version right after it
        self._pending_old: PendingOldLogps | None = None
        self._last_decision: tuple[bool, str] | None = None
        # TRL's tool loop continues the conversations it just generated: keep their KV (an engine in this process)
        self.conversations = (ConversationKV(self.backend) if getattr(trainer, "tools", None)
                              and self.backend.keeps_kv else None)

    @staticmethod
    def _backend(trainer, rollout_config, share_weights: bool, dtype, server_url, pool) -> RolloutBackend:
        """The one backend this adapter generates with: servers, a Ray pool, or an engine in this process."""
        if server_url is not None and pool is not None:
            raise ValueError("pass rollout_server or rollout_pool, not both")
        if share_weights and (server_url is not None or pool is not None):
            raise ValueError("share_weights=True needs the engine in this process; drop rollout_server/rollout_pool")
        seed = trainer.args.seed + trainer.accelerator.process_index
        if server_url is not None:  # `rollout serve` processes own the engines; we stream weights and prompts
            return RolloutServerPool(server_url, seed=seed)
        if pool is not None:  # a RolloutPool of this process: it generates and takes weights like a generator
            if rollout_config is not None or dtype is not None:
                raise ValueError("rollout_config and rollout_dtype configure an engine in this process; give them to "
                                 "the RolloutPool when you build it")
            return pool
        base = unwrap(trainer.model)
        if hasattr(base, "get_base_model") and not share_weights:
            base = base.get_base_model()  # PEFT: generate from the base architecture, sync merged weights
        return RolloutGenerator(base, tokenizer=getattr(trainer, "_tokenizer", None),
                                continuous_batching_config=rollout_config or ContinuousBatchingConfig(),
                                share_weights=share_weights, dtype=dtype, seed=seed)

    @staticmethod
    def _sampling_params(trainer) -> SamplingParams:
        params = SamplingParams(
            temperature=trainer.temperature, top_p=trainer.top_p if trainer.top_p is not None else 1.0,
            top_k=trainer.top_k or 0, min_p=trainer.min_p or 0.0,
            repetition_penalty=trainer.repetition_penalty or 1.0, max_new_tokens=trainer.max_completion_length,
            eos_token_id=list(trainer.eos_token_ids), do_sample=True)
        # vLLM-style generation_kwargs (max_tokens, stop, logit_bias, structured_outputs, ...) through the one
        # OpenAI/vLLM name mapping
        kwargs = dict(trainer.args.generation_kwargs or {})
        regex = getattr(trainer.args, "vllm_structured_outputs_regex", None)
        if regex is not None:  # TRL's own option; it takes precedence over generation_kwargs, as in TRL
            if any(k == "structured_outputs" or k in STRUCTURED_KWARGS for k in kwargs):
                logger.warning("Both vllm_structured_outputs_regex and a structured output in generation_kwargs are "
                               "set; vllm_structured_outputs_regex takes precedence.")
            kwargs = {k: v for k, v in kwargs.items() if k != "structured_outputs" and k not in STRUCTURED_KWARGS}
            kwargs["structured_outputs_regex"] = regex
        return params.with_overrides(**sampling_overrides(kwargs))

    # ---------------------------------------------------------------- contract
    def sync_weights(self) -> None:
        start = time.perf_counter()
        if self.conversations is not None:
            self.conversations.release()  # a new step: no prompt continues the last step's conversations
        if self.share_weights:  # the engine generates from the trained module itself: nothing to copy
            self.backend.update_weights(self.backend.model)
        elif self.backend.shared_by_processes and not self.accelerator.is_main_process:
            for _ in self._iter_named_params():  # gathering is collective: every process walks the parameters
                pass
        else:
            self._push(self._iter_named_params())
        self.last_sync_seconds = time.perf_counter() - start
        self._synced_step = self.trainer.state.global_step
        self._synced_version = self.backend.weight_version

    def _push(self, source) -> None:
        """Where the trainer's weights go (the async adapter sends them through its producer)."""
        self.backend.update_weights(source)

    def generate(self, prompts, images, num_generations, profiler=None):
        if images is not None and any(img is not None for img in images):
            raise NotImplementedError("rollout's TRL hook does not support image inputs yet")
        self._pending_old = None
        with profiler if profiler is not None else contextlib.nullcontext():
            batch = self._rollouts(prompts)
        self.last_batch = batch
        self._record_metrics(batch)
        if self.trainer._computes_old_logprobs():
            use_engine, why = self._old_logprobs_decision(batch)
            self._pending_old = PendingOldLogps(batch.samples, use_engine, why)
        completion_ids = [s.completion_ids for s in batch.samples]
        chosen = "policy_logprobs" if self.logprobs_kind == "policy" else "logprobs"
        logprobs = [[[lp] for lp in getattr(s, chosen)] for s in batch.samples]
        token_ids = [[[t] for t in s.completion_ids] for s in batch.samples]
        return [s.prompt_ids for s in batch.samples], completion_ids, logprobs, token_ids

    def _rollouts(self, prompts) -> RolloutBatch:
        """The samples for TRL's prompts. TRL repeats each prompt for its group: each run of identical prompts is
        generated as one n-sample group."""
        runs = [(list(key), len(list(group))) for key, group in groupby(map(tuple, prompts))]
        return self._generate_runs(runs)

    def _generate_runs(self, runs: list[tuple[list[int], int]]) -> RolloutBatch:
        prompts, sizes = [p for p, _ in runs], [k for _, k in runs]
        if self.conversations is None:
            return self.backend.generate(prompts, n=sizes, sampling_params=self.sampling_params)
        batch = self.backend.generate(prompts, n=sizes, sampling_params=self.sampling_params, keep_kv=True,
                                      continues=self.conversations.continues(prompts))
        self.conversations.remember(batch)
        return batch

    def _record_metrics(self, batch: RolloutBatch) -> None:
        mode = "train" if self.trainer.model.training else "eval"
        for key, value in rollout_metrics(batch, sync_seconds=self.last_sync_seconds).items():
            self.trainer._metrics[mode][key].append(value)

    # ------------------------------------------------------------ old logprobs
    def _inexact_reason(self, trainer) -> str | None:
        """Why the engine's policy logprobs cannot stand in for TRL's recompute in this setup (None: they can)."""
        return inexact_reason(trainer, self.sampling_params, self.backend.dtype)

    def _old_logprobs_decision(self, batch: RolloutBatch) -> tuple[bool, str]:
        """Whether TRL gets the engine's logprobs as old_per_token_logps for this batch, and why (logged on change)."""
        if self.old_logprobs_mode == "recompute":
            decision = (False, "rollout_old_logprobs='recompute'")
        elif self.old_logprobs_mode == "engine":
            decision = (True, "rollout_old_logprobs='engine'")
        else:
            reason = self.old_logprobs_static_reason
            if reason is None and self._synced_step != self.trainer.state.global_step:
                reason = "the engine's weights were not synced at this step"
            if reason is None and any(v != self._synced_version for s in batch.samples for v in s.weight_versions):
                reason = "some tokens were generated under other weights than the last sync"
            decision = (reason is None, "rollout_old_logprobs='auto', the engine is exact for the trainer"
                        if reason is None else f"rollout_old_logprobs='auto': {reason}")
        if decision != self._last_decision:
            logger.info("old_per_token_logps: %s (%s)", "the engine's policy logprobs, TRL's recompute skipped"
                        if decision[0] else "recomputed by TRL", decision[1])
            self._last_decision = decision
        return decision

    def take_old_logprobs(self) -> PendingOldLogps | None:
        """The batch waiting for TRL's old-logprob pass (once: the next call gets None)."""
        pending, self._pending_old = self._pending_old, None
        return pending


class _RolloutMixin:
    """Shared constructor: build the trainer as TRL would without vLLM, then install our generation adapter.

    Extra arguments: `rollout_config` (ContinuousBatchingConfig), `share_weights` (generate from the trained module
    itself, zero copy), `rollout_dtype` (dtype of the private generation copy), `rollout_logprobs` ("policy": feed
    TRL's importance-sampling correction the full-vocabulary logprobs it recomputes, or "sampled"), `rollout_server`
    (URL of a `rollout serve` process, or a list of URLs: generate there and stream weights to them instead of
    running an engine here; several servers share the groups and take each update together, see
    rollout.distributed.RolloutServerPool), `rollout_pool` (a rollout.distributed.RolloutPool of Ray workers, built by
    this process: it generates and takes the weight syncs), `rollout_old_logprobs` (below).

    `rollout_old_logprobs` says where `old_per_token_logps` come from. TRL recomputes them with a forward pass over
    the generation batch right after generating (GRPO in vLLM mode, for its importance-sampling correction; RLOO
    always), which costs about a third of a CPU step. The engine already computed them as its per-token policy
    logprobs (fp32 log-softmax of the logits over the full vocabulary, at TRL's temperature).
      "auto" (default): use the engine's when it is exact for the trainer: same weights (synced at this step, no
        update landed mid-generation), same precision, fp32 or fp64 (half-precision kernels round differently),
        no autocast, no dropout, repetition_penalty == 1, num_iterations == 1 and steps_per_generation <=
        gradient_accumulation_steps, no tools or custom rollout_func, an engine in this process. Otherwise TRL
        recomputes them, as it does with vLLM.
      "engine": always use the engine's (a bf16 engine for an fp32 trainer, say: the correction is then 1).
      "recompute": always let TRL recompute them.
    Either way TRL computes its importance-sampling ratio from the old logprobs it got (with the engine's: exactly
    1 when rollout_logprobs="policy"). The path taken is logged (INFO) at the first step and whenever it changes,
    and every step records `rollout/old_logprobs_from_engine` (1.0 or 0.0).

    `rollout_trim_padding` (None: on in a single process): TRL scores completions with one forward over the batch
    padded to the longest prompt plus the longest completion, so with varied lengths much of the loss's forward
    and backward runs on padding. Trimmed, rows of similar length are scored together with the padding columns
    they all share cut off (same absolute positions, same masks), so every real token gets the same logprob as in
    TRL's forward up to float rounding. Off for multimodal inputs, MoE aux losses and several processes (each
    chunk is a separate forward, which DDP/ZeRO-3/FSDP would have to gather or reduce for).
    """

    generation_class = RolloutTRLGeneration  # the adapter installed as trainer.vllm_generation

    def __init__(self, *args, rollout_config: ContinuousBatchingConfig | None = None, share_weights: bool = False,
                 rollout_dtype: torch.dtype | None = None, rollout_logprobs: str = "policy",
                 rollout_server: str | Sequence[str] | None = None, rollout_old_logprobs: str = "auto",
                 rollout_trim_padding: bool | None = None, rollout_pool=None, **kwargs):
        config = kwargs.get("args")
        if config is not None and getattr(config, "use_vllm", False):
            raise ValueError("RolloutGRPOTrainer/RolloutRLOOTrainer generate with rollout's engine: set use_vllm=False "
                             "(the default) in the config")
        if config is not None and getattr(config, "use_transformers_continuous_batching", False):
            raise ValueError("use_transformers_continuous_batching conflicts with rollout's engine; leave it False")
        if rollout_old_logprobs not in OLD_LOGPROB_MODES:
            raise ValueError(f"rollout_old_logprobs must be one of {OLD_LOGPROB_MODES}, got {rollout_old_logprobs!r}")
        super().__init__(*args, **kwargs)
        self.vllm_generation = self.generation_class(self, rollout_config, share_weights, rollout_dtype,
                                                    rollout_logprobs, rollout_server, rollout_old_logprobs,
                                                    rollout_pool)
        self.use_vllm = True
        self.vllm_mode = "rollout"  # neither "server" nor "colocate": TRL's vLLM-specific branches stay off
        self._last_loaded_step = -1
        self.rollout_backend = self.vllm_generation.backend  # whatever generates: RolloutBackend
        # the backend this process owns (its generator or Ray pool); None when servers generate for every process
        self.rollout_generator = None if self.rollout_backend.shared_by_processes else self.rollout_backend
        self.rollout_trim_padding = (self.accelerator.num_processes == 1 if rollout_trim_padding is None
                                     else bool(rollout_trim_padding))

    def _computes_old_logprobs(self) -> bool:
        """Whether TRL runs its old-logprob pass after generating (RLOO: always)."""
        return True

    def _generate_and_score_completions(self, inputs):
        try:
            return super()._generate_and_score_completions(inputs)
        finally:  # a batch TRL did not ask about must never answer a later call
            self.vllm_generation.take_old_logprobs()

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False, **extra):
        """TRL's per-token logprobs (and entropies), padding trimmed when allowed; TRL's old-logprob pass right after
        generation may be answered from the engine instead.

        That pass is the first gradient-free call on the trained model after `generate` (the reference model's comes
        later); the engine's values are used only if TRL's batch holds exactly the engine's completions.
        """
        pending = None
        if model is self.model and not torch.is_grad_enabled():
            pending = self.vllm_generation.take_old_logprobs()
        if pending is not None:
            logps = None
            if pending.use_engine and not compute_entropy and not compute_aux_loss:
                logps = pending.as_old_logps(input_ids, attention_mask, logits_to_keep)
                if logps is None:
                    logger.warning("old_per_token_logps: TRL's batch does not hold the engine's completions as "
                                   "generated (%s); recomputing them. Set rollout_old_logprobs='recompute' if this "
                                   "setup changes completions after generation.", pending.reason)
            mode = "train" if self.model.training else "eval"
            self._metrics[mode]["rollout/old_logprobs_from_engine"].append(float(logps is not None))
            if logps is not None:
                return logps, None, None
        if self.rollout_trim_padding and not compute_aux_loss and all(v is None for v in extra.values()):
            out = unpadded_logps(self, model, input_ids, attention_mask, logits_to_keep, batch_size,
                                  compute_entropy)
            if out is not None:
                return out
        return super()._get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep,
                                                          batch_size, compute_entropy, compute_aux_loss, **extra)


class RolloutGRPOTrainer(_RolloutMixin, GRPOTrainer):
    """TRL's GRPOTrainer with rollout's engine as generation backend (extra arguments: see `_RolloutMixin`)."""

    def _computes_old_logprobs(self) -> bool:
        """TRL's own rule (grpo_trainer.py, `_generate_and_score_completions`): misaligned reuse, or vLLM mode's
        importance-sampling correction."""
        generate_every = self.args.steps_per_generation * self.num_iterations
        return (self.args.gradient_accumulation_steps % generate_every != 0
                or bool(self.vllm_importance_sampling_correction))


class RolloutRLOOTrainer(_RolloutMixin, RLOOTrainer):
    """TRL's RLOOTrainer with rollout's engine as generation backend (extra arguments: see `_RolloutMixin`)."""
