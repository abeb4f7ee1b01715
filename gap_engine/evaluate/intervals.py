"""Paired bootstrap intervals for the margin between two pruned models measured on the same windows.

Two methods evaluated on the same held-out windows give paired per-window numbers: window ``w``
of source ``s`` is hard or easy for both. A margin is judged by resampling *windows*, jointly for
the two methods (the same drawn indices index both), within each source (a source keeps its own
window count), and recomputing the margin on every resample; the 95% interval is the 2.5th and
97.5th percentile of the resampled margins (Efron and Tibshirani, *An Introduction to the
Bootstrap*, 1993, ch. 13: the percentile interval). Every window of one source must count the
same number of tokens, so the mean of window means is the mean over tokens.

Two margins, both written as ``baseline / method`` so that above 1 means the method is better:

- :func:`ratio_of_means`: mean KL to dense of the baseline over the method's, the mean over
  sources of each source's mean over windows;
- :func:`perplexity_ratio`: the baseline's perplexity over the method's, ``exp`` of the mean
  NLL difference (per token, mean over sources of each source's mean over windows). On one
  source that is exactly the ratio of the two perplexities; over several it is the ratio of
  their geometric means.

A margin is *met* when its whole interval lies above 1, a *loss* when it lies below 1, and a
*tie* when it contains 1 (:meth:`Interval.verdict`). One method's own number gets the same
resampling (:func:`mean_interval`, :func:`perplexity_interval`), for tables that show a mean with
its interval. numpy only: no torch, no I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from gap_engine.core.errors import DataError, InvariantError

DEFAULT_RESAMPLES = 2000
DEFAULT_LEVEL = 0.95

FloatArray = npt.NDArray[np.float64]


@dataclass(frozen=True)
class Interval:
    """A margin (``baseline / method``: above 1, the method is better) and its bootstrap interval."""

    estimate: float  # the margin on the windows as measured
    low: float  # lower end of the interval
    high: float  # upper end of the interval

    def verdict(self) -> str:
        """``met`` when the interval lies above 1, ``loss`` when below, ``tie`` when it contains 1."""
        if self.low > 1.0:
            return "met"
        if self.high < 1.0:
            return "loss"
        return "tie"

    def text(self, digits: int = 3) -> str:
        """``estimate [low, high]`` to ``digits`` decimals."""
        return f"{self.estimate:.{digits}f} [{self.low:.{digits}f}, {self.high:.{digits}f}]"


def ratio_of_means(
    baseline: Sequence[Sequence[float]],
    method: Sequence[Sequence[float]],
    resamples: int = DEFAULT_RESAMPLES,
    seed: int = 0,
    level: float = DEFAULT_LEVEL,
) -> Interval:
    """The baseline's mean over the method's (mean over sources of per-source window means), with
    its paired bootstrap interval.

    Args:
        baseline, method: per source, the per-window numbers (e.g. mean KL to dense per token of
            each window); ``baseline[s][w]`` and ``method[s][w]`` are the same window.
        resamples: bootstrap resamples.
        seed: the resampling's seed (same seed, same interval).
        level: the interval's coverage.
    Raises:
        InvariantError: the two are not paired (another number of sources or windows).
        DataError: a number is not finite, or the method's mean is not positive.
    """
    base, meth = _paired(baseline, method)
    if np.mean([row.mean() for row in meth]) <= 0:
        raise DataError("a ratio of means needs a positive denominator")

    def margin(means: FloatArray) -> FloatArray:  # means: (2, S, R)
        ratio: FloatArray = means[0].mean(axis=0) / means[1].mean(axis=0)
        return ratio

    return _bootstrap([base, meth], margin, resamples, seed, level)


def perplexity_ratio(
    baseline_nll: Sequence[Sequence[float]],
    method_nll: Sequence[Sequence[float]],
    resamples: int = DEFAULT_RESAMPLES,
    seed: int = 0,
    level: float = DEFAULT_LEVEL,
) -> Interval:
    """``exp`` of the baseline's mean NLL minus the method's (mean over sources of per-source
    window means): the ratio of their perplexities (of their geometric means over sources), with
    its paired bootstrap interval. Arguments as :func:`ratio_of_means`, the numbers being each
    window's mean NLL per token."""
    base, meth = _paired(baseline_nll, method_nll)

    def margin(means: FloatArray) -> FloatArray:
        ratio: FloatArray = np.exp(means[0].mean(axis=0) - means[1].mean(axis=0))
        return ratio

    return _bootstrap([base, meth], margin, resamples, seed, level)


