"""The criteria: which heads and channels of a layer a rate removes (the registry).

Each scorer takes ``(lm, windows, batch_size, hooks)`` and returns one ``LayerScores`` per
block (higher = keep); ``prune.importance.compute_importance`` calls it. A criterion tagged
``windows`` reads calibration windows; the others score the weights alone.
"""

from __future__ import annotations

from gap_engine.core import config
from gap_engine.core.errors import InvariantError
from gap_engine.core.registry import Choice, Registry

CRITERIA = Registry(
    "criterion",
    [
        Choice("magnitude", "weight magnitude (no calibration text)", "gap_engine.prune.importance:magnitude_scores"),
        Choice("wanda", "weight magnitude times input activation norm (Wanda)", "gap_engine.prune.importance:wanda_scores", ("windows",)),
        Choice("flap", "input fluctuation times squared column norm (FLAP)", "gap_engine.prune.importance:flap_scores", ("windows",)),
        Choice(
            "taylor",
            "first-order Taylor saliency |W * grad| (one backward pass)",
            "gap_engine.prune.importance:taylor_scores",
            ("windows",),
        ),
    ],
)
# RatePlan (model layer, below this one) validates a plan's criterion against config.CRITERIA.
if CRITERIA.names != config.CRITERIA:
    raise InvariantError("config.CRITERIA does not list the registered criteria")


def reads_windows(criterion: str) -> bool:
    """Whether ``criterion`` scores units on calibration windows."""
    return "windows" in CRITERIA[criterion].tags
