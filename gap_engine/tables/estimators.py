"""The estimators: how a loss table is filled (the registry).

``exact`` measures every distinct cell (the cell fillers of ``tables.exact``, ``streaming`` and
``distributed``); ``fisher`` and ``taylor`` estimate every cell from one gradient pass
(``tables.estimate``); ``refine`` starts from the fisher estimate and measures exactly the
cells the DP's plans use (``tables.refine``). Cells are measured by the estimators tagged
``cells``; the others read gradients (tag ``gradient``). Each entry's function is the
estimator's table filler (``ledger.TableFiller``), which ``build.measure_table`` calls: adding
an estimator is one entry here and the function it names.
"""

from __future__ import annotations

from gap_engine.core.errors import TableError
from gap_engine.core.registry import Choice, Registry

# Fastest first: the order selectors list them in.
ESTIMATORS = Registry(
    "table estimator",
    [
        Choice(
            "fisher",
            "fast: second-order estimate (one forward and backward pass)",
            "gap_engine.tables.estimate:fill_estimated",
            ("gradient",),
        ),
        Choice(
            "taylor",
            "fast: first-order estimate (one forward and backward pass)",
            "gap_engine.tables.estimate:fill_estimated",
            ("gradient",),
        ),
        Choice(
            "refine",
            "trusted: the fisher estimate, then every cell the plans use measured exactly (minutes)",
            "gap_engine.tables.refine:fill_refined",
            ("gradient", "cells"),
        ),
        Choice("exact", "exact: measured cell by cell (slow: minutes to hours)", "gap_engine.tables.exact_fill:fill_exact", ("cells",)),
    ],
    TableError,
)
