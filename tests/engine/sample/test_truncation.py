"""Top-p without a sort: the C kernel's radix select keeps exactly the tokens the rule names, the same as the PyTorch
path (a stable sort and an integer cumulative sum), on rows built to put ties, zeros and NaNs at the boundary."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import GenerationConfig

from rollout.engine.cpu import kernel
from rollout.engine.sample import truncation
from rollout.engine.sample.resolve import ResolvedSampling, resolve_sampling
from rollout.engine.sample.units import MASS_UNITS
from rollout.sampling_params import SamplingParams

KERNEL = kernel.load_kernel() is not None


def units(p: float) -> int:
    return int(p * MASS_UNITS) if p > 0 else 0  # p <= 0 and NaN weigh nothing


def rule(row: list[float], budget: int) -> list[bool]:
    """The rule in plain Python: order by probability descending then index, keep while the mass before is below the
    budget, the first always."""
    clean = [p if p > 0 else 0.0 for p in row]
    order = sorted(range(len(row)), key=lambda i: (-clean[i], i))
    keep, before = [False] * len(row), 0
    for rank, i in enumerate(order):
        keep[i] = rank == 0 or before < budget
        before += units(clean[i])
    return keep


def torch_path(probs: torch.Tensor, budgets: torch.Tensor) -> torch.Tensor:
    with mock.patch.object(truncation, "top_p_keep", lambda *args: None):
        return truncation.row_top_p_keep(probs, budgets)


def adversarial_rows(seed: int, rows: int, vocab: int) -> torch.Tensor:
    """Probabilities with many exact ties (coarse grid), zeros, and now and then a NaN or a negative value."""
    g = torch.Generator().manual_seed(seed)
    probs = torch.softmax(torch.randn(rows, vocab, generator=g) * 3, dim=-1)
    probs[1::3] = (probs[1::3] * 32).floor() / 32  # ties, and zeros below 1/32
    probs[2::3, ::5] = 0.0
    if vocab > 3:
        probs[0, 3] = float("nan")
        probs[-1, 1] = -0.25
    return probs


@st.composite
def cases(draw):
    vocab = draw(st.integers(1, 600))
    rows = draw(st.integers(1, 6))
    seed = draw(st.integers(0, 2 ** 16))
    fractions = draw(st.lists(st.sampled_from([0.0, 1e-13, 0.1, 0.5, 0.9, 0.95, 0.999999, 1.0, 2.0]),
                              min_size=rows, max_size=rows))
    return adversarial_rows(seed, rows, vocab), [int(f * MASS_UNITS) for f in fractions]


@settings(max_examples=150, deadline=None)
@given(cases())
def test_top_p_keeps_the_prefix_the_rule_names(case):
    probs, budgets = case
    expected = [rule(row, budget) for row, budget in zip(probs.tolist(), budgets, strict=True)]
    assert truncation.row_top_p_keep(probs, torch.tensor(budgets)).tolist() == expected  # the kernel where built
    assert torch_path(probs, torch.tensor(budgets)).tolist() == expected


@pytest.mark.skipif(not KERNEL, reason="no kernel library on this machine: the PyTorch path is the only one")
@pytest.mark.parametrize("vocab", [1, 2, 7, 4096, 151_936])
@pytest.mark.parametrize("top_p", [0.0, 0.3, 0.95, 0.9999999])
def test_the_kernel_and_the_torch_path_keep_the_same_tokens(vocab, top_p):
    probs = adversarial_rows(vocab, 6, vocab)
    budgets = torch.full((6,), int(top_p * MASS_UNITS))
    fast = kernel.top_p_keep(probs, budgets)
    assert fast is not None  # the kernel serves it: the comparison below is not the torch path against itself
    assert torch.equal(fast, torch_path(probs, budgets))


@pytest.mark.skipif(not KERNEL, reason="no kernel library on this machine")
def test_the_kernel_keeps_ties_at_the_boundary_by_token_id():
    probs = torch.tensor([[0.25, 0.125, 0.25, 0.25, 0.125]])
    # mass before in units of 1/4: the three quarters at ids 0, 2, 3 come first, then the eighths at 1 and 4
    cases = {0.0: [0], 0.25: [0], 0.26: [0, 2], 0.5: [0, 2], 0.75: [0, 2, 3], 0.8: [0, 2, 3, 1], 0.9: [0, 1, 2, 3, 4]}
    for top_p, kept in cases.items():
        keep = kernel.top_p_keep(probs, torch.tensor([int(top_p * MASS_UNITS)]))
        assert keep[0].nonzero().flatten().tolist() == sorted(kept), top_p


def test_a_bad_budget_is_refused():
    if not KERNEL:
        pytest.skip("no kernel library on this machine")
    with pytest.raises(ValueError, match="one int64 CPU budget per row"):
        kernel.top_p_keep(torch.rand(3, 10), torch.tensor([1, 2], dtype=torch.int64))
    with pytest.raises(ValueError, match="one int64 CPU budget per row"):
        kernel.top_p_keep(torch.rand(2, 10), torch.tensor([1.0, 2.0]))


def test_the_kernel_declines_what_it_does_not_serve():
    budgets = torch.tensor([5, 5], dtype=torch.int64)
    assert kernel.top_p_keep(torch.rand(2, 10, dtype=torch.float64), budgets) is None
    assert kernel.top_p_keep(torch.rand(2, 3, 10), budgets) is None


def resolved(**kwargs) -> ResolvedSampling:
    return resolve_sampling(SamplingParams(**kwargs), GenerationConfig())


@pytest.mark.parametrize("vocab", [50, 151_936])
def test_the_mask_of_mixed_rows_is_the_same_on_both_paths(vocab, monkeypatch):
    g = torch.Generator().manual_seed(vocab)
    scaled = torch.randn(6, vocab, generator=g) * 2
    scaled[1, : vocab // 2] = scaled[1, 0]  # a tie across half the row
    settings_ = [dict(top_p=0.9), dict(top_k=20, top_p=0.5), dict(top_k=3), dict(min_p=0.2, top_p=0.95),
                 dict(temperature=0.0, top_p=0.5), dict(top_k=0, top_p=1.0)]
    settings_ = [{"temperature": 1.0, **kw} for kw in settings_]
    params = [resolved(**kw) for kw in settings_]
    fast = truncation.truncation_mask(scaled, params)
    with monkeypatch.context() as patch:
        patch.setattr(truncation, "top_p_keep", lambda *args: None)
        slow = truncation.truncation_mask(scaled, params)
    assert torch.equal(fast, slow)
    assert fast[4].all() and fast[5].all()  # greedy and untruncated rows keep everything
    assert fast[2].sum() == 3
    assert 0 < fast[0].sum() < vocab
