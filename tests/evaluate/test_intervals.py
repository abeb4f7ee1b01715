"""The paired bootstrap (gap_engine.evaluate.intervals): hand-checked cases and its properties."""

from __future__ import annotations

import math

import numpy as np
import pytest

from gap_engine.core.errors import DataError, InvariantError
from gap_engine.evaluate.intervals import Interval, mean_interval, perplexity_interval, perplexity_ratio, ratio_of_means


def test_identical_numbers_give_the_interval_one_to_one():
    rng = np.random.default_rng(3)
    kl = [rng.gamma(2.0, 0.3, size=24), rng.gamma(2.0, 0.5, size=26)]
    assert ratio_of_means(kl, kl) == Interval(1.0, 1.0, 1.0)
    nll = [rng.normal(3.5, 0.4, size=24), rng.normal(3.9, 0.4, size=26)]
    assert perplexity_ratio(nll, nll) == Interval(1.0, 1.0, 1.0)
    assert ratio_of_means(kl, kl).verdict() == "tie"


def test_two_windows_by_hand():
    # Method 1 on both windows, baseline 1 and 3: a resample draws (1,1), (1,3), (3,1) or (3,3)
    # with probability 1/4 each, so the ratio is 1, 2 or 3 with probability 1/4, 1/2, 1/4: its
    # 2.5th percentile is 1 and its 97.5th is 3; as measured, 2.
    interval = ratio_of_means([[1.0, 3.0]], [[1.0, 1.0]], resamples=4000)
    assert interval == Interval(2.0, 1.0, 3.0)
    assert interval.verdict() == "tie"
    # The same windows as NLL: the perplexity ratio is exp(0), exp(1) or exp(2).
    nll = perplexity_ratio([[1.0, 3.0]], [[1.0, 1.0]], resamples=4000)
    assert nll.estimate == pytest.approx(math.e) and nll.low == pytest.approx(1.0) and nll.high == pytest.approx(math.e**2)


def test_resampling_is_paired_and_within_each_source():
    rng = np.random.default_rng(0)
    method = [rng.gamma(2.0, 0.3, size=24), rng.gamma(2.0, 0.3, size=30)]
    # Every window 10% worse: a paired resample keeps the ratio at 1.1, an unpaired one would not.
    interval = ratio_of_means([1.1 * m for m in method], method)
    assert interval.low == pytest.approx(1.1, abs=1e-12) and interval.high == pytest.approx(1.1, abs=1e-12)
    assert interval.verdict() == "met"
    # Sources resampled apart: constant windows within a source leave nothing to resample.
    baseline = [np.full(24, 1.0), np.full(30, 3.0)]
    assert ratio_of_means(baseline, [np.ones(24), np.ones(30)]) == Interval(2.0, 2.0, 2.0)


def test_noise_widens_the_interval_and_a_clear_loss_is_a_loss():
    rng = np.random.default_rng(1)
    method = rng.gamma(2.0, 0.5, size=24)
    noisy = method * rng.lognormal(0.0, 0.3, size=24)
    wide = ratio_of_means([noisy], [method])
    assert wide.low < wide.estimate < wide.high
    assert wide.high - wide.low > 0.1
    assert ratio_of_means([0.5 * method], [method]).verdict() == "loss"


def test_same_seed_same_interval_other_seed_other_interval():
    rng = np.random.default_rng(2)
    a, b = [rng.gamma(2.0, 0.5, size=24)], [rng.gamma(2.0, 0.5, size=24)]
    assert ratio_of_means(a, b, seed=5) == ratio_of_means(a, b, seed=5)
    assert ratio_of_means(a, b, seed=5) != ratio_of_means(a, b, seed=6)


def test_verdicts_and_text():
    assert Interval(1.2, 1.05, 1.3).verdict() == "met"
    assert Interval(0.8, 0.7, 0.95).verdict() == "loss"
    assert Interval(1.01, 0.98, 1.04).verdict() == "tie"
    assert Interval(1.0, 1.0, 1.0).verdict() == "tie"
    assert Interval(1.23456, 1.1, 1.4).text() == "1.235 [1.100, 1.400]"


def test_unpaired_or_broken_numbers_are_refused():
    with pytest.raises(InvariantError, match="same windows"):
        ratio_of_means([[1.0, 2.0]], [[1.0, 2.0, 3.0]])
    with pytest.raises(InvariantError, match="same sources"):
        ratio_of_means([[1.0], [2.0]], [[1.0]])
    with pytest.raises(DataError, match="not finite"):
        perplexity_ratio([[1.0, math.inf]], [[1.0, 2.0]])
    with pytest.raises(DataError, match="positive denominator"):
        ratio_of_means([[1.0]], [[0.0]])


def test_one_methods_mean_and_perplexity_by_hand():
    # Windows 1 and 3: resampled means 1, 2, 3 with probability 1/4, 1/2, 1/4.
    assert mean_interval([[1.0, 3.0]], resamples=4000) == Interval(2.0, 1.0, 3.0)
    ppl = perplexity_interval([[1.0, 3.0]], resamples=4000)
    assert ppl.estimate == pytest.approx(math.e**2) and ppl.low == pytest.approx(math.e) and ppl.high == pytest.approx(math.e**3)
    # Two sources: the geometric mean of their perplexities, exp(mean of their mean NLLs).
    assert perplexity_interval([[2.0] * 24, [4.0] * 26]) == Interval(math.exp(3.0), math.exp(3.0), math.exp(3.0))
