"""Scoring given completions with the engine: per-token logprobs under the current weights, by teacher forcing.

A trainer needs the logprobs of completions it already has (the reference policy's, or the old policy's after a
weight update) without a second model in memory. Each (prompt, completion) pair runs as one prefill-only request
(`max_new_tokens=0`) over prompt + completion that asks for prompt logprobs from the first completion position
(`prompt_logprobs_start=len(prompt)`): the logprobs come out of the engine's paged, chunked prefill, batched with
whatever else runs, and the prompt's full blocks come from (and go to) the prefix cache shared with generation, so
the n completions of one prompt prefill that prompt once. `logprobs[t]` is fp32 log_softmax(logits / temperature) of
completion token t given the prompt and completion tokens before it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from rollout.engine.core.request import RequestOutput, RequestStatus
from rollout.rl.calls import EngineCalls, check_every
from rollout.sampling_params import SamplingParams


@dataclass
class ScoredSample:
    """The logprobs of one given completion."""

    prompt_index: int
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]  # fp32 log_softmax(logits / temperature) of each completion token
    top_logprobs: list[dict[int, float]] | None = None  # the k most likely tokens at each position, if asked


@dataclass
class ScoreBatch:
    """Scored samples in input order, and the weight version they were scored under."""

    samples: list[ScoredSample]
    weight_version: int
    stats: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.samples)

    def to_tensors(self, pad_token_id: int = 0, device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
        """Right-padded `completion_ids`, `completion_mask` and `logprobs` ([samples, longest completion]), laid out
        as RolloutBatch.to_tensors lays out its completions."""
        b = len(self.samples)
        lc = max([1, *(len(s.completion_ids) for s in self.samples)])
        out = {
            "completion_ids": torch.full((b, lc), pad_token_id, dtype=torch.long),
            "completion_mask": torch.zeros(b, lc, dtype=torch.long),
            "logprobs": torch.zeros(b, lc),
        }
        for i, s in enumerate(self.samples):
            c = len(s.completion_ids)
            if c:
                out["completion_ids"][i, :c] = torch.tensor(s.completion_ids)
                out["completion_mask"][i, :c] = 1
                out["logprobs"][i, :c] = torch.tensor(s.logprobs)
        return {k: v.to(device) for k, v in out.items()} if device is not None else out


def score_params(prompt_len: int, temperature: float = 1.0, top_logprobs: int = 0) -> SamplingParams:
    """The settings of one scoring request over prompt + completion (`prompt_len` tokens of prompt)."""
    return SamplingParams(max_new_tokens=0, temperature=0.0, ignore_eos=True, prompt_logprobs=top_logprobs,
                          prompt_logprobs_start=prompt_len, prompt_logprobs_temperature=temperature)


def completion_logprobs(out: RequestOutput, prompt_len: int) -> tuple[list[float], list[dict[int, float]] | None]:
    """The completion's part of a scoring request's output: its logprobs, and its alternatives if asked."""
    logprobs = out.prompt_logprobs[prompt_len:] if out.prompt_logprobs is not None else []
    top = out.prompt_top_logprobs[prompt_len:] if out.prompt_top_logprobs is not None else None
    return logprobs, top


def pair_up(prompts: Sequence, completions: Sequence) -> None:
    """ValueError unless there is one completion per prompt."""
    if isinstance(prompts, (str, bytes)) or isinstance(completions, (str, bytes)):
        raise ValueError("prompts and completions must be lists (one completion per prompt)")
    if len(prompts) != len(completions):
        raise ValueError(f"got {len(prompts)} prompts and {len(completions)} completions; pass one completion per "
                         "prompt (repeat a prompt to score several completions of it: its KV is computed once)")


def _completion_ids(calls: EngineCalls, completion) -> list[int]:
    """A completion as token ids: ids pass through, text is tokenized without special tokens."""
    if isinstance(completion, str):
        if calls.tokenizer is None:
            raise ValueError("text completions need a tokenizer: RolloutGenerator(model, tokenizer=...)")
        return list(calls.tokenizer(completion, add_special_tokens=False)["input_ids"])
    if hasattr(completion, "tolist"):
        completion = completion.tolist()
    return list(completion)


def prepare(calls: EngineCalls, prompts: Sequence, completions: Sequence, temperature: float,
            top_logprobs: int) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, completion ids) per pair, every one checked by the engine's rules before anything is queued;
    ValueError listing the bad pairs otherwise."""
    pair_up(prompts, completions)
    calls.check_sampling(score_params(1, temperature, top_logprobs), "scoring settings")
    engine = calls.engine()

    def checked(pair) -> tuple[list[int], list[int]]:
        prompt_ids, completion_ids = calls.prompt_ids(pair[0]), _completion_ids(calls, pair[1])
        engine.validate_prompt(prompt_ids + completion_ids, prefill_only=True)
        return prompt_ids, completion_ids

    pairs = check_every(list(zip(prompts, completions)), checked, "pair",
                        "(prompt, completion) pairs cannot be scored")
    return pairs


def score(calls: EngineCalls, prompts: Sequence, completions: Sequence, temperature: float = 1.0,
          top_logprobs: int = 0) -> ScoreBatch:
    """RolloutGenerator.score: one prefill-only request per pair with a completion, stepped in this thread."""
    window = calls.window_start(reset_peak=False)
    pairs = prepare(calls, prompts, completions, temperature, top_logprobs)
    manager = calls.manager
    version = calls.engine().weight_version
    call = calls.begin("score")
    ids = {j: f"{call}-{j}" for j, (_, completion) in enumerate(pairs) if completion}
    outputs: dict[int, RequestOutput] = {}
    with manager.stepping_in_caller():
        try:
            # Pairs sharing a prompt go in one after another, so the first one's prompt blocks serve the rest.
            for j in sorted(ids, key=lambda j: pairs[j][0] + pairs[j][1]):
                prompt_ids, completion_ids = pairs[j]
                calls.submit(prompt_ids + completion_ids, ids[j], score_params(len(prompt_ids), temperature,
                                                                               top_logprobs))
            for j, rid in ids.items():
                outputs[j] = manager.get_result(rid)
        except BaseException:
            calls.abandon([rid for j, rid in ids.items() if j not in outputs])
            raise
    errors = [f"pair {j}: {out.error}" for j, out in outputs.items() if out.status != RequestStatus.FINISHED]
    if errors:
        raise ValueError(f"{len(errors)} scoring request(s) failed; first error: {errors[0]}")
    samples = []
    for j, (prompt_ids, completion_ids) in enumerate(pairs):
        logprobs, top = completion_logprobs(outputs[j], len(prompt_ids)) if j in outputs else ([], None)
        if j not in outputs and top_logprobs:
            top = []
        samples.append(ScoredSample(j, prompt_ids, completion_ids, logprobs, top))
    stats = calls.window_stats(window)
    stats.update(scored_tokens=sum(len(c) for _, c in pairs))
    return ScoreBatch(samples, version, stats)


__all__ = ["ScoreBatch", "ScoredSample", "completion_logprobs", "pair_up", "prepare", "score", "score_params"]
