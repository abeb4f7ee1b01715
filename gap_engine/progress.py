"""How long engine work reports progress and is cancelled.

Every long function of the engine (table builds, scoring, evaluation, the pipeline) takes
the same two optional hooks, so the CLI, background jobs and benchmarks drive it alike:

- ``progress(done, total, eta_seconds)`` after every step (cells, batches, candidates);
  ``eta_seconds`` is None until one step was timed;
- ``cancel``: any object with ``is_set()`` (a ``threading.Event``), polled between steps;
  when set, the work stops with ``CancelledError``.

The pipeline also names its stages through ``stage(message)``.
"""

from __future__ import annotations

import time
from typing import Callable, Protocol

from .errors import CancelledError

ProgressFn = Callable[[int, int, "float | None"], None]
StageFn = Callable[[str], None]


class CancelToken(Protocol):
    def is_set(self) -> bool: ...


def check_cancelled(cancel: CancelToken | None, message: str) -> None:
    """Raise CancelledError(message) when ``cancel`` is set."""
    if cancel is not None and cancel.is_set():
        raise CancelledError(message)


class EtaClock:
    """Seconds left from the work done so far, with steps of unequal weight.

    ``weights`` are the relative costs of the steps still to do (e.g. blocks a table cell
    runs); the estimate is elapsed time per unit of weight done, times the weight left.
    """

    def __init__(self, weights: list[float] | None = None, total_steps: int | None = None):
        self.started = time.perf_counter()
        self.weight_left = float(sum(weights)) if weights is not None else float(total_steps or 0)
        self.weight_done = 0.0

    def step(self, weight: float = 1.0) -> float:
        """Record one finished step of ``weight``; returns the estimated seconds left."""
        self.weight_done += weight
        self.weight_left = max(0.0, self.weight_left - weight)
        elapsed = time.perf_counter() - self.started
        return elapsed / self.weight_done * self.weight_left if self.weight_done > 0 else 0.0
