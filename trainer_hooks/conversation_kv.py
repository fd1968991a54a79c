"""ConversationKV: the engine KV of TRL's tool-calling loop carried from one generate call to the next.

TRL's tool loop (GRPOTrainer with `tools=`) generates, runs the tools, then calls generate again with prompt +
completion + tool-result tokens as the new prompts, concatenated as ids (no re-tokenization). Each such prompt
extends a sequence the engine just finished, so the adapter keeps the KV of every sequence it generates (keep_kv)
and submits a prompt that extends one of them as its continuation: only the tool-result tokens (and the completion's
last token) are prefilled, instead of the conversation's last partial KV page onwards through the prefix cache.
Sequences no later prompt extends are released at the next call, at the next weight sync, or when the cache needs the
blocks (kept KV is evictable).
"""

from __future__ import annotations

from collections.abc import Sequence

from rollout.rl.batch import RolloutBatch
from rollout.rl.generator import RolloutGenerator


class ConversationKV:
    """Kept sequences of the last generate call, by their tokens (prompt + completion; samples of a group may
    have produced the same tokens)."""

    def __init__(self, generator: RolloutGenerator) -> None:
        self.generator = generator
        self._kept: dict[tuple[int, ...], list[str]] = {}
        self._lengths: set[int] = set()

    def continues(self, prompts: Sequence[Sequence[int]]) -> list[str | None]:
        """For each prompt, the kept sequence it extends (None: a new conversation); the kept sequences no prompt
        extends are released."""
        found = []
        for prompt in prompts:
            sequence_id = None
            for length in sorted(self._lengths, reverse=True):
                same = self._kept.get(tuple(prompt[:length])) if length <= len(prompt) else None
                if same:
                    sequence_id = same.pop()
                    break
            found.append(sequence_id)
        self.release()
        return found

    def remember(self, batch: RolloutBatch) -> None:
        """Keep track of the sequences a call generated (their KV is kept by the engine)."""
        for s in batch.samples:
            self._kept.setdefault(tuple(s.prompt_ids + s.completion_ids), []).append(s.sequence_id)
        self._lengths = {len(key) for key in self._kept}

    def release(self) -> None:
        """Free the KV of every kept sequence (a new step, new weights, or no prompt extends them)."""
        if self._kept:
            self.generator.release_kv([rid for same in self._kept.values() for rid in same])
        self._kept.clear()
        self._lengths.clear()
