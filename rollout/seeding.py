"""Every seed the project derives from another, in one place.

A user gives one seed per request; the engine needs distinct, reproducible seeds for each prompt of a multi-prompt
request, each sample of an n-group and each drawn position. Each use is its own stream (a salt), so two uses never
collide: prompt 1's seed is not sample 1's seed. Python's hash of a tuple of ints is the same in every process and
run (no hash randomization for ints), which is what makes results repeatable across workers.
"""

from __future__ import annotations

from enum import IntEnum

SEED_MASK = 0x7FFF_FFFF_FFFF_FFFF  # 63 bits: fits an int64 and numpy's unsigned keys


class SeedStream(IntEnum):
    """What a derived seed is for (the value is the salt)."""

    SAMPLE = 0x6E  # sample `index` of an n-sample group
    PROMPT = 0x9E  # prompt `index` of a request (or generate call) with several prompts
    TURN = 0x7C  # turn `index` (>= 1) of a multi-turn episode (turn 0 keeps the episode's seed)
    NOISE = 0x5EED  # the uniform drawn for the token at absolute position `index`


def derive_seed(seed: int, index: int, stream: SeedStream) -> int:
    """The seed of item `index` of `stream` under `seed`.

    Item 0 of a group or of a multi-prompt request keeps `seed` itself, so a prompt sent alone and the first prompt of
    a batch (or the first sample of a group) draw the same tokens. Noise keys are always hashed.
    """
    if index == 0 and stream is not SeedStream.NOISE:
        return seed
    return hash((seed, index, int(stream))) & SEED_MASK
