"""RolloutPool: RolloutWorkers on a Ray cluster behind the RolloutGenerator interface.

`generate` checks the whole batch on one worker, then spreads its prompt groups over the workers by queued tokens
(a group stays on one worker, so its prompt is prefilled once) and puts the results back in input order. Every
group's seed derives from the batch's base seed and the group's index, exactly as in one RolloutGenerator, so a pool
returns what one generator would, whichever worker ran a group, and a group re-run after a failure comes back the
same. `update_weights` publishes an update once and applies it on every worker or on none (see `broadcast`).

Faults: a worker whose actor dies, or that makes no engine step for `hang_timeout` seconds while it owes results
(it is then killed), leaves the pool with a warning, and its unfinished groups run again on the others; nothing of
it reaches the batch. `add_worker` starts a replacement at the pool's weights and version.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel

try:
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError, RayError, RayTaskError
    from ray.util.placement_group import remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
except ImportError as _err:  # pragma: no cover - exercised only without the extra
    raise ImportError("rollout.distributed.RolloutPool needs Ray: pip install 'rollout[ray]'") from _err

from rollout.config import ContinuousBatchingConfig
from rollout.distributed.balance import group_cost, spread
from rollout.distributed.broadcast import ObjectStoreTransport, WeightTransport, collect_weights, pack, rejection
from rollout.distributed.cluster import PLACEMENT_STRATEGIES, first_line, init_local_ray, ray_get, ready_placement_group
from rollout.distributed.metrics import batch_stats, engine_stats, pooled
from rollout.distributed.spec import ModelSpec
from rollout.distributed.worker import CONCURRENCY_GROUPS, RolloutWorker
from rollout.engine.core.stats import EngineStats
from rollout.engine.sample.resolve import resolve_sampling
from rollout.manager import ManagerError
from rollout.rl.batch import Prompt, RolloutBatch, RolloutSample
from rollout.rl.weights import check_on_update
from rollout.sampling_params import SamplingParams

logger = logging.getLogger(__name__)



class WorkersLostError(RuntimeError):
    """Every worker of the pool was lost; `add_worker` (or a new pool) is needed before it can serve again."""


@dataclass(eq=False)
class _Worker:
    id: int
    actor: ray.actor.ActorHandle
    bundle: tuple[int, int]  # (index of its placement group in the pool's list, bundle index)
    queued_tokens: int = 0  # tokens of the groups it owes results for (what `spread` balances)
    owed: int = 0  # batches it owes
    steps: int = -1  # engine steps at the last heartbeat that showed progress
    progress_at: float = 0.0
    beat: ray.ObjectRef | None = None
    beat_sent: float = 0.0


@dataclass(eq=False)
class _Dispatch:
    worker: _Worker
    groups: list[int]
    tokens: int


@dataclass
class _Usage:
    """What one worker did for one `generate` call (several dispatches if it took over re-run groups)."""

    windows: list[EngineStats] = field(default_factory=list)
    groups: int = 0
    queued_tokens: int = 0
    seconds: float = 0.0


class RolloutPool:
    """`workers` rollout engines as Ray actors, each on `num_cpus` CPUs and `num_gpus` (0 or up to 1) GPU of a
    placement-group bundle (`placement_strategy`: "PACK" fills nodes first, "SPREAD" puts workers on different
    nodes), with the RolloutGenerator interface: `generate`, `update_weights`, `weight_version`, `stats`.

    `model`: a PreTrainedModel (its class and config go to the workers, its weights through the object store once;
    it is only read) or a checkpoint path every node can read. `dtype` is the workers' weight dtype (default: the
    model's). `tokenizer` (an object, or a path each worker loads) is needed for text and chat prompts. Starts Ray
    (`ray.init()`) if it is not running.
    """

    def __init__(self, model: PreTrainedModel | str | os.PathLike, workers: int = 2, tokenizer=None,
                 continuous_batching_config: ContinuousBatchingConfig | None = None, dtype: torch.dtype | None = None,
                 seed: int | None = None, num_cpus: float = 1.0, num_gpus: float = 0.0,
                 placement_strategy: str = "PACK", hang_timeout: float = 300.0, startup_timeout: float = 600.0,
                 torch_threads: int | None = None, transport: WeightTransport | None = None) -> None:
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ValueError(f"workers must be an int >= 1, got {workers!r}")
        if not 0 <= num_gpus <= 1:
            raise ValueError(f"num_gpus is per worker and at most 1 (one GPU each), got {num_gpus}")
        if num_cpus <= 0 and num_gpus == 0:
            raise ValueError("a worker needs CPUs (num_cpus > 0) or a GPU (num_gpus > 0)")
        if placement_strategy not in PLACEMENT_STRATEGIES:
            raise ValueError(f"placement_strategy must be one of {PLACEMENT_STRATEGIES}, got {placement_strategy!r}")
        if hang_timeout <= 0:
            raise ValueError(f"hang_timeout must be > 0 seconds, got {hang_timeout}")
        if not ray.is_initialized():
            logger.info("Ray is not running in this process; starting a local cluster (init_local_ray)")
            init_local_ray()
        self.spec = (ModelSpec.from_pretrained(os.fspath(model), dtype) if isinstance(model, (str, os.PathLike))
                     else ModelSpec.from_model(model, dtype))
        config = continuous_batching_config or ContinuousBatchingConfig()
        self.hang_timeout = hang_timeout
        self.clock: Callable[[], float] = time.monotonic  # the time source of hang detection (tests drive it)
        self.startup_timeout = startup_timeout
        self.last_update_seconds = 0.0
        self.last_update_timing: dict[str, float] = {}
        self.lost: list[tuple[int, str]] = []  # (worker id, why) of every worker that left the pool
        self._rng = random.Random(seed if seed is not None else config.seed)
        self._version = 0
        self._transport = transport or ObjectStoreTransport()
        self._lock = threading.RLock()
        self._workers: list[_Worker] = []
        self._next_id = 0
        self._resources = {"CPU": num_cpus, **({"GPU": num_gpus} if num_gpus else {})}
        self._actor_options = {"num_cpus": num_cpus, "num_gpus": num_gpus, "max_restarts": 0}
        self._worker_kwargs = {"tokenizer": tokenizer, "continuous_batching_config": config, "seed": seed,
                               "device": "cuda" if num_gpus else "cpu", "torch_threads": torch_threads,
                               "transport": self._transport}
        self._actor_class = ray.remote(concurrency_groups=CONCURRENCY_GROUPS)(RolloutWorker)
        self._groups = [ready_placement_group(self._resources, workers, placement_strategy, self.startup_timeout)]
        weights = ray.put(pack(collect_weights(model))) if self.spec.path is None else None
        try:
            self._launch([(0, i) for i in range(workers)], weights, version=0)
        except BaseException:
            self.close()
            raise
        self.dtype: torch.dtype = self._info["dtype"]

    # ------------------------------------------------------------------ status
    @property
    def weight_version(self) -> int:
        return self._version

    # What a trainer reads of any backend (rollout.rl.backend.RolloutBackend); `dtype` is the workers'.
    shared_by_processes = False  # a pool belongs to the process that built it
    keeps_kv = False

    def check_sampling(self, params: SamplingParams) -> None:
        """ValueError if a setting is out of range (the settings travel whole; the workers check the rest, such as
        token ids against the vocabulary, when a batch is prepared)."""
        resolve_sampling(params, None)

    @property
    def size(self) -> int:
        """Live workers."""
        return len(self._workers)

    @property
    def worker_ids(self) -> list[int]:
        return [w.id for w in self._workers]

    @property
    def actors(self) -> list:
        """The live workers' actor handles, in `worker_ids` order."""
        return [w.actor for w in self._workers]

    def worker_stats(self) -> dict[int, EngineStats]:
        """Each live worker's EngineStats now (queue depth: `metrics.queue_depth`)."""
        refs = {w: w.actor.stats.remote() for w in list(self._workers)}
        out = {}
        for worker, ref in refs.items():
            with self._losing(worker):
                out[worker.id] = ray_get(ref, self.hang_timeout)
        return out

    def stats(self) -> EngineStats:
        """The pool's EngineStats: every live worker's summed (see `metrics.pooled`)."""
        return pooled(list(self.worker_stats().values()))

    def close(self) -> None:
        """Stop every worker and release their resources."""
        for worker in self._workers:
            with contextlib.suppress(RayError):
                ray.get(worker.actor.close.remote(), timeout=30)
            with contextlib.suppress(Exception):
                ray.kill(worker.actor)
        self._workers = []
        for group in self._groups:
            with contextlib.suppress(Exception):
                remove_placement_group(group)
        self._groups = []

    def __enter__(self) -> RolloutPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -------------------------------------------------------------- generation
    def generate(self, prompts: Sequence[Prompt], n: int | Sequence[int] = 1,
                 sampling_params: SamplingParams | None = None) -> RolloutBatch:
        """n completions per prompt (or n[j] for prompt j), prompt-major, as RolloutGenerator.generate.

        Raises ValueError before anything runs if a prompt or setting is bad, and after the batch if a sample failed
        while running; WorkersLostError if every worker was lost before the batch finished.
        """
        start = time.perf_counter()
        params = sampling_params or SamplingParams()
        ids, sizes, max_new = self._prepare(prompts, n, params)
        base = params.seed if params.seed is not None else self._rng.getrandbits(62)  # as RolloutGenerator.submit
        groups = {j: (ids[j], sizes[j]) for j in range(len(ids))}
        costs = {j: group_cost(len(ids[j]), sizes[j], max_new) for j in groups}
        results, usage = self._run(groups, costs, params.with_overrides(seed=base))
        samples = [sample for j in range(len(ids)) for sample in results[j]]
        workers = [{"worker": wid, "groups": u.groups, "queued_tokens": u.queued_tokens, "seconds": u.seconds,
                    "generated_tokens": sum(w.generated_tokens for w in u.windows),
                    "tokens_per_second": sum(w.generated_tokens for w in u.windows) / max(u.seconds, 1e-9),
                    "peak_kv_cache_usage": max(w.peak_kv_cache_usage for w in u.windows),
                    "weight_version": max(w.weight_version for w in u.windows)}
                   for wid, u in sorted(usage.items())]
        windows = [w for u in usage.values() for w in u.windows]
        stats = batch_stats(windows, time.perf_counter() - start, workers, self.size)
        return RolloutBatch(samples=samples, group_sizes=sizes, stats=stats)

    def _prepare(self, prompts, n, params) -> tuple[list[list[int]], list[int], int]:
        """The batch checked on one live worker (the engine's rules, the generator's messages)."""
        while True:
            worker = self._live()[0]
            with self._losing(worker):
                return ray_get(worker.actor.prepare.remote(prompts, n, params), self.hang_timeout)

    def _run(self, groups: dict[int, tuple[list[int], int]], costs: dict[int, int], params: SamplingParams
             ) -> tuple[dict[int, list[RolloutSample]], dict[int, _Usage]]:
        """Run every group somewhere; re-run what a lost worker owed. Returns samples by group and usage by worker."""
        results: dict[int, list[RolloutSample]] = {}
        usage: dict[int, _Usage] = {}
        pending: dict[ray.ObjectRef, _Dispatch] = {}
        try:
            self._dispatch(list(groups), groups, costs, params, pending)
            while pending:
                ready, _ = ray.wait(list(pending), num_returns=1, timeout=self._poll_seconds())
                for ref in ready:
                    dispatch = pending.pop(ref)
                    self._settle(dispatch)
                    try:
                        samples, window = ray_get(ref)
                    except (RayActorError, ManagerError) as err:
                        self._lose(dispatch.worker, f"{type(err).__name__}: {first_line(err)}")
                        self._dispatch(dispatch.groups, groups, costs, params, pending)
                        continue
                    for sample in samples:
                        results.setdefault(sample.prompt_index, []).append(sample)
                    mine = usage.setdefault(dispatch.worker.id, _Usage())
                    mine.windows.append(engine_stats(window))
                    mine.groups += len(dispatch.groups)
                    mine.queued_tokens += dispatch.tokens
                    mine.seconds += window.get("seconds", 0.0)
                for ref in self._hung(pending):
                    dispatch = pending.pop(ref)
                    self._settle(dispatch)
                    self._lose(dispatch.worker, f"no engine step for {self.hang_timeout:g}s (hung; killed)")
                    self._dispatch(dispatch.groups, groups, costs, params, pending)
        finally:
            for dispatch in pending.values():  # an error ends the batch: what is still out is no longer owed
                self._settle(dispatch)
        return results, usage

    def _dispatch(self, indices: list[int], groups, costs, params, pending: dict) -> None:
        """Spread `indices` over the live workers by queued tokens and send each worker its groups."""
        if not indices:
            return
        with self._lock:
            live = self._live()
            chosen = spread([costs[j] for j in indices], {w: w.queued_tokens for w in live})
            now = self.clock()
            for worker, picks in chosen.items():
                if not picks:
                    continue
                mine = [indices[i] for i in picks]
                tokens = sum(costs[j] for j in mine)
                ref = worker.actor.generate.remote([(j, *groups[j]) for j in mine], params)
                pending[ref] = _Dispatch(worker, mine, tokens)
                if worker.owed == 0:
                    worker.progress_at = now
                worker.owed += 1
                worker.queued_tokens += tokens

    def _settle(self, dispatch: _Dispatch) -> None:
        with self._lock:
            dispatch.worker.owed -= 1
            dispatch.worker.queued_tokens -= dispatch.tokens

    def _poll_seconds(self) -> float:
        return min(1.0, self.hang_timeout / 4)

    def _hung(self, pending: dict[ray.ObjectRef, _Dispatch]) -> list[ray.ObjectRef]:
        """Dispatches whose worker has made no engine step for `hang_timeout` seconds (heartbeats are sent as we go;
        a worker stuck inside a step cannot answer one)."""
        now = self.clock()
        hung = []
        for ref, dispatch in pending.items():
            worker = dispatch.worker
            if worker.beat is not None and ray.wait([worker.beat], timeout=0)[0]:
                with contextlib.suppress(RayError):
                    steps = ray.get(worker.beat)
                    if steps != worker.steps:
                        worker.steps, worker.progress_at = steps, now
                worker.beat = None
            if worker.beat is None and now - worker.beat_sent >= self._poll_seconds():
                worker.beat, worker.beat_sent = worker.actor.heartbeat.remote(), now
            if now - worker.progress_at > self.hang_timeout:
                hung.append(ref)
        return hung

    # ----------------------------------------------------------------- weights
    def update_weights(self, source, on_update: str = "keep") -> int:
        """Load new weights on every worker in place and bump the version on all of them together; returns it.

        source: what RolloutGenerator.update_weights takes (a module, a state dict, an iterable of (name, tensor)).
        It is gathered once to CPU and published once; every worker validates it (phase one) before any applies it
        (phase two). If any worker refuses it, WeightUpdateError names each refusal and no worker changed. A worker
        lost during the update leaves the pool; one that fails to commit is removed, so the workers left are all at
        the new version. KV caches are kept; `on_update` is as in RolloutGenerator.
        """
        check_on_update(on_update)
        timing = {}
        start = time.perf_counter()
        state = collect_weights(source)
        timing["collect"] = time.perf_counter() - start
        payload = self._transport.publish(state)
        staged = {w: w.actor.stage_weights.remote(payload) for w in self._live()}
        self._transport.send(state)
        del state
        timing["publish"] = time.perf_counter() - start - timing["collect"]
        problems = {}
        for worker, ref in staged.items():
            with self._losing(worker):
                try:
                    ray_get(ref, self.hang_timeout)
                except (ValueError, RayTaskError) as err:  # WeightUpdateError, or anything else that failed staging
                    problems[f"worker {worker.id}"] = str(err) if isinstance(err, ValueError) else first_line(err)
        timing["stage"] = time.perf_counter() - start - timing["collect"] - timing["publish"]
        if problems:
            for worker in self._workers:
                worker.actor.drop_staged.remote()
            raise rejection(problems, self._version, len(staged))
        commits = {w: w.actor.commit_weights.remote(on_update) for w in self._live()}
        expected = self._version + 1
        for worker, ref in commits.items():
            with self._losing(worker):
                try:
                    version = ray_get(ref, self.hang_timeout)
                except (ValueError, RayTaskError) as err:
                    version = f"a failed commit ({first_line(err)})"
                if version != expected:  # never leave a worker on another version than the pool
                    self._lose(worker, f"it is at {version} after the update, the pool at version {expected}")
        self._live()
        self._version = expected
        timing["commit"] = time.perf_counter() - start - sum(timing.values())
        self.last_update_seconds = time.perf_counter() - start
        self.last_update_timing = timing
        logger.debug("weights updated to version %d on %d workers in %.3fs (%s)", expected, self.size,
                     self.last_update_seconds, timing)
        return expected

    # ----------------------------------------------------------------- workers
    def add_worker(self) -> int:
        """Start one more worker (e.g. to replace a lost one) with the current weights and version; returns its id.

        It takes the resources a lost worker left in the pool's placement group, or a new bundle if none is free,
        and copies the weights of a live worker through the object store.
        """
        with self._lock:
            if self._workers:
                weights = self._workers[0].actor.export_weights.remote()
            elif self.spec.path is not None and self._version == 0:
                weights = None
            else:
                raise WorkersLostError("no live worker to copy the current weights from; create a new RolloutPool "
                                       "with the trainer's model")
            taken = {w.bundle for w in self._workers}
            free = [(g, i) for g, group in enumerate(self._groups) for i in range(len(group.bundle_specs))
                    if (g, i) not in taken]
            if not free:
                self._groups.append(ready_placement_group(self._resources, 1, "PACK", self.startup_timeout))
                free = [(len(self._groups) - 1, 0)]
            return self._launch(free[:1], weights, self._version)[0]

    def _launch(self, bundles: list[tuple[int, int]], weights, version: int) -> list[int]:
        """Start one worker per (placement group, bundle) and wait until each answers; returns their ids."""
        started = []
        for group, index in bundles:
            strategy = PlacementGroupSchedulingStrategy(self._groups[group], placement_group_bundle_index=index)
            actor = self._actor_class.options(scheduling_strategy=strategy, **self._actor_options).remote(
                self.spec, weights, weight_version=version, **self._worker_kwargs)
            started.append(_Worker(self._next_id, actor, (group, index)))
            self._next_id += 1
        try:
            infos = ray_get([w.actor.info.remote() for w in started], self.startup_timeout)
        except (GetTimeoutError, RayActorError) as err:
            for worker in started:
                ray.kill(worker.actor)
            if isinstance(err, RayActorError):
                raise RuntimeError(f"a rollout worker failed to start: {err}") from None
            raise TimeoutError(f"rollout workers did not start within {self.startup_timeout:g}s (startup_timeout); "
                               "check the actors' logs (ray logs) for the error") from None
        for worker, info in zip(started, infos):
            if info["weight_version"] != version:  # pragma: no cover - a worker sets the version it is given
                raise RuntimeError(f"worker {worker.id} started at version {info['weight_version']}, not {version}")
        self._info = infos[0]
        self._workers.extend(started)
        logger.info("started %d rollout worker(s) %s on %s (%s); the pool has %d", len(started),
                    [w.id for w in started], infos[0]["device"], infos[0]["dtype"], len(self._workers))
        return [w.id for w in started]

    def _live(self) -> list[_Worker]:
        if not self._workers:
            lost = "; ".join(f"worker {i}: {why}" for i, why in self.lost[-4:])
            raise WorkersLostError(f"every rollout worker was lost ({lost}); call add_worker() or create a new pool")
        return list(self._workers)

    @contextlib.contextmanager
    def _losing(self, worker: _Worker):
        """Drop `worker` from the pool if the call inside fails because the worker is gone or hung."""
        try:
            yield
        except (RayActorError, ManagerError) as err:
            self._lose(worker, f"{type(err).__name__}: {first_line(err)}")
        except GetTimeoutError:
            self._lose(worker, f"no answer within {self.hang_timeout:g}s (hung; killed)")

    def _lose(self, worker: _Worker, why: str) -> None:
        with self._lock:
            if worker not in self._workers:
                return
            self._workers.remove(worker)
            self.lost.append((worker.id, why))
        with contextlib.suppress(Exception):
            ray.kill(worker.actor)
        logger.warning("rollout worker %d left the pool (%s); %d worker(s) remain and take over its unfinished "
                       "groups. add_worker() starts a replacement.", worker.id, why, len(self._workers))
