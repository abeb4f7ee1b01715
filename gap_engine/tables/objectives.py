"""The objectives: what a loss-table cell measures (the registry).

Each function takes ``(logits, input_ids, dense_logprobs, start)`` and returns the objective
summed over each window's counted positions, (B,) (``tables.cells.objective_per_window``).
"""

from __future__ import annotations

from gap_engine.core.errors import TableError
from gap_engine.core.registry import Choice, Registry

OBJECTIVES = Registry(
    "table objective",
    [
        Choice("nll", "next-token loss: the increase of the mean NLL over the dense model", "gap_engine.tables.cells:nll_per_window"),
        Choice("kl", "KL(dense || pruned) of the next-token distributions", "gap_engine.tables.cells:kl_per_window"),
    ],
    TableError,
)
