"""The estimators: how a loss table is filled (the registry).

``exact`` measures every distinct cell (the cell fillers of ``tables.exact``, ``streaming`` and
``distributed``); ``fisher`` and ``taylor`` estimate every cell from one gradient pass
(``tables.estimate``); ``refine`` starts from the fisher estimate and measures exactly the
cells the DP's plans use (``tables.refine``). Cells are measured by the estimators tagged
``cells``; the others read gradients (tag ``gradient``).
"""

from __future__ import annotations

from gap_engine.core.errors import TableError
from gap_engine.core.registry import Choice, Registry

# Fastest first: the order selectors list them in.
ESTIMATORS = Registry(
    "table estimator",
    [
        Choice("fisher", "fast: second-order estimate (one forward and backward pass)", "gap_engine.tables.estimate:estimate_cells", ("gradient",)),
        Choice("taylor", "fast: first-order estimate (one forward and backward pass)", "gap_engine.tables.estimate:estimate_cells", ("gradient",)),
        Choice(
            "refine",
            "trusted: the fisher estimate, then every cell the plans use measured exactly (minutes)",
            "gap_engine.tables.refine:refine_cells",
            ("gradient", "cells"),
        ),
        Choice("exact", "exact: measured cell by cell (slow: minutes to hours)", "gap_engine.tables.exact:measure_exact", ("cells",)),
    ],
    TableError,
)
