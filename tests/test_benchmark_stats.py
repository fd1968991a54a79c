"""The paired-ratio statistic the serving benchmark reports (benchmarks/common.paired_ratio)."""

import math

import pytest

from benchmarks.common import paired_ratio


def test_equal_ratios_have_no_spread():
    mean, lo, hi = paired_ratio([2.0, 4.0, 8.0], [1.0, 2.0, 4.0])
    assert mean == pytest.approx(2.0) and lo == pytest.approx(2.0) and hi == pytest.approx(2.0)


def test_the_interval_is_the_t_interval_of_the_log_ratios():
    ours, peer = [1.1, 0.9, 1.2, 1.0], [1.0, 1.0, 1.0, 1.0]
    logs = [math.log(x) for x in ours]
    mean = sum(logs) / 4
    sd = math.sqrt(sum((x - mean) ** 2 for x in logs) / 3)
    half = 3.182 * sd / 2  # t(0.975, 3 degrees of freedom) * sd / sqrt(4)
    got = paired_ratio(ours, peer)
    assert got == pytest.approx((math.exp(mean), math.exp(mean - half), math.exp(mean + half)))
    assert got[1] < 1.0 < got[2]  # this spread cannot tell the servers apart


def test_drift_shared_by_both_servers_cancels():
    """Both servers slowed by the same factor in a round: the paired ratio sees none of it."""
    drift = [1.0, 0.7, 1.3, 0.8, 1.1]
    mean, lo, hi = paired_ratio([1.05 * d for d in drift], drift)
    assert mean == pytest.approx(1.05) and hi - lo == pytest.approx(0.0, abs=1e-12)


def test_one_pair_has_no_interval_and_bad_input_is_refused():
    mean, lo, hi = paired_ratio([3.0], [2.0])
    assert mean == pytest.approx(1.5) and math.isnan(lo) and math.isnan(hi)
    with pytest.raises(ValueError, match="equally long"):
        paired_ratio([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="non-empty"):
        paired_ratio([], [])
