"""Probabilities in whole units of 2^-40, for the steps that sum them: the top-p boundary (truncation.py) and the draw
(sampler.py, from log-probabilities).

Why: a sum of floats depends on its order, so a C kernel and a PyTorch path that add the same probabilities in another
order could disagree on a boundary and pick another token. Rounded down to units of 2^-40, a row's probabilities add
up exactly in int64 in any order (a 151,936-token row at most about 2^57), so the kernels (csrc/truncation.c,
csrc/draw.c) and the PyTorch paths pick the same tokens. What it gives up: a token below 2^-40 weighs nothing in those
sums (all of them together at most vocab * 2^-40, about 1.4e-7 of mass at 151,936 tokens).

The draw starts from log-probabilities, so it also fixes how exp is computed: a fixed sequence of float64 operations
(`lp_units`) that csrc/draw.c performs too, where a library exp may round its last bit otherwise on each CPU and
device.
"""

from __future__ import annotations

import math

import torch

MASS_UNITS = 2 ** 40


def mass_units(probs: torch.Tensor) -> torch.Tensor:
    """floor(p * 2^40) per probability as int64; p <= 0 and NaN weigh 0 (as in the C kernels)."""
    return (torch.where(probs > 0, probs, 0.0).double() * MASS_UNITS).long()


LOWEST_LP = -28.0  # exp(-28) * 2^40 < 1: lower log-probabilities weigh nothing and are not exponentiated
_INV_LN2 = float.fromhex("0x1.71547652b82fep0")
_LN2_HI = float.fromhex("0x1.62e42fee00000p-1")  # ln 2 = hi + lo, hi with zeros in its low bits: k * hi is exact
_LN2_LO = float.fromhex("0x1.a39ef35793c76p-33")
_TAYLOR = [1.0 / math.factorial(n) for n in range(11, -1, -1)]  # exp(r) to r^11, highest power first (Horner)
_POWERS = [2.0 ** -k for k in range(0, 42)]  # 2^k for the k of LOWEST_LP <= x <= 0 (exact scalings)


def lp_units(logprobs: torch.Tensor) -> torch.Tensor:
    """floor(exp(lp) * 2^40) per log-probability as int64, exp by one fixed sequence of float64 operations: x = k ln2
    + r with k = round(x / ln2) (ties to even), exp(r) by its Taylor polynomial to r^11 (Horner: one multiply, then
    one add), times 2^k. Below LOWEST_LP, and NaN, 0."""
    x = logprobs.double()
    live = x >= LOWEST_LP
    x = torch.where(live, x, 0.0).clamp_max(0.0)
    k = torch.round(x * _INV_LN2)
    r = (x - k * _LN2_HI) - k * _LN2_LO
    q = torch.full_like(r, _TAYLOR[0])
    for coefficient in _TAYLOR[1:]:
        q = q * r + coefficient
    scale = torch.tensor(_POWERS, dtype=torch.float64, device=x.device)[(-k).long()]
    return torch.where(live, (q * scale * MASS_UNITS).long(), 0)
