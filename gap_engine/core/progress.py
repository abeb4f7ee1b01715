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

A stage's function takes ``hooks`` and calls the helpers (``hooks.report``, ``hooks.enter``,
``hooks.say``, ``hooks.check_cancelled``). The maths under a stage (scoring units, passes block by
block, pruning and compensating blocks) takes no ``hooks``: the stage opens `reporting(hooks)`
once, and its loops walk their batches or blocks through `steps`, which polls the cancel before
each and reports after each. `StageTimer` records how long each stage took, and `JobProgress`
turns a background job's reports into its time left.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, TypeVar

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

    def replaced(self, **changes: Any) -> Hooks:
        """A copy with some parts replaced (``hooks.replaced(progress=None)``)."""
        return replace(self, **changes)


NO_HOOKS = Hooks()  # nothing reported, never cancelled

# ---- the stage boundary: the maths below it reports without a hooks argument ----------------------
# A context variable, so that each thread (a background job, a test) has its own: a new thread
# starts with NO_HOOKS, whatever the thread that made it is reporting to.
_ACTIVE: ContextVar[Hooks] = ContextVar("gap_active_hooks", default=NO_HOOKS)
T = TypeVar("T", covariant=True)


class Counted(Protocol[T]):
    """What `steps` walks: a list of batches, a model's blocks (an ``nn.ModuleList``)."""

    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[T]: ...


@contextmanager
def reporting(hooks: Hooks) -> Iterator[Hooks]:
    """Within the block, the maths a stage calls reports to ``hooks`` and polls its cancel
    (`steps`, `active`); the enclosing stage's hooks come back after it."""
    token = _ACTIVE.set(hooks)
    try:
        yield hooks
    finally:
        _ACTIVE.reset(token)


def active() -> Hooks:
    """The hooks of the stage this code runs under (NO_HOOKS outside any `reporting` block)."""
    return _ACTIVE.get()


def steps(items: Counted[T], what: str, unit: str, timed: bool = False, quiet: bool = False) -> Iterator[T]:
    """``items`` one by one, the active stage's cancel polled before each (CancelledError:
    "<what> cancelled after <i> of <n> <unit>") and (done, total, eta) reported after each;
    ``timed``: an eta from the pace so far (equal steps), else None; ``quiet``: nothing
    reported, for a loop whose caller counts its own progress (cells, blocks of another pass)."""
    hooks = _ACTIVE.get()
    clock = EtaClock(total_steps=len(items)) if timed else None
    for i, item in enumerate(items):
        hooks.check_cancelled(f"{what} cancelled after {i} of {len(items)} {unit}")
        yield item
        if not quiet:
            hooks.report(i + 1, len(items), clock.step() if clock is not None else None)


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


# A stage past its predicted time that counts no steps is given this share of its time so far to go: its estimated
# length becomes 1.25 x its elapsed time, growing smoothly from the prediction instead of vanishing at it.
OVERRUN_SHARE = 0.25
PACE_PRIOR_S = 10.0  # seconds "on time" the pace of a job starts from (a 0.1 s load of a model in memory says little)


