"""KV groups: layers of one attention kind share a block table; groups are the same size, so layer i of every group
can keep its pages in cache tensor i."""

import pytest

from rollout.engine.core.kv_groups import MAX_GROUPS, KVGroups


def _check(groups: KVGroups, windows: list) -> None:
    """Every layer is in a group of its own window, at a slot no other layer of that group uses."""
    assert len(groups.layer_group) == len(groups.layer_slot) == len(windows)
    for layer, window in enumerate(windows):
        assert groups.windows[groups.layer_group[layer]] == window
    places = list(zip(groups.layer_group, groups.layer_slot))
    assert len(set(places)) == len(places), "two layers of one group share a slot"
    assert all(0 <= slot < groups.num_slots for slot in groups.layer_slot)


@pytest.mark.parametrize("windows", [[None] * 4, [8] * 4])
def test_one_kind_of_attention_is_one_group_with_a_slot_per_layer(windows):
    groups = KVGroups.from_layer_windows(windows)
    assert groups == KVGroups.single(4, windows[0])
    assert groups.windows == (windows[0],) and groups.layer_slot == (0, 1, 2, 3) and groups.num_slots == 4


def test_alternating_layers_make_two_groups_sharing_each_slot():  # Gemma 2
    windows = [4096, None] * 13
    groups = KVGroups.from_layer_windows(windows)
    _check(groups, windows)
    assert groups.windows == (4096, None) and groups.num_slots == 13


def test_five_sliding_layers_per_full_one():  # Gemma 3 1B: 26 layers, full at 5, 11, 17, 23
    windows = [None if layer % 6 == 5 else 512 for layer in range(26)]
    groups = KVGroups.from_layer_windows(windows)
    _check(groups, windows)
    # 22 sliding and 4 full layers: groups of 4 (6 sliding groups, 2 slots unused, and 1 full) beat groups of 2 or 1,
    # which would need more than MAX_GROUPS tables
    assert groups.num_slots == 4 and groups.windows == (512,) * 6 + (None,)
    assert groups.num_groups <= MAX_GROUPS


def test_unequal_kinds_take_the_size_that_pads_least():  # Qwen2 with max_window_layers=13 of 24
    windows = [None] * 13 + [4096] * 11
    groups = KVGroups.from_layer_windows(windows)
    _check(groups, windows)
    # size 7: 2 full + 2 sliding groups, 28 slots for 24 layers (size 11 would pad to 33, size 4 ties at 28 with 7
    # groups)
    assert groups.num_slots == 7 and groups.windows == (None, None, 4096, 4096)


def test_more_kinds_than_groups_allowed_still_fit():
    windows = list(range(10, 20))  # ten windows, one layer each
    groups = KVGroups.from_layer_windows(windows)
    _check(groups, windows)
    assert groups.num_groups == 10 and groups.num_slots == 1
