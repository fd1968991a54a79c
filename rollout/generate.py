"""`generate_batch`: submit every prompt, run the engine until all finish, return outputs in input order."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

from tqdm.auto import tqdm
from transformers import GenerationConfig, PreTrainedModel

from rollout.config import ContinuousBatchingConfig
from rollout.engine.core.request import RequestOutput
from rollout.engine.engine import LLMEngine
from rollout.engine.sample.resolve import resolve_sampling
from rollout.sampling_params import SamplingParams


def _per_request(sampling_params, count: int) -> list[SamplingParams | None]:
    if isinstance(sampling_params, (list, tuple)):
        if len(sampling_params) != count:
            raise ValueError(f"got {len(sampling_params)} SamplingParams for {count} inputs; pass one or one per input")
        return list(sampling_params)
    return [sampling_params] * count


def workload_tokens(inputs: Sequence[Sequence[int]], params: Sequence[SamplingParams | None],
                    generation_config: GenerationConfig | None) -> int:
    """Upper bound of KV tokens the batch can need at once, to size the cache for the job on CPU."""
    total = 0
    for prompt, p in zip(inputs, params):
        try:
            resolved = resolve_sampling(p, generation_config)
        except ValueError:
            continue
        total += (len(prompt) + resolved.max_new_tokens) * (p.n if p is not None else 1)
    return total


def generate_batch(
    model: PreTrainedModel,
    inputs: list[list[int]],
    generation_config: GenerationConfig | None = None,
    continuous_batching_config: ContinuousBatchingConfig | None = None,
    sampling_params: SamplingParams | list[SamplingParams] | None = None,
    progress_bar: bool = True,
    tokenizer=None,
) -> dict[str, RequestOutput]:
    """Generate for every prompt with continuous batching; blocks until all are done.

    Returns `{request_id: RequestOutput}` in input order (ids `req_0`, `req_1`, ...; `req_i#j` for n > 1 samples).
    A bad input fails alone: its output has status FAILED and the reason in `error`. `tokenizer` is needed for stop
    strings and structured outputs.
    """
    params = _per_request(sampling_params, len(inputs))
    gen_config = generation_config or getattr(model, "generation_config", None)
    engine = LLMEngine(model, gen_config, continuous_batching_config,
                       tokens_hint=workload_tokens(inputs, params, gen_config), tokenizer=tokenizer)
    if engine.tp_group is not None:  # each rank's engine must see the same requests (rollout.engine.tensor_parallel)
        engine.tp_group.check_same("inputs and sampling_params of generate_batch", (inputs, params))
        progress_bar = progress_bar and engine.tp_group.is_driver
    order: list[str] = []
    for i, (prompt, p) in enumerate(zip(inputs, params)):
        order.extend(engine.add_request(prompt, request_id=f"req_{i}", sampling_params=p))
    results: dict[str, RequestOutput] = {}
    with tqdm(total=len(order), disable=not progress_bar, desc="generate_batch", unit="req") as bar:
        while engine.has_unfinished():
            for out in engine.step():
                if out.is_finished():
                    results[out.request_id] = out
                    bar.update(1)
    return {rid: results[rid] for rid in order}


def init_continuous_batching(model: PreTrainedModel, generation_config: GenerationConfig | None = None,
                             continuous_batching_config: ContinuousBatchingConfig | None = None):
    """A new, not yet started ContinuousBatchingManager for `model` (call `start()`)."""
    from rollout.manager import ContinuousBatchingManager

    return ContinuousBatchingManager(model, generation_config, continuous_batching_config)


_PERSISTENT_ATTR = "_rollout_persistent_manager"


@contextlib.contextmanager
def continuous_batching_context_manager(model: PreTrainedModel, generation_config: GenerationConfig | None = None,
                                        continuous_batching_config: ContinuousBatchingConfig | None = None,
                                        persistent_manager: bool = False):
    """Start a manager, yield it, stop it on exit; destroy it unless `persistent_manager`.

    A persistent manager is kept on the model and reused (cache and warm-up included) by the next context that asks
    for one; pass new configs to get a fresh manager instead.
    """
    manager = getattr(model, _PERSISTENT_ATTR, None) if persistent_manager else None
    if manager is not None and (generation_config is not None or continuous_batching_config is not None):
        manager.destroy()
        manager = None
    if manager is None:
        manager = init_continuous_batching(model, generation_config, continuous_batching_config)
    manager.start()
    try:
        yield manager
    finally:
        manager.stop()
        if persistent_manager:
            setattr(model, _PERSISTENT_ATTR, manager)
        else:
            manager.destroy()
            if getattr(model, _PERSISTENT_ATTR, None) is manager:
                delattr(model, _PERSISTENT_ATTR)
