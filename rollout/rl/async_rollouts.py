"""AsyncRollouts: a rollout producer that keeps its backend generating while the trainer trains.

    producer = AsyncRollouts(backend, prompts, reward_funcs, groups_per_batch=16, n=8, max_staleness=1)
    for batch in producer:          # scored groups, at most max_staleness weight versions old
        loss = ...; loss.backward(); optimizer.step()
        producer.update_weights(model)   # lands in flight; generation does not stop for it
    producer.close()

Worker threads pull prompts, submit one n-sample group each to the backend (any `RolloutBackend`: a
`RolloutGenerator` in this process, `RolloutServerPool`, `RolloutPool`), score finished groups with the reward
functions (`rollout.rl.rewards`) and file them for the trainer. Which groups may start and which the next batch must
hold is `rollout.rl.staleness`'s decision; every token keeps the weight version that produced it, so a group started
under v and finished under v + 2 comes back whole with its version span.

In one process the engine and the trainer each get their own OpenMP team: the workers never step the engine
(`thread_teams.leave_stepping_to_loop`), so only the manager's loop thread does, with `engine_threads` intra-op threads
while the trainer keeps its own `torch.set_num_threads` (docs/rl.md, "Async RL").

Faults: a group whose generation is refused (ValueError: a bad prompt, a sample that failed) or whose reward
function raises or times out fails alone; it is counted, logged and replaced. Anything else the backend raises (a
dead engine, lost servers) ends the producer, and the trainer's next wait raises ProducerError with it; so does a
producer that hands out nothing for `stall_timeout` seconds while groups are in flight. `close()` stops admitting,
cancels what the backend can cancel, and waits for the workers.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from rollout import thread_teams
from rollout.rl.backend import RolloutBackend
from rollout.rl.batch import Prompt, RolloutBatch, RolloutSample
from rollout.rl.rewards import RewardError, RewardFunction, RewardRunner
from rollout.rl.staleness import StalenessError, StalenessGate
from rollout.rl.weights import check_on_update
from rollout.sampling_params import SamplingParams
from rollout.seeding import SeedStream, derive_seed

logger = logging.getLogger(__name__)


class ProducerError(RuntimeError):
    """The producer cannot deliver: its backend failed, or nothing arrived for `stall_timeout` seconds."""


@dataclass
class ScoredGroup:
    """One prompt's n samples, scored, with the weight versions they were generated under."""

    index: int  # admission order: unique, so a lost or repeated group shows
    row: object  # the prompt item as the iterable gave it (a dict row keeps its other columns)
    samples: list[RolloutSample]
    rewards: list[float]  # weighted total per sample (empty when the producer has no reward functions)
    reward_columns: dict[str, list[float]]  # each reward function's values, by name
    admitted_version: int  # the weight version current when the group was admitted

    @property
    def oldest_version(self) -> int:
        """The oldest weight version of any of its tokens (the admission version if none was generated)."""
        return min((v for s in self.samples for v in s.weight_versions), default=self.admitted_version)

    @property
    def newest_version(self) -> int:
        return max((v for s in self.samples for v in s.weight_versions), default=self.admitted_version)


@dataclass
class AsyncBatch:
    """The groups of one optimizer step, with the trainer's version when taken and the producer's metrics."""

    groups: list[ScoredGroup]
    trainer_version: int
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def rollouts(self) -> RolloutBatch:
        """The samples prompt-major, as a RolloutBatch (`to_tensors` pads them for a loss)."""
        samples = [dataclasses.replace(s, prompt_index=j) for j, g in enumerate(self.groups) for s in g.samples]
        return RolloutBatch(samples, [len(g.samples) for g in self.groups])

    @property
    def rewards(self) -> list[float]:
        return [r for g in self.groups for r in g.rewards]

    def versions_behind(self) -> list[int]:
        """Per sample: how many versions its oldest token lags the trainer's weights."""
        return [self.trainer_version - min(s.weight_versions, default=g.admitted_version)
                for g in self.groups for s in g.samples]

    def __len__(self) -> int:
        return len(self.groups)


