"""Per-request sampling and stopping settings, and how they merge with a model's `GenerationConfig`.

`SamplingParams` is what a caller writes (every field optional); `ResolvedSampling` is what the engine consumes
(every field concrete, validated once at submission so the sampler never meets a bad value).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

from transformers import GenerationConfig

from rollout.validation import check_sampling

DEFAULT_MAX_NEW_TOKENS = 256


@dataclass
class SamplingParams:
    """Sampling/stopping settings for one request. `None` means: take it from the generation config.

    Greedy decoding is `temperature=0` or `do_sample=False`. `top_k=0`, `top_p=1` and `min_p=0` disable truncation.
    `seed` makes the request's samples independent of the rest of the batch and repeatable across runs.
    `stop_strings` end a sequence once its decoded text contains one (the engine needs a tokenizer for them).
    """

    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    max_new_tokens: int | None = None
    min_new_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    stop_strings: list[str] | None = None
    ignore_eos: bool | None = None
    do_sample: bool | None = None
    eos_token_id: int | list[int] | None = None
    n: int = 1

    def with_overrides(self, **overrides: Any) -> SamplingParams:
        """A copy with the given fields replaced; unknown names are a clear error."""
        known = {f.name for f in fields(self)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise TypeError(f"Unknown sampling parameter(s) {unknown}; valid names are {sorted(known)}.")
        return replace(self, **{k: v for k, v in overrides.items() if v is not None})


@dataclass(frozen=True)
class ResolvedSampling:
    """Concrete, validated settings the engine uses for one sequence."""

    greedy: bool
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    repetition_penalty: float
    seed: int | None
    max_new_tokens: int
    min_new_tokens: int
    stop_token_ids: frozenset[int]
    eos_token_ids: frozenset[int]
    stop_strings: tuple[str, ...] = ()

    @property
    def truncates(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0


def _pick(value: Any, fallback: Any, default: Any) -> Any:
    if value is not None:
        return value
    return default if fallback is None else fallback


def _as_id_set(value: int | list[int] | tuple[int, ...] | None) -> frozenset[int]:
    if value is None:
        return frozenset()
    if isinstance(value, int):
        return frozenset([value])
    return frozenset(int(v) for v in value)


def resolve_sampling(
    params: SamplingParams | None,
    generation_config: GenerationConfig | None,
    model_eos: int | list[int] | None = None,
) -> ResolvedSampling:
    """Merge request params over the generation config and validate. Raises ValueError naming the bad field."""
    p = params or SamplingParams()
    g = generation_config or GenerationConfig()
    temperature = float(_pick(p.temperature, getattr(g, "temperature", None), 1.0))
    if p.temperature == 0 or p.do_sample is False:
        greedy = True
    elif p.do_sample is True or p.temperature is not None:
        greedy = False
    else:
        greedy = not bool(getattr(g, "do_sample", False)) or temperature == 0
    resolved = ResolvedSampling(
        greedy=greedy,
        temperature=temperature,
        top_k=int(_pick(p.top_k, getattr(g, "top_k", None), 0)),
        top_p=float(_pick(p.top_p, getattr(g, "top_p", None), 1.0)),
        min_p=float(_pick(p.min_p, getattr(g, "min_p", None), 0.0)),
        repetition_penalty=float(_pick(p.repetition_penalty, getattr(g, "repetition_penalty", None), 1.0)),
        seed=p.seed,
        max_new_tokens=int(_pick(p.max_new_tokens, getattr(g, "max_new_tokens", None), DEFAULT_MAX_NEW_TOKENS)),
        min_new_tokens=int(_pick(p.min_new_tokens, getattr(g, "min_new_tokens", None), 0)),
        stop_token_ids=_as_id_set(p.stop_token_ids),
        stop_strings=tuple(p.stop_strings or ()) if not isinstance(p.stop_strings, str) else (p.stop_strings,),
        eos_token_ids=frozenset()
        if p.ignore_eos
        else _as_id_set(_pick(p.eos_token_id, getattr(g, "eos_token_id", None), model_eos)),
    )
    check_sampling(resolved, p)
    return resolved
