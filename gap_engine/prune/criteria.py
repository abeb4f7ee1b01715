"""The criteria: which heads and channels of a layer a rate removes (the registry).

A scoring criterion's function takes ``(lm, windows, batch_size)`` and returns one
``LayerScores`` per block (higher = keep); ``prune.importance.compute_importance`` calls it.
A ``sequential`` criterion has no scores of the dense model: it chooses units while pruning,
block by block on the pruned model (``obs``: SlimGPT), and its function prunes
``(lm, plan, windows, batch_size, compensation=) -> PruneResult`` (``pipeline.stages`` calls it).
Neither takes progress hooks: its caller opens ``core.progress.reporting`` and its loops walk
``core.progress.steps``.
Tables and the allocators that read scores take only the scoring ones (`SCORING_CRITERIA`).
"""

from __future__ import annotations

from dataclasses import dataclass

from gap_engine.core.errors import PlanError
from gap_engine.core.registry import Registry, Strategy


@dataclass(frozen=True, kw_only=True)
class Criterion(Strategy):
    """A criterion: ``function`` scores units, or prunes a plan when ``sequential``."""

    score_passes: float  # what its scores cost, in forward passes over the calibration windows (the cost model)
    reads_windows: bool = False  # scores units on calibration windows (else the weights alone)
    sequential: bool = False  # chooses units while pruning: no scores of the dense model


CRITERIA: Registry[Criterion] = Registry(
    "criterion",
    Criterion,
    (
        Criterion("magnitude", "weight magnitude (no calibration text)", "gap_engine.prune.importance:magnitude_scores", score_passes=0.0),
        Criterion(
            "wanda", "weight magnitude times input activation norm (Wanda)", "gap_engine.prune.importance:wanda_scores",
            score_passes=1.0, reads_windows=True,
        ),
        Criterion(
            "flap", "input fluctuation times squared column norm (FLAP)", "gap_engine.prune.importance:flap_scores",
            score_passes=1.0, reads_windows=True,
        ),
        Criterion(
            "taylor", "first-order Taylor saliency |W * grad| (one backward pass)", "gap_engine.prune.importance:taylor_scores",
            score_passes=3.0, reads_windows=True,
        ),
        Criterion(
            "obs", "SlimGPT: greedy structured OBS block by block on the pruned model, kept columns updated",
            "gap_engine.prune.sequential:obs_prune", score_passes=1.0, reads_windows=True, sequential=True,
        ),
    ),
    PlanError,
)  # fmt: skip
# What tables score units by: every criterion but those that choose units while pruning.
SCORING_CRITERIA = CRITERIA.subset(lambda criterion: not criterion.sequential)


def reads_windows(criterion: str) -> bool:
    """Whether ``criterion`` scores units on calibration windows."""
    return CRITERIA[criterion].reads_windows


def is_sequential(criterion: str) -> bool:
    """Whether ``criterion`` chooses units while pruning (no scores of the dense model)."""
    return CRITERIA[criterion].sequential
