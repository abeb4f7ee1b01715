"""The criteria: which heads and channels of a layer a rate removes (the registry).

Each scorer, declared on its function in ``prune.importance``, takes ``(lm, windows, batch_size, hooks)`` and returns one ``LayerScores`` per
block (higher = keep); ``prune.importance.compute_importance`` calls it. A criterion tagged
``windows`` reads calibration windows; the others score the weights alone.
"""

from __future__ import annotations

from gap_engine.core import config
from gap_engine.core.registry import Registry

# Declared on the scorers (``@register("criterion", ...)``); RatePlan (model layer, below this one)
# validates a plan's criterion against config.CRITERIA, which must list them (tests/core/test_registry.py).
CRITERIA = Registry("criterion", ("gap_engine.prune.importance",), first=config.CRITERIA)


def reads_windows(criterion: str) -> bool:
    """Whether ``criterion`` scores units on calibration windows."""
    return "windows" in CRITERIA[criterion].tags
