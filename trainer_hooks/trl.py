"""TRL GRPO and RLOO on the rollout engine: subclasses that swap TRL's vLLM wrapper for ours.

TRL 1.16 routes generation through one object, `trainer.vllm_generation`, with `sync_weights()` (called lazily once
per global step, before generation) and `generate(prompts, images, num_generations, profiler)`. We install an adapter
with that contract, so everything else in TRL (its sampling settings, the importance-sampling correction, profiling,
metrics, eval, the tool-calling loop) runs unchanged. Weight sync walks TRL's own parameter iteration, so ZeRO-3
gathering, FSDP and PEFT merge/unmerge keep working. This touches TRL internals, hence the pinned version range.
"""

from __future__ import annotations

import logging
import time
from itertools import groupby

import torch
from packaging.version import Version

from rollout.config import ContinuousBatchingConfig
from rollout.rl.generator import RolloutBatch, RolloutGenerator, RolloutSample
from rollout.sampling_params import SamplingParams
from trainer_hooks.metrics import rollout_metrics
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

# vLLM-style generation_kwargs TRL users write, mapped onto SamplingParams fields.
_KWARG_NAMES = {"max_tokens": "max_new_tokens", "min_tokens": "min_new_tokens", "stop": "stop_strings"}
_IGNORED_KWARGS = {"n", "logprobs", "detokenize", "skip_special_tokens", "spaces_between_special_tokens"}
# SamplingParams fields a `rollout serve` process takes in a completion request (it applies the tokenizer's EOS).
_REMOTE_FIELDS = {"temperature", "top_k", "top_p", "min_p", "repetition_penalty", "seed", "max_new_tokens",
                  "min_new_tokens", "stop_token_ids", "stop_strings", "ignore_eos"}


