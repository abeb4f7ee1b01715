"""The criteria: which heads and channels of a layer a rate removes (the registry).

Each scorer takes ``(lm, windows, batch_size, hooks)`` and returns one ``LayerScores`` per
block (higher = keep); ``prune.importance.compute_importance`` calls it. A criterion tagged
``windows`` reads calibration windows; the others score the weights alone. A criterion
tagged ``sequential`` has no scores of the dense model: it chooses units while pruning,
block by block on the pruned model (``obs``: SlimGPT), and its function prunes
``(lm, plan, windows, batch_size, hooks) -> PruneResult``. Tables and the allocators that
read scores take only the scoring ones (`SCORING_CRITERIA`); a plan may name any.
"""

from __future__ import annotations

from gap_engine.core import config
from gap_engine.core.registry import Choice, Registry

_CHOICES = (
    Choice("magnitude", "weight magnitude (no calibration text)", "gap_engine.prune.importance:magnitude_scores"),
    Choice("wanda", "weight magnitude times input activation norm (Wanda)", "gap_engine.prune.importance:wanda_scores", ("windows",)),
    Choice("flap", "input fluctuation times squared column norm (FLAP)", "gap_engine.prune.importance:flap_scores", ("windows",)),
    Choice(
        "taylor",
        "first-order Taylor saliency |W * grad| (one backward pass)",
        "gap_engine.prune.importance:taylor_scores",
        ("windows",),
    ),
    Choice(
        "obs",
        "SlimGPT: greedy structured OBS block by block on the pruned model, kept columns updated",
        "gap_engine.prune.sequential:obs_prune",
        ("windows", "sequential"),
    ),
)
CRITERIA = Registry("criterion", _CHOICES)
SCORING_CRITERIA = Registry("criterion", [c for c in _CHOICES if "sequential" not in c.tags])  # what tables score units by
# RatePlan (model layer, below this one) validates a plan's criterion against config.CRITERIA.
assert CRITERIA.names == config.CRITERIA, "config.CRITERIA must list the registered criteria"


def reads_windows(criterion: str) -> bool:
    """Whether ``criterion`` scores units on calibration windows."""
    return "windows" in CRITERIA[criterion].tags


def is_sequential(criterion: str) -> bool:
    """Whether ``criterion`` chooses units while pruning (no scores of the dense model)."""
    return "sequential" in CRITERIA[criterion].tags
