"""The objectives: what a loss-table cell measures (the registry).

Each function takes ``(logits, input_ids, dense_logprobs, start)`` and returns the objective
summed over each window's counted positions, (B,) (``tables.cells.objective_per_window``).
"""

from __future__ import annotations

from gap_engine.core.errors import TableError
from gap_engine.core.registry import Registry

OBJECTIVES = Registry("table objective", ("gap_engine.tables.cells",), TableError)  # declared on the functions
