"""The estimators: how a loss table is filled (the registry).

``exact`` measures every distinct cell (``tables.exact``: in this process, resident or streamed,
or by a given cell filler such as ``tables.distributed.RayCells``); ``fisher`` and ``taylor`` estimate every cell from one gradient pass
(``tables.estimate``); ``refine`` starts from the fisher estimate and measures exactly the
cells the DP's plans use (``tables.refine``). Each entry's function is the estimator's
filler (``ledger.CellFiller``), which ``build.measure_table`` calls.
"""

from __future__ import annotations

from dataclasses import dataclass

from gap_engine.core.errors import TableError
from gap_engine.core.registry import Registry, Strategy


@dataclass(frozen=True, kw_only=True)
class Estimator(Strategy):
    """An estimator: ``function`` fills a table, ``(request) -> CellObjectives``."""

    gradient_passes: float  # its gradient pass in forward passes of the windows (the cost model); 0: none
    measures_cells: bool = False  # measures cells with pruned forward passes (so its cells may include compensation)

    @property
    def reads_gradients(self) -> bool:
        """Whether it runs a gradient pass (its table is built from one)."""
        return self.gradient_passes > 0


# Fastest first: the order selectors list them in.
ESTIMATORS: Registry[Estimator] = Registry(
    "table estimator",
    Estimator,
    (
        Estimator(
            "fisher", "fast: second-order estimate (one forward and backward pass)", "gap_engine.tables.estimate:fill_estimated",
            gradient_passes=5.0,
        ),
        Estimator(
            "taylor", "fast: first-order estimate (one forward and backward pass)", "gap_engine.tables.estimate:fill_estimated",
            gradient_passes=3.0,
        ),
        Estimator(
            "refine", "trusted: the fisher estimate, then every cell the plans use measured exactly (minutes)",
            "gap_engine.tables.refine:refine_cells", gradient_passes=5.0, measures_cells=True,
        ),
        Estimator(
            "exact", "exact: measured cell by cell (slow: minutes to hours)", "gap_engine.tables.exact:measure_exact",
            gradient_passes=0.0, measures_cells=True,
        ),
    ),
    TableError,
)  # fmt: skip