@dataclass
class JobProgress:
    """The latest progress a job reported: its stages, and the steps of the current one."""

    done: int = 0  # steps of the current stage finished (cells, batches)
    total: int = 0  # steps of the current stage in all; 0 while unknown
    eta: float | None = None  # seconds left in the current stage, as the work function estimates them (None: unknown)
    message: str = ""  # what the job is doing now, in a few words
    updated: float = 0.0  # time.time() of the report
    stages: tuple[str, ...] = ()  # the job's stages in order (`progress` names); empty: not declared
    stage: int = -1  # index of the current stage; -1 before the first
    stage_started: float | None = None  # time.time() the current stage began
    stage_seconds: dict[str, float] = field(default_factory=dict)  # stage -> seconds it took, for the stages that ended
    expected: dict[str, float] = field(
        default_factory=dict
    )  # stage -> seconds it is expected to take (``pipeline.cost_model``; may be partial)
    expected_basis: str = ""  # where ``expected`` comes from, in a few words

    @property
    def fraction(self) -> float:
        """done / total of the current stage in [0, 1]; 0 while the total is unknown."""
        if self.total <= 0:
            return 0.0
        return min(1.0, max(0.0, self.done / self.total))

    def stage_elapsed(self, now: float) -> float:
        return 0.0 if self.stage_started is None else max(0.0, now - self.stage_started)

    def pace(self) -> float:
        """Actual over expected seconds of the stages that ended, as if PACE_PRIOR_S more had run on time:
        how much slower (above 1) or faster this job runs than predicted, without trusting a short stage alone."""
        ended = [name for name in self.stage_seconds if self.expected.get(name) is not None]
        actual, expected = sum(self.stage_seconds[n] for n in ended), sum(self.expected[n] for n in ended)
        return (actual + PACE_PRIOR_S) / (expected + PACE_PRIOR_S)

    def _stage_left(self, now: float) -> tuple[float | None, bool]:
        """(seconds left in the current stage, whether they are revised because it ran past its prediction): the
        work's own estimate from its steps, else the expected time at the job's pace; past that, the rest of its
        steps at the rate so far, else OVERRUN_SHARE of its time so far (never blank, never a stale "0 s")."""
        if self.eta is not None:
            return self.eta, False
        expected = self.expected.get(self.stages[self.stage]) if 0 <= self.stage < len(self.stages) else None
        elapsed, done = self.stage_elapsed(now), self.fraction
        planned = None if expected is None else expected * self.pace() - elapsed
        if done > 0 and (planned is None or planned <= 0):
            return elapsed * (1.0 - done) / done, planned is not None
        if planned is None:
            return None, False
        return max(planned, OVERRUN_SHARE * elapsed), planned < OVERRUN_SHARE * elapsed

    def overrun(self, now: float) -> bool:
        """Whether the current stage's time left is revised: it ran past its predicted time."""
        return 0 <= self.stage < len(self.stages) and self._stage_left(now)[1]

    def seconds_left(self, now: float) -> float | None:
        """Seconds left for the whole job, once they can be told: the current stage's, plus the
        expected times of the stages after it at the job's pace (None while any of them is unknown)."""
        if not self.stages:
            return self.eta
        if self.stage < 0:
            return self.expected_total()
        left = self._stage_left(now)[0]
        later = [self.expected.get(name) for name in self.stages[self.stage + 1 :]]
        known = [seconds for seconds in later if seconds is not None]
        if left is None or len(known) < len(later):
            return None
        return left + sum(known) * self.pace()

    def expected_total(self) -> float | None:
        """The whole job's expected seconds, when every stage has an expectation."""
        if not self.stages or any(self.expected.get(name) is None for name in self.stages):
            return None
        return float(sum(self.expected[name] for name in self.stages))

    def overall(self, now: float) -> float:
        """How far the whole job is, in [0, 1]: stages weighted by their expected time (equal
        weights where none is known), the current one by its steps or its elapsed time."""
        if not self.stages:
            return self.fraction
        if self.stage < 0:
            return 0.0
        known = [seconds for seconds in self.expected.values() if seconds is not None]
        fallback = max(sum(known) / len(known), 1.0) if known else 1.0
        weights = [max(float(self.expected.get(name) or fallback), 0.1) for name in self.stages]
        current, elapsed, left = self.fraction, self.stage_elapsed(now), self._stage_left(now)[0]
        if self.total <= 0 and self.expected.get(self.stages[self.stage]) and left is not None and elapsed + left > 0:
            current = min(0.95, elapsed / (elapsed + left))
        return min(1.0, (sum(weights[: self.stage]) + weights[self.stage] * current) / sum(weights))


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
# A recovery run (``pipeline.recovery``): evaluation, calibration loss and the rate probe; the steps; the evaluation after.
PREPARING, TRAINING, EVALUATING_AFTER = "preparing", "training", "evaluating after"
RECOVERY_STAGES = (PREPARING, TRAINING, EVALUATING_AFTER)


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
