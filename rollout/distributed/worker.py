"""RolloutWorker: one RolloutGenerator inside a Ray actor (on CPU, or on the one GPU Ray gave it), driven by a pool.

The worker builds its model from a ModelSpec and the weights the pool put into the object store, generates from it
directly (it owns the model: no second copy), and answers three kinds of calls, each in its own concurrency group so
none waits behind another: batches of prompt groups (one at a time); weight staging and commits (an update can land
while a batch runs: the commit waits for a step boundary, as in-process); heartbeats, stats and pauses (answered
while a batch runs, which is how a pool tells a slow worker from a hung one).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator, Sequence

import ray
import torch

from rollout.config import ContinuousBatchingConfig
from rollout.distributed.broadcast import ObjectStoreTransport, Packed, WeightTransport, collect_weights, pack, unpack
from rollout.distributed.spec import ModelSpec
from rollout.engine.core.stats import EngineStats
from rollout.rl.batch import Prompt, RolloutSample
from rollout.rl.generator import RolloutGenerator
from rollout.rl.weights import StagedPairs, WeightUpdateError, stage_update
from rollout.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

CONTROL = "control"  # heartbeats, stats, prompt checks, pauses
WEIGHTS = "weights"  # staging, committing and exporting weights
CONCURRENCY_GROUPS = {CONTROL: 1, WEIGHTS: 1}  # batches run in Ray's default group, one at a time

Group = tuple[int, list[int], int]  # (index in the pool's batch, prompt ids, group size)


class _NumberedGenerator(RolloutGenerator):
    """A RolloutGenerator that numbers a call's prompts by their index in the pool's whole batch.

    A prompt's seed, request id, `prompt_index` and error messages all derive from its number, so a group generates
    here exactly what one generator given the whole batch would generate for it (and does again if a pool re-runs
    it elsewhere).
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._numbering = threading.local()

    @contextlib.contextmanager
    def numbered(self, numbers: Sequence[int]) -> Iterator[None]:
        self._numbering.numbers = list(numbers)
        try:
            yield
        finally:
            self._numbering.numbers = None

    def _prepare(self, *args, **kwargs):
        prepared, resolved = super()._prepare(*args, **kwargs)
        numbers = getattr(self._numbering, "numbers", None)
        if numbers is None:
            return prepared, resolved
        return [(numbers[j], ids, size) for j, ids, size in prepared], resolved


class RolloutWorker:
    """A rollout engine for a RolloutPool. Ray runs it as an actor (`ray.remote(concurrency_groups=
    CONCURRENCY_GROUPS)(RolloutWorker)`); the pool does that, with the CPU/GPU resources of a placement-group bundle.

    `weights`: the packed tensors a `from_model` spec needs (an ObjectRef, resolved by Ray). `weight_version`: the
    version this worker starts at (a replacement joins at the pool's version).
    """

    def __init__(self, spec: ModelSpec, weights: Packed | None = None, tokenizer=None,
                 continuous_batching_config: ContinuousBatchingConfig | None = None, seed: int | None = None,
                 weight_version: int = 0, device: str = "cpu", torch_threads: int | None = None,
                 transport: WeightTransport | None = None) -> None:
        self._threads = torch_threads
        self._follow_threads()
        if isinstance(tokenizer, str):
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(tokenizer)
        model = spec.build(unpack(weights) if weights is not None else None, device)
        self._transport = transport or ObjectStoreTransport()
        self.generator = _NumberedGenerator(model, tokenizer=tokenizer, share_weights=True, seed=seed,
                                            continuous_batching_config=continuous_batching_config)
        if weight_version:
            self.generator.manager.engine.set_weight_version(weight_version)
        self._staged: StagedPairs | None = None

    def _follow_threads(self) -> None:
        """torch's intra-op thread count is per thread, and Ray calls each concurrency group in its own threads."""
        if self._threads:
            torch.set_num_threads(self._threads)

    # -------------------------------------------------------------- generation
    def generate(self, groups: Sequence[Group], sampling_params: SamplingParams) -> tuple[list[RolloutSample], dict]:
        """The samples of `groups` (prompt-major, `prompt_index` = the pool's index) and this call's stats window.

        `sampling_params` carries the pool's base seed; each group's seed derives from it and its index."""
        self._follow_threads()
        with self.generator.numbered([j for j, _, _ in groups]):
            batch = self.generator.generate([ids for _, ids, _ in groups], n=[size for _, _, size in groups],
                                            sampling_params=sampling_params)
        return batch.samples, batch.stats

    @ray.method(concurrency_group=CONTROL)
    def prepare(self, prompts: Sequence[Prompt], n, sampling_params: SamplingParams
                ) -> tuple[list[list[int]], list[int], int]:
        """Check a whole batch by the engine's own rules before any of it is submitted anywhere: token ids and group
        size per prompt, and the max_new_tokens the engine will use. ValueError names every bad prompt by index."""
        prepared, resolved = self.generator._prepare(prompts, n, sampling_params)  # the generator's whole-batch check
        return [ids for _, ids, _ in prepared], [size for _, _, size in prepared], resolved.max_new_tokens

    # ----------------------------------------------------------------- weights
    @ray.method(concurrency_group=WEIGHTS)
    def stage_weights(self, payload) -> int:
        """Validate an update against this model and keep it staged (live weights untouched); returns how many
        tensors it stages. WeightUpdateError says why it was refused."""
        self._staged = None
        self._staged = stage_update(self.generator.model, self._transport.receive(payload))
        return len(self._staged)

    @ray.method(concurrency_group=WEIGHTS)
    def commit_weights(self, on_update: str = "keep") -> int:
        """Apply the staged update at a step boundary and bump the version; returns it."""
        if self._staged is None:
            raise WeightUpdateError("this worker has no staged update to commit (it was dropped or never staged)")
        staged, self._staged = self._staged, None
        return self.generator.apply_staged_update(staged, on_update)

    @ray.method(concurrency_group=WEIGHTS)
    def drop_staged(self) -> None:
        self._staged = None

    @ray.method(concurrency_group=WEIGHTS)
    def export_weights(self) -> Packed:
        """This worker's current weights, packed for a replacement worker (returned through the object store)."""
        return pack(collect_weights(self.generator.model))

    # ----------------------------------------------------------------- control
    @ray.method(concurrency_group=CONTROL)
    def heartbeat(self) -> int:
        """Engine steps so far. It waits for the engine lock, so a worker stuck inside a step does not answer."""
        return self.generator.stats().steps

    @ray.method(concurrency_group=CONTROL)
    def stats(self) -> EngineStats:
        return self.generator.stats()

    @ray.method(concurrency_group=CONTROL)
    def info(self) -> dict:
        """What the pool checks at start: the weight version, dtype and device actually in use."""
        param = next(self.generator.model.parameters())
        return {"weight_version": self.generator.weight_version, "dtype": param.dtype, "device": str(param.device)}

    @ray.method(concurrency_group=CONTROL)
    def pause(self) -> None:
        """Park generation at the next step boundary until `resume` (queued work waits; nothing is lost)."""
        self.generator.manager.pause_generation()

    @ray.method(concurrency_group=CONTROL)
    def resume(self) -> None:
        self.generator.manager.resume_generation()

    @ray.method(concurrency_group=CONTROL)
    def close(self) -> None:
        self.generator.close()