class RolloutTRLGeneration(VLLMGeneration):
    """TRL's generation-wrapper contract, served by a RolloutGenerator.

    It inherits only TRL's parameter iteration (`_iter_named_params`); vLLM is never started.
    """

    def __init__(self, trainer, rollout_config: ContinuousBatchingConfig | None, share_weights: bool,
                 dtype: torch.dtype | None, logprobs: str = "policy",
                 server_url: str | None = None):  # noqa: D107 - no super(): it starts vLLM
        if logprobs not in ("policy", "sampled"):
            raise ValueError(f"rollout_logprobs must be 'policy' or 'sampled', got {logprobs!r}")
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
        self.client = None
        self.generator = None
        if server_url is not None:  # a `rollout serve` process owns the engine; we stream weights and prompts
            from rollout.client import RolloutClient

            if share_weights:
                raise ValueError("share_weights=True needs the engine in this process; drop rollout_server")
            self.client = RolloutClient(server_url)
        else:
            base = unwrap(trainer.model)
            if hasattr(base, "get_base_model") and not share_weights:
                base = base.get_base_model()  # PEFT: generate from the base architecture, sync merged weights
            config = rollout_config or ContinuousBatchingConfig()
            self.generator = RolloutGenerator(base, tokenizer=getattr(trainer, "_tokenizer", None),
                                              continuous_batching_config=config, share_weights=share_weights,
                                              dtype=dtype, seed=trainer.args.seed + trainer.accelerator.process_index)
        self.sampling_params = self._sampling_params(trainer)
        self.last_sync_seconds: float | None = None
        self.last_batch: RolloutBatch | None = None

    @staticmethod
    def _sampling_params(trainer) -> SamplingParams:
        params = SamplingParams(
            temperature=trainer.temperature, top_p=trainer.top_p if trainer.top_p is not None else 1.0,
            top_k=trainer.top_k or 0, min_p=trainer.min_p or 0.0,
            repetition_penalty=trainer.repetition_penalty or 1.0, max_new_tokens=trainer.max_completion_length,
            eos_token_id=list(trainer.eos_token_ids), do_sample=True)
        extra = {}
        for key, value in (trainer.args.generation_kwargs or {}).items():
            if key in _IGNORED_KWARGS:
                continue
            name = _KWARG_NAMES.get(key, key)
            if name not in SamplingParams.__dataclass_fields__:
                raise ValueError(f"generation_kwargs[{key!r}] is not supported by the rollout engine; supported: "
                                 f"{sorted(set(SamplingParams.__dataclass_fields__) | set(_KWARG_NAMES))}")
            extra[name] = value
        return params.with_overrides(**extra)

    # ---------------------------------------------------------------- contract
    def sync_weights(self) -> None:
        start = time.perf_counter()
        if self.client is not None:
            # Gathering is collective: every process walks the parameters, the main one streams them.
            if self.accelerator.is_main_process:
                self.client.update_weights_from_model(self._iter_named_params())
            else:
                for _ in self._iter_named_params():
                    pass
        elif self.share_weights:
            self.generator.update_weights(self.generator.model)
        else:
            self.generator.update_weights(self._iter_named_params())
        self.last_sync_seconds = time.perf_counter() - start

    def generate(self, prompts, images, num_generations, profiler=None):
        if images is not None and any(img is not None for img in images):
            raise NotImplementedError("rollout's TRL hook does not support image inputs yet")
        # TRL repeats each prompt for its group; generate each run of identical prompts as one n-sample group.
        runs = [(list(key), len(list(group))) for key, group in groupby(map(tuple, prompts))]
        with profiler if profiler is not None else _null():
            batch = self._generate_runs(runs)
        self.last_batch = batch
        self._record_metrics(batch)
        completion_ids = [s.completion_ids for s in batch.samples]
        chosen = "policy_logprobs" if self.logprobs_kind == "policy" else "logprobs"
        logprobs = [[[lp] for lp in getattr(s, chosen)] for s in batch.samples]
        token_ids = [[[t] for t in s.completion_ids] for s in batch.samples]
        return [s.prompt_ids for s in batch.samples], completion_ids, logprobs, token_ids

    def _generate_runs(self, runs: list[tuple[list[int], int]]) -> RolloutBatch:
        if self.client is None:
            return self.generator.generate([p for p, _ in runs], n=[k for _, k in runs],
                                           sampling_params=self.sampling_params)
        start = time.perf_counter()
        fields = {k: v for k, v in vars(self.sampling_params).items()
                  if v is not None and k in _REMOTE_FIELDS}
        samples = []
        for size in sorted({k for _, k in runs}):  # one request per group size (usually just one)
            prompts = [p for p, k in runs if k == size]
            samples += [(prompts[s["prompt_index"]], s) for s in self.client.generate(prompts, n=size, **fields)]
        order = {tuple(p): i for i, (p, _) in enumerate(runs)}
        samples.sort(key=lambda item: order[tuple(item[0])])
        batch = RolloutBatch([RolloutSample(**{**s, "prompt_index": order[tuple(p)]}) for p, s in samples],
                             group_sizes=[k for _, k in runs])
        seconds = time.perf_counter() - start
        generated = sum(len(s.completion_ids) for s in batch.samples)
        batch.stats = {"seconds": seconds, "generated_tokens": generated, "tokens_per_second": generated / seconds,
                       "weight_version": max((v for s in batch.samples for v in s.weight_versions), default=0)}
        return batch

    def _record_metrics(self, batch: RolloutBatch) -> None:
        mode = "train" if self.trainer.model.training else "eval"
        for key, value in rollout_metrics(batch, sync_seconds=self.last_sync_seconds).items():
            self.trainer._metrics[mode][key].append(value)


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _RolloutMixin:
    """Shared constructor: build the trainer as TRL would without vLLM, then install our generation adapter.

    Extra arguments: `rollout_config` (ContinuousBatchingConfig), `share_weights` (generate from the trained module
    itself, zero copy), `rollout_dtype` (dtype of the private generation copy), `rollout_logprobs` ("policy": feed
    TRL's importance-sampling correction the full-vocabulary logprobs it recomputes, or "sampled"), `rollout_server`
    (URL of a `rollout serve` process: generate there and stream weights to it instead of running an engine here).
    """

    def __init__(self, *args, rollout_config: ContinuousBatchingConfig | None = None, share_weights: bool = False,
                 rollout_dtype: torch.dtype | None = None, rollout_logprobs: str = "policy",
                 rollout_server: str | None = None, **kwargs):
        config = kwargs.get("args")
        if config is not None and getattr(config, "use_vllm", False):
            raise ValueError("RolloutGRPOTrainer/RolloutRLOOTrainer generate with rollout's engine: set use_vllm=False "
                             "(the default) in the config")
        if config is not None and getattr(config, "use_transformers_continuous_batching", False):
            raise ValueError("use_transformers_continuous_batching conflicts with rollout's engine; leave it False")
        super().__init__(*args, **kwargs)
        self.vllm_generation = RolloutTRLGeneration(self, rollout_config, share_weights, rollout_dtype,
                                                    rollout_logprobs, rollout_server)
        self.use_vllm = True
        self.vllm_mode = "rollout"  # neither "server" nor "colocate": TRL's vLLM-specific branches stay off
        self._last_loaded_step = -1
        self.rollout_generator = self.vllm_generation.generator


class RolloutGRPOTrainer(_RolloutMixin, GRPOTrainer):
    """TRL's GRPOTrainer with rollout's engine as generation backend (extra arguments: see `_RolloutMixin`)."""


class RolloutRLOOTrainer(_RolloutMixin, RLOOTrainer):
    """TRL's RLOOTrainer with rollout's engine as generation backend (extra arguments: see `_RolloutMixin`)."""
