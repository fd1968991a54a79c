"""RolloutGenerator: GRPO-style groups of samples with the logprob contract and versioned, in-place weight updates.

It wraps a ContinuousBatchingManager. The n samples of a prompt are one engine group: the prompt is prefilled once,
its full KV blocks are shared and the partial last block copied, and each sample draws with its own seed derived from
a base seed, so a batch is reproducible and independent of what else runs.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import random
import threading
import time
import weakref
from collections.abc import Sequence

import torch
from torch import nn
from transformers import GenerationConfig, PreTrainedModel

from rollout.config import ContinuousBatchingConfig
from rollout.engine.core.request import RequestStatus
from rollout.engine.core.sequence_group import sequence_ids
from rollout.engine.sample.resolve import ResolvedSampling
from rollout.engine.tensor_parallel import tp_size
from rollout.manager import ContinuousBatchingManager
from rollout.rl import scoring
from rollout.rl.agents.env_calls import EnvCalls
from rollout.rl.agents.episode import EpisodeBatch
from rollout.rl.agents.runner import EpisodeRunner, check_episode_settings
from rollout.rl.batch import Prompt, RolloutBatch, RolloutSample, group_sizes
from rollout.rl.calls import MAX_LISTED_PROBLEMS, EngineCalls, check_every
from rollout.rl.scoring import ScoreBatch
from rollout.rl.weights import StagedPairs, WeightUpdateError, check_on_update, stage_update
from rollout.sampling_params import SamplingParams
from rollout.seeding import SeedStream, derive_seed

logger = logging.getLogger(__name__)



def generation_copy(model: nn.Module, dtype: torch.dtype | None = None) -> nn.Module:
    """A private copy of the trainer's model for generation.

    TRL patches `forward` onto the model *instance*, and that patched forward keeps calling the trainer's module;
    dropping the copied instance attribute makes the copy run its own weights.
    """
    if tp_size(model) > 1:
        raise ValueError(f"the model is sharded over {tp_size(model)} tensor-parallel ranks and its DTensors cannot be "
                         "copied: pass share_weights=True to generate from it (update_weights still copies each "
                         "rank's shard of new weights into it)")
    gen = copy.deepcopy(model)
    if "forward" in vars(gen):
        del gen.forward
    if dtype is not None:
        gen.to(dtype)
    gen.eval()
    gen.requires_grad_(False)
    return gen


class RolloutGenerator:
    """Generates groups of completions for RL and keeps its weights in sync with a trainer.

    share_weights=True generates from `model` itself (zero copy; train it freely between calls: its attention
    implementation and train/eval mode are left as they were). Otherwise a private copy is kept, optionally in
    another dtype, and refreshed with `update_weights`. `tokens_hint`: the KV tokens the workload holds at once
    (prompts in flight x group size x (longest prompt + max_new_tokens)), to size the cache for it rather than by
    the device's default budget (see ContinuousBatchingConfig for both).
    """

    def __init__(self, model: PreTrainedModel, tokenizer=None,
                 continuous_batching_config: ContinuousBatchingConfig | None = None, share_weights: bool = False,
                 dtype: torch.dtype | None = None, generation_config: GenerationConfig | None = None,
                 seed: int | None = None, tokens_hint: int | None = None) -> None:
        if share_weights and dtype is not None and dtype != next(model.parameters()).dtype:
            raise ValueError("share_weights=True generates from the trainer's own tensors; a different dtype needs a "
                             "copy: pass share_weights=False")
        self.share_weights = share_weights
        self.model = model if share_weights else generation_copy(model, dtype)
        config = dataclasses.replace(continuous_batching_config or ContinuousBatchingConfig(), return_logprobs=True)
        gen_config = generation_config or getattr(model, "generation_config", None)
        self.manager = ContinuousBatchingManager(self.model, gen_config, config, tokenizer=tokenizer,
                                                 tokens_hint=tokens_hint)
        self.calls = EngineCalls(self.manager, tokenizer)  # what generate, run_episodes and score share
        self._rng = random.Random(seed if seed is not None else config.seed)
        self.last_update_seconds = 0.0
        self._waited_for: set[str] = set()  # sequences `generate` calls (in any thread) are still waiting for
        self._waited_lock = threading.Lock()
        # A generator dropped (or still open at interpreter exit) without close(): hard-stop its loop so the thread
        # ends and the manager, KV cache included, can be freed. Holds the manager, never the generator.
        self._finalizer = weakref.finalize(self, _hard_stop, self.manager)

    # ------------------------------------------------------------------ status
    @property
    def tokenizer(self):
        return self.calls.tokenizer

    @tokenizer.setter
    def tokenizer(self, tokenizer) -> None:
        self.calls.tokenizer = tokenizer

    @property
    def weight_version(self) -> int:
        return self.manager.engine.weight_version

    # What a trainer reads of any backend (rollout.rl.backend.RolloutBackend).
    shared_by_processes = False  # each data-parallel process runs its own generator
    keeps_kv = True  # generate(keep_kv=True, continues=...) carries conversations' KV across calls

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the weights it generates with."""
        return next(p.dtype for p in self.model.parameters() if p.is_floating_point())

    def check_sampling(self, params: SamplingParams) -> None:
        """ValueError if the engine would refuse these settings (nothing is submitted)."""
        self.calls.check_sampling(params, "sampling_params")

    def stats(self) -> dict:
        return self.manager.stats()

    def close(self) -> None:
        """Finish in-flight requests, stop the loop and free the KV cache."""
        self._finalizer.detach()
        self.manager.destroy()

    def __enter__(self) -> RolloutGenerator:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -------------------------------------------------------------- generation
    def encode(self, prompt: Prompt) -> list[int]:
        """Token ids for a prompt given as ids, text, or chat messages (chat template + generation prompt).

        Raises ValueError if the prompt cannot be served (empty, ids outside the vocabulary, too long for the model).
        """
        return self.calls.prompt_ids(prompt)

    def _prepare(self, prompts: Sequence[Prompt], n: int | Sequence[int],
                 params: SamplingParams) -> tuple[list[tuple[int, list[int], int]], ResolvedSampling]:
        """Encode and check every prompt before any is submitted: (index, ids, group size) per prompt, and the
        settings resolved once for the whole call.

        Uses the engine's own rules (the ones `add_request` applies), so a batch that passes here is not failed at
        submission. Raises ValueError listing every bad prompt by index; nothing has been queued then.
        """
        if isinstance(prompts, (str, bytes, dict)) or not hasattr(prompts, "__len__"):
            raise ValueError(f"prompts must be a list of prompts (for one prompt, pass [prompt]), got "
                             f"{type(prompts).__name__}")
        try:
            sizes = group_sizes(n, len(prompts))
        except ValueError as err:
            raise ValueError(f"{err}; nothing was submitted") from None
        resolved = self.calls.check_sampling(params, "sampling_params")
        ids = check_every(prompts, self.calls.prompt_ids, "prompt", "prompts cannot be served",
                          " (fix or drop them and call again)")
        return [(j, prompt_ids, sizes[j]) for j, prompt_ids in enumerate(ids)], resolved

    def submit(self, prompts: Sequence[Prompt], n: int | Sequence[int] = 1,
               sampling_params: SamplingParams | None = None, keep_kv: bool = False,
               continues: Sequence[str | None] | None = None) -> list[tuple[int, list[int], list[str]]]:
        """Queue the prompts as n-sample groups; returns (prompt index, prompt ids, sequence ids) per prompt.

        `n` is one group size for all prompts or one per prompt. All prompts are checked first: if any is bad,
        ValueError names it and none is queued. Collect the results with `manager.get_result(sequence_id)`.
        `keep_kv`: finished sequences keep their KV until `release_kv`; `continues[j]`: the kept sequence whose
        tokens prompt j extends, so only its new tokens are prefilled (None: a fresh prompt).
        """
        params = sampling_params or SamplingParams()
        if continues is not None and len(continues) != len(prompts):
            raise ValueError(f"continues has {len(continues)} entries for {len(prompts)} prompts; pass one sequence "
                             "id (or None) per prompt. Nothing was submitted")
        prepared, resolved = self._prepare(prompts, n, params)
        base = params.seed if params.seed is not None else self._rng.getrandbits(62)
        call = self.calls.begin("rollout")
        groups = []
        try:
            for j, ids, size in prepared:
                seed = derive_seed(base, j, SeedStream.PROMPT)
                rid = f"{call}-{j}"
                # resolved once for the call: each group differs only in its size and seed
                self.calls.submit(ids, rid, dataclasses.replace(resolved, n=size, seed=seed), keep_kv=keep_kv,
                                  continues=continues[j] if continues else None)
                groups.append((j, ids, sequence_ids(rid, size)))
        except BaseException:
            self.calls.abandon([rid for _, _, seq_ids in groups for rid in seq_ids])
            raise
        return groups

    def cancel_inflight(self) -> int:
        """Cancel every sequence that a `generate` call, in any thread, still waits for, freeing its KV now; those
        calls raise ValueError. Returns how many were cancelled (what a rollout producer's `close` calls)."""
        with self._waited_lock:
            waited = list(self._waited_for)
        return sum(self.manager.cancel_request(rid) for rid in waited)

    def release_kv(self, sequence_ids_: Sequence[str]) -> int:
        """Free the KV that `keep_kv` sequences still hold; returns how many held some."""
        return sum(self.manager.release_kv(rid) for rid in sequence_ids_)

    def generate(self, prompts: Sequence[Prompt], n: int | Sequence[int] = 1,
                 sampling_params: SamplingParams | None = None, keep_kv: bool = False,
                 continues: Sequence[str | None] | None = None) -> RolloutBatch:
        """n completions per prompt (or n[j] for prompt j), prompt-major.

        Raises ValueError before submitting anything if a prompt or setting is bad, and ValueError after the batch
        if a sample failed while running (e.g. it outgrew the KV cache). If the call is interrupted, what it
        submitted is cancelled. `keep_kv` and `continues` carry conversations' KV across calls (see `submit`).
        """
        window = self.calls.window_start()
        samples, errors = [], []
        # This thread waits for the results anyway, so it steps the engine itself (see stepping_in_caller).
        with self.manager.stepping_in_caller():
            groups = self.submit(prompts, n, sampling_params, keep_kv, continues)
            order = [(j, ids, rid) for j, ids, seq_ids in groups for rid in seq_ids]
            collected = 0
            with self._waited_lock:
                self._waited_for.update(rid for _, _, rid in order)
            try:
                for j, ids, rid in order:
                    out = self.manager.get_result(rid)
                    collected += 1
                    if out.status == RequestStatus.FAILED:
                        errors.append(f"prompt {j}: {out.error}")
                    elif out.status == RequestStatus.CANCELLED:
                        errors.append(f"prompt {j}: cancelled (cancel_inflight)")
                    samples.append(RolloutSample(
                        prompt_index=j, prompt_ids=ids, completion_ids=out.generated_tokens, logprobs=out.logprobs,
                        policy_logprobs=out.policy_logprobs, kept_logmass=out.kept_logmass,
                        weight_versions=out.weight_versions, finish_reason=out.finish_reason or "",
                        text=self.tokenizer.decode(out.generated_tokens, skip_special_tokens=True)
                        if self.tokenizer is not None else None, sequence_id=rid))
            except BaseException:
                self.calls.abandon([rid for _, _, rid in order[collected:]])
                raise
            finally:
                with self._waited_lock:
                    self._waited_for.difference_update(rid for _, _, rid in order)
        if errors:
            raise ValueError(f"{len(errors)} rollout sample(s) failed; first error: {errors[0]}")
        # this call's work; peak usage is over the call (reset at its start)
        return RolloutBatch(samples=samples, group_sizes=[len(g[2]) for g in groups],
                            stats=self.calls.window_stats(window))

    # ---------------------------------------------------------------- episodes
    def run_episodes(self, prompts: Sequence[Prompt], env, n: int | Sequence[int] = 1,
                     sampling_params: SamplingParams | None = None, max_turns: int = 8, max_length: int | None = None,
                     env_timeout: float | None = 60.0, env_workers: int = 32,
                     chat_template_kwargs: dict | None = None) -> EpisodeBatch:
        """n multi-turn episodes per prompt against `env`, prompt-major (see rollout.rl.agents).

        Each model turn samples under `sampling_params` (max_new_tokens: per turn); `env.step` answers each turn with
        tokens to append, a reward and whether the episode is done. An episode ends when the environment says done,
        after `max_turns` model turns, when no room is left under `max_length` tokens (default: the model's context),
        or on an error. Environment calls run concurrently off this thread, each within `env_timeout` seconds, on up
        to `env_workers` threads for sync methods; an environment error or timeout ends that episode alone
        (finish_reason "error"). Raises ValueError before anything runs if a prompt or setting is bad.
        """
        params = sampling_params or SamplingParams()
        engine = self.calls.engine()
        max_length = check_episode_settings(env, max_turns, max_length, engine.max_positions)
        prepared, resolved = self._prepare(prompts, n, params)
        too_long = [j for j, ids, _ in prepared if max_length is not None and len(ids) >= max_length]
        if too_long:
            raise ValueError(f"prompts {too_long[:MAX_LISTED_PROBLEMS]} leave no room for a model turn under "
                             f"max_length={max_length}; shorten them or raise max_length. Nothing was submitted")
        base = params.seed if params.seed is not None else self._rng.getrandbits(62)
        call = self.calls.begin("episodes")
        window = self.calls.window_start()
        env_calls = EnvCalls(env_workers, env_timeout)
        try:
            runner = EpisodeRunner(self.calls, env, params, resolved.max_new_tokens, max_turns, max_length, env_calls,
                                   call, chat_template_kwargs)
            episodes = runner.run(prepared, base)
        finally:
            env_calls.close()
        stats = self.calls.window_stats(window)
        stats.update(env_seconds=runner.env_seconds, turns=sum(len(e.turns) for e in episodes),
                     model_tokens=sum(map(sum, (e.completion_mask for e in episodes))),
                     env_tokens=sum(len(e.completion_ids) - sum(e.completion_mask) for e in episodes))
        return EpisodeBatch(episodes, [size for _, _, size in prepared], stats)

    # ----------------------------------------------------------------- scoring
    def score(self, prompts: Sequence[Prompt], completions: Sequence, temperature: float = 1.0,
              top_logprobs: int = 0) -> ScoreBatch:
        """Per-token logprobs of given completions under the current weights, by teacher forcing through the
        engine's paged prefill (the prefix cache is shared with generation): reference or old-policy logprobs.

        `completions[j]` (token ids, or text to tokenize without special tokens) follows `prompts[j]` (as in
        `generate`); repeat a prompt to score several completions of it. `logprobs[t]` of a sample is fp32
        log_softmax(logits / temperature) of completion token t; `top_logprobs=k` adds the k most likely tokens at
        each position. Raises ValueError before submitting anything if a pair is bad (see rollout.rl.scoring).
        """
        return scoring.score(self.calls, prompts, completions, temperature, top_logprobs)

    # ----------------------------------------------------------------- weights
    def update_weights(self, source, on_update: str = "keep") -> int:
        """Load new weights in place and bump the weight version; returns the new version.

        source: an nn.Module, a state dict, or an iterable of (name, tensor) pairs (HF names, any dtype, PEFT-merged
        names, tied weights once). Everything is validated before anything is copied: a rejected update raises
        WeightUpdateError and leaves the old weights in use. The KV cache and all engine buffers keep their storage.
        Safe to call while requests run: the loop is paused at a step boundary. `on_update="keep"` lets running
        requests keep their KV (fast, slightly off-policy); `"recompute"` re-prefills them under the new weights.
        From now on no new request reuses prefix blocks computed under older weights.
        """
        check_on_update(on_update)
        start = time.perf_counter()
        staged = None
        if not (self.share_weights and source is self.model):
            staged = stage_update(self.model, source)
        version = self.apply_staged_update(staged, on_update)
        self.last_update_seconds = time.perf_counter() - start
        logger.debug("weights updated to version %d in %.3fs", version, self.last_update_seconds)
        return version

    def apply_staged_update(self, staged: StagedPairs | None, on_update: str = "keep") -> int:
        """Copy already validated values (`stage_update` / `StagedUpdate.pairs()`) into the model at a step boundary
        and bump the weight version; returns it. None copies nothing (the model was changed in place).

        The one commit path of every weight update, so staging (slow: reading, validating, converting) can happen
        elsewhere (a server's upload threads) while only this short part holds the loop paused.
        """
        check_on_update(on_update)
        with self.manager.pause():
            engine = self.calls.engine()
            if staged is not None:
                return engine.load_weights(staged, recompute=on_update == "recompute")
            engine.set_weight_version(engine.weight_version + 1, recompute=on_update == "recompute")
            return engine.weight_version


def _hard_stop(manager: ContinuousBatchingManager) -> None:
    """Finalizer of a RolloutGenerator: end its manager's loop without waiting (it may run inside the GC)."""
    with contextlib.suppress(Exception):
        manager.signal_stop(hard_stop=True, error="RuntimeError: the RolloutGenerator was garbage-collected or the "
                                                   "interpreter is exiting; call close() to finish requests first")


# RolloutBatch and RolloutSample live in rollout.rl.batch; they are still importable from here, where they began.
__all__ = ["RolloutBatch", "RolloutGenerator", "RolloutSample", "WeightUpdateError", "generation_copy"]
