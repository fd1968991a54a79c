"""StalenessGate: which rollout groups may start, and which must be trained on next, under `max_staleness`.

A group's staleness is how many weight versions its oldest token lags the trainer's weights when the trainer takes
it. Every token is at least as new as the version current when its group was admitted, so bounding `trainer version -
admission version` bounds the oldest token. Three rules keep that bound exact without generating anything that is
later thrown away (B groups per batch, S = max_staleness, u = weight updates pushed since the producer started):

1. Admission: a group may start only while the groups started so far (failed ones not counted) number fewer than
   (S + u + 1) * B. Groups admitted at version <= w then number at most (S + w + 1) * B: SkyRL's capacity rule.
2. Hand-out: the batch taken at version v must leave no group without a later batch to take it: for every j in
   0..S, at most j * B of the groups admitted at version <= v + j - S may stay untaken (the batches at v + 1 .. v + j
   take them). It picks those groups finished ones first, oldest first, and waits only when too few of them have
   finished; the rest of the batch is the finished groups admitted earliest. With rule 1 and one update per batch,
   the batch can always meet every j.
3. An update that would leave an untaken group too stale is refused (take the next batch first).

At the edge the trainer waits for the expiring groups to finish: a long tail delays one batch, it never drops a
sample. With S = 0 the rules reduce to synchronous RL (a batch is admitted only after the previous update).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class _Group:
    version: int  # the weight version current when it was admitted
    done: bool = False


class StalenessError(RuntimeError):
    """The trainer asked for something the staleness bound cannot give (e.g. two updates without a batch)."""


class StalenessGate:
    """The admission and hand-out ledger of one producer. Not thread-safe: the producer holds its lock around it."""

    def __init__(self, max_staleness: int, groups_per_batch: int, version: int) -> None:
        if isinstance(max_staleness, bool) or not isinstance(max_staleness, int) or max_staleness < 0:
            raise ValueError(f"max_staleness must be an int >= 0 (weight versions a sample may lag), got "
                             f"{max_staleness!r}")
        if isinstance(groups_per_batch, bool) or not isinstance(groups_per_batch, int) or groups_per_batch < 1:
            raise ValueError(f"groups_per_batch must be an int >= 1, got {groups_per_batch!r}")
        self.max_staleness = max_staleness
        self.groups_per_batch = groups_per_batch
        self.first_version = version
        self.version = version
        self._untaken: dict[int, _Group] = {}  # admitted, not failed, not yet handed out: by admission index
        self._live = 0  # admitted and not failed (running, finished or taken): what rule 1 counts
        self._next_index = 0

    # ------------------------------------------------------------ admission
    @property
    def capacity(self) -> int:
        return (self.max_staleness + self.version - self.first_version + 1) * self.groups_per_batch

    def can_admit(self) -> bool:
        return self._live < self.capacity

    def admit(self) -> tuple[int, int]:
        """Start a group: (its index, its admission version). Call only when `can_admit()`."""
        if not self.can_admit():
            raise StalenessError(f"no room to admit a group: {self._live} live of capacity {self.capacity}")
        index = self._next_index
        self._next_index += 1
        self._untaken[index] = _Group(self.version)
        self._live += 1
        return index, self.version

    def finish(self, index: int) -> None:
        self._untaken[index].done = True

    def fail(self, index: int) -> None:
        """The group will never be handed out: its slot goes back to admission."""
        del self._untaken[index]
        self._live -= 1

    # -------------------------------------------------------------- hand-out
    def expiring(self) -> list[int]:
        """Untaken groups whose last chance is the next batch (admitted at version <= current - max_staleness)."""
        return self._admitted_by(self.version - self.max_staleness)

    def choose(self, more_can_come: bool) -> list[int] | None:
        """The indices of the next batch, or None if it must wait. `more_can_come`: groups may still be admitted or
        are running, so a short batch waits (False at the end of the prompts: the rest is handed out)."""
        by_age = self._by_age()
        chosen: list[int] = []
        for j in range(self.max_staleness + 1):
            owed = self._admitted_by(self.version + j - self.max_staleness)
            deficit = len(owed) - j * self.groups_per_batch - sum(i in chosen for i in owed)
            finished = [i for i in by_age if i in owed and i not in chosen and self._untaken[i].done]
            if deficit > len(finished):
                return None  # the trainer waits for groups at their last chance
            chosen += finished[:max(0, deficit)]
        if len(chosen) > self.groups_per_batch:
            raise StalenessError(f"{len(chosen)} groups are owed to the next batch of {self.groups_per_batch}: "
                                 "weights were updated more often than batches were taken")
        others = [i for i in by_age if self._untaken[i].done and i not in chosen]
        chosen += others[:self.groups_per_batch - len(chosen)]
        if len(chosen) < self.groups_per_batch and (more_can_come or not chosen):
            return None
        return chosen

    def _by_age(self) -> list[int]:
        return sorted(self._untaken, key=lambda i: (self._untaken[i].version, i))

    def _admitted_by(self, version: int) -> list[int]:
        return sorted(i for i, g in self._untaken.items() if g.version <= version)

    def take(self, indices: list[int]) -> None:
        for index in indices:
            del self._untaken[index]

    # --------------------------------------------------------------- updates
    def check_update(self) -> None:
        """StalenessError if pushing a new version now would leave an untaken group beyond the bound."""
        stranded = self.expiring()
        if stranded:
            raise StalenessError(
                f"update_weights would push version {self.version + 1} while {len(stranded)} group(s) admitted at "
                f"version <= {self.version - self.max_staleness} were not taken yet: they would exceed max_staleness="
                f"{self.max_staleness}. Take the next batch before each update (one update per batch)")

    def updated(self, version: int) -> None:
        self.version = version

    # ---------------------------------------------------------------- status
    @property
    def running(self) -> int:
        return sum(not g.done for g in self._untaken.values())

    @property
    def ready(self) -> int:
        return sum(g.done for g in self._untaken.values())

    @property
    def untaken(self) -> int:
        return len(self._untaken)