class AsyncRollouts:
    """Scored rollout groups for the trainer, generated ahead of it within `max_staleness` weight versions."""

    def __init__(self, backend: RolloutBackend, prompts: Iterable, reward_funcs: RewardFunction |
                 Sequence[RewardFunction] | None, groups_per_batch: int, n: int = 8,
                 sampling_params: SamplingParams | None = None, max_staleness: int = 1, on_update: str = "keep",
                 prompt_key: str = "prompt", reward_weights: Sequence[float] | None = None,
                 reward_timeout: float | None = 60.0, reward_workers: int = 4, engine_threads: int | None = None,
                 stall_timeout: float | None = 600.0, seed: int | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if getattr(backend, "share_weights", False):
            raise ValueError("an async producer needs its own copy of the weights (the trainer changes the shared "
                             "ones while groups generate): build the RolloutGenerator with share_weights=False")
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"n must be an int >= 1 (samples per prompt), got {n!r}")
        check_on_update(on_update)
        self.params = sampling_params or SamplingParams()
        backend.check_sampling(self.params)
        self.backend, self.n, self.on_update, self.prompt_key = backend, n, on_update, prompt_key
        self.engine_threads, self.stall_timeout, self.clock = engine_threads, stall_timeout, clock
        self._gate = StalenessGate(max_staleness, groups_per_batch, backend.weight_version)
        # None: the trainer scores the groups itself (TRL's reward functions, in AsyncRolloutGRPOTrainer)
        self._rewards = (None if reward_funcs is None
                         else RewardRunner(reward_funcs, reward_weights, reward_timeout, reward_workers))
        self._seed = seed if seed is not None else random.getrandbits(62)
        self._prompts = iter(prompts)
        self._exhausted = False
        self._cv = threading.Condition()  # guards the gate, the buffer and the counters
        self._ready: dict[int, ScoredGroup] = {}
        self._closed = False
        self._fatal: BaseException | None = None
        self.counts = {"admitted": 0, "handed_out": 0, "failed_generation": 0, "failed_reward": 0}
        self._idle = _Stopwatch(clock)  # time with no group generating while the trainer could use more
        self._waiting = _Stopwatch(clock)  # time the trainer spent blocked in next()
        self._last_handout = clock()
        self._last_progress = clock()
        workers = (max_staleness + 1) * groups_per_batch
        self._workers = [threading.Thread(target=self._work, name=f"rollout-producer-{i}", daemon=True)
                         for i in range(workers)]
        self._idle.start()
        for worker in self._workers:
            worker.start()

    # ------------------------------------------------------------------ trainer side
    @property
    def max_staleness(self) -> int:
        return self._gate.max_staleness

    @property
    def weight_version(self) -> int:
        return self._gate.version

    @property
    def updates(self) -> int:
        """Weight updates pushed through this producer."""
        return self._gate.version - self._gate.first_version

    def __iter__(self) -> Iterator[AsyncBatch]:
        while (batch := self.next_batch()) is not None:
            yield batch

    def next_batch(self) -> AsyncBatch | None:
        """The next batch of `groups_per_batch` scored groups (fewer once the prompts run out; None after the last).

        Blocks until the batch is complete; ProducerError if the backend failed or nothing arrived for
        `stall_timeout` seconds."""
        with self._cv:
            self._waiting.start()
            try:
                chosen = self._wait_for_batch()
            finally:
                self._waiting.stop()
            if chosen is None:
                return None
            self._gate.take(chosen)
            groups = [self._ready.pop(i) for i in chosen]
            self.counts["handed_out"] += len(groups)
            batch = AsyncBatch(groups, self._gate.version)
            batch.metrics = self._metrics(batch)
            self._cv.notify_all()
        return batch

    def update_weights(self, source, on_update: str | None = None) -> int:
        """Push new weights to the backend while groups keep generating; returns the new version.

        Refused (StalenessError) if a group still owed to the trainer would become too stale: take a batch first."""
        with self._cv:
            self._raise_if_failed()
            self._gate.check_update()
        version = self.backend.update_weights(source, on_update=on_update or self.on_update)
        with self._cv:
            self._gate.updated(version)
            self._cv.notify_all()
        return version

    def close(self, timeout: float | None = 60.0) -> None:
        """Stop admitting, cancel the backend's work in flight where it can, and wait for the workers."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        cancel = getattr(self.backend, "cancel_inflight", None)
        if cancel is not None:
            cancel()
        deadline = None if timeout is None else self.clock() + timeout
        for worker in self._workers:
            worker.join(None if deadline is None else max(0.0, deadline - self.clock()))
        if self._rewards is not None:
            self._rewards.close()
        alive = sum(w.is_alive() for w in self._workers)
        if alive:
            logger.warning("%d rollout producer worker(s) still running after close(timeout=%s)", alive, timeout)

    def __enter__(self) -> AsyncRollouts:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ batch choice
    def _wait_for_batch(self) -> list[int] | None:
        while True:
            self._raise_if_failed()
            more = not self._exhausted or self._gate.running > 0
            chosen = self._gate.choose(more_can_come=more)
            if chosen is not None:
                return chosen
            if not more and self._gate.untaken == 0:
                return None
            if self._gate.running == 0 and not self._gate.can_admit() and not self._exhausted:
                raise StalenessError(
                    f"the next batch needs {self._gate.groups_per_batch} groups but max_staleness="
                    f"{self._gate.max_staleness} admits no more before the next update_weights: call "
                    "update_weights once after each batch")
            self._cv.wait(timeout=1.0)
            if self.stall_timeout is not None and self.clock() - self._last_progress > self.stall_timeout:
                raise ProducerError(f"no rollout group finished for {self.stall_timeout:g}s while "
                                    f"{self._gate.running} were generating (stall_timeout): the backend is hung")

    def _raise_if_failed(self) -> None:
        if self._fatal is not None:
            raise ProducerError(f"the rollout producer stopped: {type(self._fatal).__name__}: {self._fatal}") \
                from self._fatal
        if self._closed:
            raise ProducerError("the rollout producer was closed")

    def _metrics(self, batch: AsyncBatch) -> dict[str, float]:
        now = self.clock()
        interval = max(now - self._last_handout, 1e-9)
        self._last_handout = now
        behind = batch.versions_behind() or [0]
        metrics = {
            "async/versions_behind/mean": sum(behind) / len(behind),
            "async/versions_behind/max": max(behind),
            "async/buffer_depth": self._gate.ready,
            "async/running_groups": self._gate.running,
            "async/producer_idle_fraction": self._idle.take() / interval,
            "async/trainer_wait_fraction": self._waiting.take() / interval,
            "async/failed_groups": self.counts["failed_generation"] + self.counts["failed_reward"],
            "async/weight_version": self._gate.version,
        }
        return {k: float(v) for k, v in metrics.items()}

    # ------------------------------------------------------------------ workers
    def _work(self) -> None:
        if self.engine_threads is not None:
            torch.set_num_threads(self.engine_threads)  # what the engine's loop adopts from its submitters
        with thread_teams.leave_stepping_to_loop():
            while True:
                ticket = self._admit()
                if ticket is None:
                    return
                try:
                    self._produce(*ticket)
                except BaseException as err:  # the backend is gone: tell the trainer instead of hanging it
                    logger.exception("rollout producer stopped: the backend failed")
                    with self._cv:
                        self._fatal = self._fatal or err
                        self._cv.notify_all()
                    return

    def _admit(self) -> tuple[int, int, object] | None:
        with self._cv:
            while not (self._closed or self._fatal or self._exhausted) and not self._gate.can_admit():
                self._cv.wait()
            if self._closed or self._fatal or self._exhausted:
                return None
            try:
                row = next(self._prompts)
            except StopIteration:
                self._exhausted = True
                self._cv.notify_all()
                return None
            index, version = self._gate.admit()
            self.counts["admitted"] += 1
            if self._gate.running == 1:
                self._idle.stop()
            return index, version, row

    def _produce(self, index: int, version: int, row: object) -> None:
        params = self.params.with_overrides(seed=derive_seed(self._seed, index, SeedStream.PROMPT))
        try:
            prompt, columns = self._split(row)
            rollouts = self.backend.generate([prompt], n=self.n, sampling_params=params)
            group = self._score(index, row, prompt, columns, rollouts.samples, version)
        except (ValueError, RewardError) as err:
            if self._closed:  # cancelled by close(): not a failure of the group
                return
            kind = "failed_reward" if isinstance(err, RewardError) else "failed_generation"
            logger.warning("rollout group %d failed and was replaced (%s): %s", index, kind, err)
            with self._cv:
                self.counts[kind] += 1
                self._gate.fail(index)
                self._settled()
            return
        with self._cv:
            self._ready[index] = group
            self._gate.finish(index)
            self._settled()

    def _settled(self) -> None:
        """A group left the running set (caller holds the cv)."""
        self._last_progress = self.clock()
        if self._gate.running == 0:
            self._idle.start()
        self._cv.notify_all()

    def _split(self, row: object) -> tuple[Prompt, dict]:
        if isinstance(row, Mapping):
            if self.prompt_key not in row:
                raise ValueError(f"a prompt row has no {self.prompt_key!r} column (columns: {sorted(row)}); "
                                 "pass prompt_key=")
            return row[self.prompt_key], {k: v for k, v in row.items() if k != self.prompt_key}
        return row, {}

    def _score(self, index: int, row, prompt, columns: dict, samples: list[RolloutSample],
               version: int) -> ScoredGroup:
        if self._rewards is None:
            return ScoredGroup(index, row, samples, [], {}, version)
        size = len(samples)
        keywords = {k: [v] * size for k, v in columns.items()}
        keywords.update(prompts=[prompt] * size, completions=[s.text for s in samples],
                        completion_ids=[s.completion_ids for s in samples])
        rewards, per_function = self._rewards.score(keywords)
        return ScoredGroup(index, row, samples, rewards, per_function, version)


class _Stopwatch:
    """Accumulated time between start() and stop(); take() returns it and restarts the count."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock, self.total, self.since = clock, 0.0, None

    def start(self) -> None:
        if self.since is None:
            self.since = self.clock()

    def stop(self) -> None:
        if self.since is not None:
            self.total += self.clock() - self.since
            self.since = None

    def take(self) -> float:
        running = self.since is not None
        self.stop()
        total, self.total = self.total, 0.0
        if running:
            self.start()
        return total
