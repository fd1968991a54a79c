"""KV groups: which layers share one block table.

When every layer attends alike (all over every key, or all over one sliding window) one table serves them all: a
block is a page of every layer. In a hybrid (Gemma 2's alternating layers, Qwen2 with `max_window_layers`, Gemma 3's
five sliding layers per full one) a sliding layer needs only the pages its window reads while a full layer needs every
page, so the layers of each kind form groups with a table each: full groups keep every page, sliding groups give back
the pages behind their window. All groups have the same number of layers, and layer `i` of every group keeps its pages
in the same cache tensor (slot `i`), so a block, whichever group holds it, is one page of `num_slots` layers and one
pool of blocks serves every group.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

MAX_GROUPS = 8  # each group adds per-step table work; below this, fewer padded slots win over fewer groups


@dataclass(frozen=True)
class KVGroups:
    """The layers' grouping: each group's sliding window, and each layer's group and cache slot."""

    windows: tuple[int | None, ...]  # per group: the window its layers slide over (None: they read every key)
    layer_group: tuple[int, ...]  # per layer
    layer_slot: tuple[int, ...]  # per layer: the cache tensor holding its pages

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def num_slots(self) -> int:
        return max(self.layer_slot) + 1

    @classmethod
    def single(cls, num_layers: int, window: int | None = None) -> KVGroups:
        """Every layer in one group (slot = layer)."""
        return cls((window,), (0,) * num_layers, tuple(range(num_layers)))

    @classmethod
    def from_layer_windows(cls, windows: Sequence[int | None]) -> KVGroups:
        """Group layers by the window each one attends over (as a dry run saw them)."""
        kinds: dict[int | None, list[int]] = {}
        for layer, window in enumerate(windows):
            kinds.setdefault(window, []).append(layer)
        if len(kinds) == 1:
            return cls.single(len(windows), windows[0])
        size = _group_size([len(layers) for layers in kinds.values()])
        group_windows: list[int | None] = []
        layer_group = [0] * len(windows)
        layer_slot = [0] * len(windows)
        for window, layers in kinds.items():
            for start in range(0, len(layers), size):
                for slot, layer in enumerate(layers[start:start + size]):
                    layer_group[layer], layer_slot[layer] = len(group_windows), slot
                group_windows.append(window)
        return cls(tuple(group_windows), tuple(layer_group), tuple(layer_slot))


def _group_size(counts: list[int]) -> int:
    """Layers per group: the fewest padded slots (a kind's last group may have fewer layers than slots, whose pages
    then go unused) with at most MAX_GROUPS groups, and of those the fewest groups. Every kind fits: a group never
    has more layers than the smallest kind has."""
    best: tuple[int, int, int] | None = None
    for size in range(1, min(counts) + 1):
        groups = sum(-(-count // size) for count in counts)
        if groups > MAX_GROUPS and size < min(counts):
            continue
        candidate = (groups * size, groups, size)
        if best is None or candidate < best:
            best = candidate
    assert best is not None
    return best[2]