def mean_interval(
    values: Sequence[Sequence[float]], resamples: int = DEFAULT_RESAMPLES, seed: int = 0, level: float = DEFAULT_LEVEL
) -> Interval:
    """One method's mean (mean over sources of per-source window means, e.g. KL to dense) with its
    bootstrap interval over windows (its verdict means nothing: it is not a ratio)."""
    (rows,) = _paired(values, values)[:1]

    def mean(means: FloatArray) -> FloatArray:
        value: FloatArray = means[0].mean(axis=0)
        return value

    return _bootstrap([rows], mean, resamples, seed, level)


def perplexity_interval(
    nll: Sequence[Sequence[float]], resamples: int = DEFAULT_RESAMPLES, seed: int = 0, level: float = DEFAULT_LEVEL
) -> Interval:
    """One method's perplexity, ``exp`` of its mean NLL (mean over sources of per-source window
    means: the geometric mean of the sources' perplexities), with its bootstrap interval."""
    (rows,) = _paired(nll, nll)[:1]

    def perplexity(means: FloatArray) -> FloatArray:
        value: FloatArray = np.exp(means[0].mean(axis=0))
        return value

    return _bootstrap([rows], perplexity, resamples, seed, level)


def _paired(baseline: Sequence[Sequence[float]], method: Sequence[Sequence[float]]) -> tuple[list[FloatArray], list[FloatArray]]:
    base = [np.asarray(row, dtype=np.float64) for row in baseline]
    meth = [np.asarray(row, dtype=np.float64) for row in method]
    if not base or len(base) != len(meth):
        raise InvariantError(f"paired numbers need the same sources: {len(base)} against {len(meth)}")
    for s, (b, m) in enumerate(zip(base, meth)):
        if b.ndim != 1 or b.shape != m.shape or b.size == 0:
            raise InvariantError(f"source {s}: paired numbers need the same windows, got shapes {b.shape} and {m.shape}")
        if not (np.isfinite(b).all() and np.isfinite(m).all()):
            raise DataError(f"source {s}: a per-window number is not finite")
    return base, meth


def _bootstrap(
    series: list[list[FloatArray]],
    statistic: Callable[[FloatArray], FloatArray],
    resamples: int,
    seed: int,
    level: float,
) -> Interval:
    """``statistic`` of the per-source means, (K, S, R) -> (R,), as measured and over resamples that
    draw each source's windows with replacement, one draw for all K paired series."""
    if not isinstance(resamples, int) or resamples < 1:
        raise InvariantError(f"resamples must be a positive integer, got {resamples!r}")
    if not 0.0 < level < 1.0:
        raise InvariantError(f"the interval's level must lie in (0, 1), got {level!r}")
    rng = np.random.default_rng(seed)
    n_sources = len(series[0])
    means = np.empty((len(series), n_sources, resamples))  # (K, S, R)
    for s in range(n_sources):
        drawn = rng.integers(0, series[0][s].size, size=(resamples, series[0][s].size))  # (R, W_s): one draw for every series
        for k, rows in enumerate(series):
            means[k, s] = rows[s][drawn].mean(axis=1)
    measured = statistic(np.array([[[rows[s].mean()] for s in range(n_sources)] for rows in series]))
    tail = (1.0 - level) / 2.0
    low, high = np.quantile(statistic(means), [tail, 1.0 - tail])
    return Interval(float(measured[0]), float(low), float(high))
