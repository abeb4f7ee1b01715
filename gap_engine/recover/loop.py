"""Recovery's training stage: the learning-rate schedule, the ZO rate probe, and the step loop
with its snapshots and divergence guard (``recover.guard``).

``pipeline.recovery.recover`` prepares the run (data, objective, state, MaZO's mask) and calls
:func:`probe` and :func:`train`; everything here works on one run object (``recover.train``'s
``ZORun`` or ``LoraRun``), the run's ``RunState`` and its working folder.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from gap_engine.core.errors import CancelledError, InvariantError
from gap_engine.core.memory import PeakRSS
from gap_engine.core.progress import Hooks
from gap_engine.recover import guard
from gap_engine.recover.files import RecoveryError, RunState, load_state, save_best, save_state
from gap_engine.recover.train import PROBE_STEPS, CalibrationObjective, LoraRun, TaskData, ZORun, probe_learning_rate

if TYPE_CHECKING:
    from gap_engine.recover.judge import Judge
    from gap_engine.recover.settings import RecoverySettings

log = logging.getLogger(__name__)


def lr_at(settings: RecoverySettings, step: int, train_seconds: float = 0.0, cpu_seconds: float = 0.0) -> float:
    """The learning rate of step ``step`` (0-based): linear warm-up, then the schedule's decay.

    A run bounded by a time budget decays over whichever horizon it will reach first, its steps
    or its time (``train_seconds`` of ``time_budget_s``, ``cpu_seconds`` of ``cpu_budget_s``): a run given "15 minutes" and a step
    count it cannot reach in them would otherwise end with its rate still near the peak. On the
    DP 20% checkpoint of smollm2-135m, LoRA-kd with a constant 3e-3 for 182 steps reached held-out
    perplexity 35.29 / 47.03 (wiki / news); cosine from 3.3e-3 over 200 steps 32.98 / 44.73
    (docs/recovery.md)."""
    peak = settings.learning_rate()
    if step < settings.warmup_steps:
        return peak * (step + 1) / (settings.warmup_steps + 1)
    span = max(1, settings.steps - settings.warmup_steps)
    progress = (step - settings.warmup_steps) / span
    if settings.time_budget_s is not None:
        progress = min(1.0, max(progress, train_seconds / settings.time_budget_s))
    if settings.cpu_budget_s is not None:
        progress = min(1.0, max(progress, cpu_seconds / settings.cpu_budget_s))
    if settings.schedule == "linear":
        return peak * (1.0 - progress)
    if settings.schedule == "cosine":
        return peak * 0.5 * (1.0 + math.cos(math.pi * progress))
    return peak


class Reporter:
    """Tells ``hooks`` each phase and step as a message, then the steps done (the message first,
    so a listener that prints both sees the line that goes with the count)."""

    def __init__(self, hooks: Hooks, total: int):
        self.hooks, self.total, self.done = hooks, total, 0

    def stage(self, message: str) -> None:
        log.info("%s", message)
        self.hooks.say(message)
        self.hooks.report(self.done, self.total, None)

    def phases(self) -> Hooks:
        """Hooks for a part of the run: its lines are phases (``stage``), its cancel the run's."""
        return Hooks(message=self.stage, cancel=self.hooks.cancel)

    def step(self, done: int, eta: float | None, message: str) -> None:
        self.done = done
        self.hooks.say(message)
        self.hooks.report(done, self.total, eta)


def probe(run: ZORun, data: TaskData, settings: RecoverySettings, state: RunState, work: Path, reporter: Reporter) -> None:
    """Choose the ZO learning rate (``recover.train.probe_learning_rate``) from the snapshot just
    saved, record it in ``state`` and save again; its time counts as training time."""
    started, cpu_started = time.perf_counter(), time.process_time()

    def restore() -> None:
        saved = load_state(work)
        if saved is None:
            raise InvariantError("the probe found no snapshot to restore (one is saved just before it)")
        run.restore(saved[1], None)

    state.lr, state.lr_probe = probe_learning_rate(run, data, settings.learning_rate(), restore, reporter.phases())
    state.train_seconds += time.perf_counter() - started
    state.train_cpu_seconds += time.process_time() - cpu_started
    best = next((row["lr"] for row in state.lr_probe if row.get("best")), state.lr)
    why = f"one notch below {best:.3g}, " if best != state.lr else "the smallest candidate, "
    reporter.stage(f"learning rate {state.lr:.3g}: {why}the lowest loss after {PROBE_STEPS} probe steps")
    save_state(work, state, run.tensors(), run.optimizer_state)


