"""SequenceGroup: the n sequences one request asks for (their ids: `request.sequence_ids`).

A group shares its prompt's prefill: the leader (member 0) runs the prompt, and the others fork off its KV once the
leader's first token is sampled (shared full blocks, a copied partial block), each drawing from the same logits row
with its own seed. The scheduler owns that forking (identical prompts of other requests can join the same prefill);
this object only says which sequences belong to the request.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from rollout.engine.core.request import GROUP_SEPARATOR, Request, sequence_ids
from rollout.engine.sample.resolve import ResolvedSampling
from rollout.seeding import SeedStream, derive_seed


@dataclass
class SequenceGroup:
    """One request's sequences; `members[0]` leads the shared prefill."""

    request_id: str
    members: list[Request]
    num_live: int = field(init=False)  # members not finished yet, kept by the scheduler (O(1) per finish)

    def __post_init__(self) -> None:
        self.num_live = len(self.members)

    @classmethod
    def create(cls, request_id: str, prompt: list[int], sampling: ResolvedSampling, n: int,
               streaming: bool = False) -> SequenceGroup:
        """The group's sequences, ids and per-sample seeds (sample 0 keeps the request's seed)."""
        members = []
        for index, seq_id in enumerate(sequence_ids(request_id, n)):
            member_sampling = sampling
            if sampling.seed is not None and index:
                member_sampling = replace(sampling, seed=derive_seed(sampling.seed, index, SeedStream.SAMPLE))
            members.append(Request(seq_id, prompt, member_sampling, streaming=streaming))
        return cls(request_id, members)

    @property
    def leader(self) -> Request:
        return self.members[0]

    @property
    def ids(self) -> list[str]:
        return [m.request_id for m in self.members]

    def member_finished(self) -> bool:
        """Count one member as finished; True once none is left."""
        self.num_live -= 1
        return self.num_live == 0

    def live(self) -> list[Request]:
        """Members that have not finished."""
        return [m for m in self.members if not m.is_finished()]


__all__ = ["GROUP_SEPARATOR", "SequenceGroup", "sequence_ids"]
