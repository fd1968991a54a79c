"""Spreading a batch's prompt groups over workers, balanced by queued tokens.

A group (the n samples of one prompt) never splits: its prompt is prefilled once and its KV blocks are shared, which
only works inside one engine. What a group adds to a worker's queue is estimated before it runs: its prompt once
plus the most its samples can decode. Longest-first greedy assignment (each group, largest first, to the worker
with the fewest queued tokens) keeps the most loaded worker within one group of the best split, which is what
bounds a batch's wall time.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import TypeVar

W = TypeVar("W", bound=Hashable)


def group_cost(prompt_tokens: int, size: int, max_new_tokens: int) -> int:
    """Tokens a group queues on its worker: the prompt (prefilled once for the group) and every sample's decode."""
    return prompt_tokens + size * max_new_tokens


def spread(costs: Sequence[int], loads: Mapping[W, int]) -> dict[W, list[int]]:
    """Group indices per worker, each list in input order; every worker of `loads` is a key (maybe with no group).

    `loads`: tokens each worker already has queued (its insertion order breaks ties, so the result is
    deterministic). Raises ValueError when there is no worker to give groups to.
    """
    if not loads:
        raise ValueError("no worker to spread the groups over")
    queued = dict(loads)
    order = list(queued)
    assigned: dict[W, list[int]] = {worker: [] for worker in order}
    for index in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        worker = min(order, key=lambda w: queued[w])
        assigned[worker].append(index)
        queued[worker] += costs[index]
    return {worker: sorted(groups) for worker, groups in assigned.items()}