class _Snapshots:
    """Saving a snapshot, through the divergence guard when it is on: a snapshot whose calibration
    objective rose is not saved; the run goes back to the last one saved instead. A kept snapshot
    is judged (``recover.judge``) when one is due, and the best one judged is kept apart."""

    def __init__(
        self,
        run: ZORun | LoraRun,
        data: TaskData,
        settings: RecoverySettings,
        state: RunState,
        work: Path,
        reporter: Reporter,
        judge: Judge | None = None,
    ):
        self.run, self.settings, self.state, self.work, self.reporter = run, settings, state, work, reporter
        self.last_saved = state.step
        self.objective = CalibrationObjective(run, data) if settings.guard else None
        if self.objective is not None and state.guard_lowest is None:
            state.guard_lowest = self.objective()  # the starting weights: the first kept snapshot
        self.judge, self.judge_wall, self.judge_cpu = judge, 0.0, 0.0  # this segment's seconds spent judging
        if judge is not None and not state.judge_curve:
            self._judge()  # the starting weights: recovery may only make the task worse
            self.save()

    def save(self) -> None:
        save_state(self.work, self.state, self.run.tensors(), self.run.optimizer_state)
        self.last_saved = self.state.step

    def due(self, final: bool) -> bool:
        """Whether the snapshot just saved is to be judged: every ``eval_every`` steps, and the last."""
        state, every = self.state, self.settings.eval_every
        judged = bool(state.judge_curve) and state.judge_curve[-1]["step"] == state.step
        return self.judge is not None and not judged and (final or state.step % every == 0)

    def _judge(self) -> None:
        if self.judge is None:
            raise InvariantError("a snapshot was judged without a judge")
        state, started, cpu_started = self.state, time.perf_counter(), time.process_time()
        self.reporter.stage(f"judging step {state.step}: {self.judge.description}")
        score = self.judge()
        best = all(score > row["score"] for row in state.judge_curve)  # a tie keeps the earlier snapshot
        state.judge_curve.append({"step": state.step, "score": score, "best": best})
        if best:
            state.best_step = state.step
            save_best(self.work, state.step, self.run.tensors())
        wall = time.perf_counter() - started
        self.judge_wall, self.judge_cpu = self.judge_wall + wall, self.judge_cpu + time.process_time() - cpu_started
        state.judge_seconds += wall
        self.reporter.stage(f"step {state.step} scored {score:.4g}" + (", the best so far" if best else ""))

    def checkpoint(self, final: bool = False) -> str | None:
        """At a snapshot step (or after a non-finite loss): save, roll back, or say "diverged"."""
        if self.objective is None:
            self.save()
            self.judge_if_due(final)
            return None
        state = self.state
        loss = self.objective()
        if state.guard_lowest is None:
            raise InvariantError("the guard's lowest loss is unset (it is set when the guard starts)")
        verdict = guard.judge(loss, state.guard_lowest, len(state.rollbacks))
        if verdict.action == guard.KEEP:
            state.guard_lowest = min(state.guard_lowest, loss)
            self.save()
            self.judge_if_due(final)
            return None
        self.reporter.stage(f"step {state.step}: {verdict.reason}")
        state.rollbacks.append(
            {
                "step": state.step,
                "back_to": self.last_saved,
                "loss": loss if math.isfinite(loss) else None,
                "lowest": state.guard_lowest,
                "lr_scale": state.lr_scale,
                "action": verdict.action,
            }
        )
        self._restore_last()
        if verdict.action == guard.STOP:
            self.save()  # the record of the rollbacks, with the last good weights
            return "diverged"
        state.lr_scale /= guard.LR_CUT
        self.save()
        return None

    def judge_if_due(self, final: bool) -> None:
        """Judge the snapshot just saved when it is due, and save the run's record of it."""
        if self.due(final):
            self._judge()
            self.save()

    def _restore_last(self) -> None:
        """Weights, optimizer and step of the last saved snapshot; time, memory and rollbacks stay."""
        saved = load_state(self.work)
        if saved is None:
            raise InvariantError("no snapshot to roll back to (a run saves one before its first step)")
        saved_state, tensors, optimizer_state = saved
        self.run.restore(tensors, optimizer_state)
        self.state.step = saved_state.step
        self.state.curve = [row for row in self.state.curve if row["step"] <= saved_state.step]


