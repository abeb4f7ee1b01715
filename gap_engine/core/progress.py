"""How long engine work reports progress, names its stages and is cancelled: one `Hooks` object.

Every long function of the engine (table builds, scoring, evaluation, planning, the
pipeline) takes one optional ``hooks: Hooks`` argument, so the CLI, background jobs and
benchmarks drive it alike. A `Hooks` holds four optional parts, each a no-op when absent:

- ``progress(done, total, eta_seconds)``: steps of the current stage (cells, batches,
  blocks, generations, training steps); ``eta_seconds`` is None until a step was timed.
  This is the one progress signature; there is no other.
- ``stage(name)``: a stage starts; the names are the constants below (what a progress bar
  shows and the keys under which stage times are recorded and predicted). A stage's steps
  start again at 0.
- ``message(text)``: one line of free text about what happens now (evaluation steps, a
  recovery run's phases, a finished comparison plan); it is not a stage, it is not timed.
- ``cancel``: any object with ``is_set()`` (a ``threading.Event``), polled between steps;
  when set, the work stops with ``CancelledError``.

Engine code calls the helpers (``hooks.report``, ``hooks.enter``, ``hooks.say``,
``hooks.check_cancelled``) and passes ``hooks`` on, or a variant made with
``dataclasses.replace`` / `Hooks.but`; `StageTimer` records how long each stage took.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Protocol

from gap_engine.core.errors import CancelledError

ProgressFn = Callable[[int, int, "float | None"], None]
StageFn = Callable[[str], None]
MessageFn = Callable[[str], None]


class CancelToken(Protocol):
    def is_set(self) -> bool: ...


def check_cancelled(cancel: CancelToken | None, message: str) -> None:
    """Raise CancelledError(message) when ``cancel`` is set."""
    if cancel is not None and cancel.is_set():
        raise CancelledError(message)


@dataclass(frozen=True)
class Hooks:
    """Progress, stage names, free-text messages and the cancel token of one piece of long work."""

    progress: ProgressFn | None = None  # (done, total, eta_seconds) after every step
    stage: StageFn | None = None  # the name of each stage as it starts (the constants below)
    message: MessageFn | None = None  # a line of free text about what happens now
    cancel: CancelToken | None = None  # polled between steps; set: CancelledError

    def report(self, done: int, total: int, eta_seconds: float | None = None) -> None:
        """``done`` of ``total`` steps of the current stage, ``eta_seconds`` left (None: unknown)."""
        if self.progress is not None:
            self.progress(done, total, eta_seconds)

    def enter(self, name: str) -> None:
        """The stage ``name`` starts."""
        if self.stage is not None:
            self.stage(name)

    def say(self, text: str) -> None:
        """One line about what happens now (not a stage)."""
        if self.message is not None:
            self.message(text)

    def is_cancelled(self) -> bool:
        """Whether a cancel was requested."""
        return self.cancel is not None and self.cancel.is_set()

    def check_cancelled(self, message: str) -> None:
        """Raise CancelledError(message) when a cancel was requested."""
        check_cancelled(self.cancel, message)

    def but(self, **changes: Any) -> Hooks:
        """A copy with some parts replaced (``hooks.but(progress=None)``)."""
        return replace(self, **changes)


NO_HOOKS = Hooks()  # nothing reported, never cancelled


class EtaClock:
    """Seconds left from the work done so far, with steps of unequal weight.

    ``weights`` are the relative costs of the steps still to do (e.g. blocks a table cell
    runs); the estimate is elapsed time per unit of weight done, times the weight left.
    """

    def __init__(self, weights: list[float] | None = None, total_steps: int | None = None) -> None:
        self.started = time.perf_counter()
        self.weight_left = float(sum(weights)) if weights is not None else float(total_steps or 0)
        self.weight_done = 0.0

    def step(self, weight: float = 1.0) -> float:
        """Record one finished step of ``weight``; returns the estimated seconds left."""
        self.weight_done += weight
        self.weight_left = max(0.0, self.weight_left - weight)
        elapsed = time.perf_counter() - self.started
        return elapsed / self.weight_done * self.weight_left if self.weight_done > 0 else 0.0


# ---- stages -----------------------------------------------------------------------------
# The names long work announces through ``stage(name)``: what a progress bar shows, and the
# keys under which stage times are recorded (cache metadata, run history) and predicted.
LOAD_MODEL = "load model"
READ_TEXT = "read text"
SCORE_UNITS = "score units"
DENSE_PASS = "dense pass"  # exact tables: the block inputs every cell starts from
GRADIENT_PASS = "gradient pass"  # fisher/taylor tables: one forward and backward per calibration batch
CELLS = "cells"
PLAN = "plan"
PRUNE = "prune"
COMPENSATE = "compensate"  # the kept units refit block by block after the cut (prune.compensation_pass)
MEASURE = "measure"  # the loss increase on the calibration windows
HELD_OUT = "held-out text"  # perplexity, KL and agreement against dense
THROUGHPUT = "throughput"
GENERATE = "generate"
TASKS = "task accuracy"  # lm-eval tasks on the model and (unless cached) on dense
SAVE = "save"


class StageTimer:
    """A ``stage(name)`` callback that records the wall time of each stage and passes the
    names on; a stage ends when the next one starts or at `finish`."""

    def __init__(self, forward: StageFn | None = None) -> None:
        self.forward = forward
        self.seconds: dict[str, float] = {}
        self._current: str | None = None
        self._since = 0.0

    def __call__(self, name: str) -> None:
        self._close()
        self._current, self._since = name, time.perf_counter()
        if self.forward is not None:
            self.forward(name)

    def _close(self) -> None:
        if self._current is not None:
            spent = time.perf_counter() - self._since
            self.seconds[self._current] = round(self.seconds.get(self._current, 0.0) + spent, 3)
            self._current = None

    def finish(self) -> dict[str, float]:
        """End the current stage; seconds per stage name, in the order they ran."""
        self._close()
        return dict(self.seconds)
