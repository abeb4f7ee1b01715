"""The estimators: how a loss table is filled (the registry).

``exact`` measures every distinct cell (the cell fillers of ``tables.exact``, ``streaming`` and
``distributed``); ``fisher`` and ``taylor`` estimate every cell from one gradient pass
(``tables.estimate``); ``refine`` starts from the fisher estimate and measures exactly the
cells the DP's plans use (``tables.refine``). Cells are measured by the estimators tagged
``cells``; the others read gradients (tag ``gradient``). Each entry's function is the
estimator's table filler (``ledger.TableFiller``), which ``build.measure_table`` calls: adding
an estimator is its filler declared with ``@register("table estimator", ...)`` in one of
the modules named below.
"""

from __future__ import annotations

from gap_engine.core.errors import TableError
from gap_engine.core.registry import Registry

# Declared on the fillers (``@register("table estimator", ...)``), fastest first: the order selectors list them in.
ESTIMATORS = Registry(
    "table estimator", ("gap_engine.tables.estimate", "gap_engine.tables.refine", "gap_engine.tables.exact_fill"), TableError
)