def _budget_spent(settings: RecoverySettings, state: RunState) -> str | None:
    """ "time budget" or "CPU budget" when that budget is spent, else None."""
    if settings.time_budget_s is not None and state.train_seconds >= settings.time_budget_s:
        return "time budget"
    if settings.cpu_budget_s is not None and state.train_cpu_seconds >= settings.cpu_budget_s:
        return "CPU budget"
    return None


def train(
    run: ZORun | LoraRun,
    data: TaskData,
    settings: RecoverySettings,
    state: RunState,
    work: Path,
    reporter: Reporter,
    device: torch.device,
    judge: Judge | None = None,
) -> str:
    """The step loop; returns why it stopped ("steps", "time budget", "CPU budget" or "diverged").

    ``judge``: scores the starting weights, every ``eval_every``-th kept snapshot and the last;
    the best one's tensors are saved apart (``files.save_best``). Its time is not training time."""
    segment_start, seconds_before, steps_this_segment = time.perf_counter(), state.train_seconds, 0
    cpu_start, cpu_before = time.process_time(), state.train_cpu_seconds
    snapshots, stopped = _Snapshots(run, data, settings, state, work, reporter, judge), "steps"
    with PeakRSS() as meter:
        try:
            while state.step < settings.steps:
                if reporter.hooks.is_cancelled():
                    raise CancelledError(f"recovery cancelled after step {state.step} of {settings.steps}; resume to continue from there")
                stopped = _budget_spent(settings, state) or stopped
                if stopped != "steps":
                    break
                step, lr = state.step, lr_at(settings, state.step, state.train_seconds, state.train_cpu_seconds) * state.lr_scale
                loss = run.step(step, data.batch(step).to(device), lr)
                elapsed = time.perf_counter() - segment_start - snapshots.judge_wall
                state.step, steps_this_segment = step + 1, steps_this_segment + 1
                state.train_seconds = seconds_before + elapsed
                state.train_cpu_seconds = cpu_before + time.process_time() - cpu_start - snapshots.judge_cpu
                state.peak_rss = max(state.peak_rss, meter.peak())
                if not math.isfinite(loss) and not settings.guard:
                    raise RecoveryError(f"the loss became {loss} at step {step + 1}; lower the learning rate")
                state.curve.append({"step": state.step, "seconds": round(state.train_seconds, 3), "loss": loss, "lr": lr})
                eta = elapsed / steps_this_segment * (settings.steps - state.step)
                if settings.time_budget_s is not None:
                    eta = min(eta, max(0.0, settings.time_budget_s - state.train_seconds))
                if settings.cpu_budget_s is not None:  # CPU seconds left, at this segment's CPU share of the wall clock
                    share = (state.train_cpu_seconds - cpu_before) / max(elapsed, 1e-9)
                    eta = min(eta, max(0.0, settings.cpu_budget_s - state.train_cpu_seconds) / max(share, 1e-3))
                reporter.step(state.step, eta, f"{settings.method} step {state.step}/{settings.steps}: loss {loss:.4f}")
                if state.step % settings.save_every == 0 or state.step == settings.steps or not math.isfinite(loss):
                    if (
                        snapshots.checkpoint(final=state.step == settings.steps) == "diverged"
                    ):  # a rollback trains on from the last snapshot
                        return "diverged"
        except CancelledError:
            if state.step > snapshots.last_saved:
                snapshots.save()  # not judged: a cancel keeps what was trained; resume judges it at the next snapshot
            raise
    if state.step > snapshots.last_saved:  # a budget ran out between snapshots
        stopped = "diverged" if snapshots.checkpoint(final=True) == "diverged" else stopped
    elif stopped != "diverged":
        snapshots.judge_if_due(final=True)
    return stopped
