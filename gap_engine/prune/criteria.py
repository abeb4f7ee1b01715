"""The criteria: which heads and channels of a layer a rate removes (the registry).

Each scorer, declared on its function in ``prune.importance``, takes ``(lm, windows, batch_size, hooks)`` and returns one ``LayerScores`` per
block (higher = keep); ``prune.importance.compute_importance`` calls it. A criterion tagged
``windows`` reads calibration windows; the others score the weights alone. A criterion
tagged ``sequential`` has no scores of the dense model: it chooses units while pruning,
block by block on the pruned model (``obs``: SlimGPT), and its function prunes
``(lm, plan, windows, batch_size, hooks) -> PruneResult``. Tables and the allocators that
read scores take only the scoring ones (`SCORING_CRITERIA`); a plan may name any.
"""

from __future__ import annotations

from gap_engine.core import config
from gap_engine.core.registry import Registry

# Declared on the functions (``@register("criterion", ...)``); RatePlan (model layer, below this
# one) validates a plan's criterion against config.CRITERIA, which must list them (tests/core/test_registry.py).
CRITERIA = Registry("criterion", ("gap_engine.prune.importance", "gap_engine.prune.sequential"), first=config.CRITERIA)
# What tables score units by: every criterion but those that choose units while pruning (tag sequential).
SCORING_CRITERIA = Registry(
    "criterion", ("gap_engine.prune.importance",), first=[name for name in config.CRITERIA if "sequential" not in CRITERIA[name].tags]
)


def reads_windows(criterion: str) -> bool:
    """Whether ``criterion`` scores units on calibration windows."""
    return "windows" in CRITERIA[criterion].tags


def is_sequential(criterion: str) -> bool:
    """Whether ``criterion`` chooses units while pruning (no scores of the dense model)."""
    return "sequential" in CRITERIA[criterion].tags
