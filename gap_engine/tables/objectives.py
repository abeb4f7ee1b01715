"""The objectives: what a loss-table cell measures (the registry).

Each function takes ``(logits, input_ids, dense_logprobs, start)`` and returns the objective
summed over each window's counted positions, (B,) (``tables.cells.objective_per_window``).
"""

from __future__ import annotations

from dataclasses import dataclass

from gap_engine.core.errors import TableError
from gap_engine.core.registry import Registry, Strategy


@dataclass(frozen=True)
class TableObjective(Strategy):
    """A table objective: ``function`` is its per-window sum."""


OBJECTIVES: Registry[TableObjective] = Registry(
    "table objective",
    TableObjective,
    (
        TableObjective(
            "nll", "next-token loss: the increase of the mean NLL over the dense model", "gap_engine.tables.cells:nll_per_window"
        ),
        TableObjective("kl", "KL(dense || pruned) of the next-token distributions", "gap_engine.tables.cells:kl_per_window"),
    ),
    TableError,
)
