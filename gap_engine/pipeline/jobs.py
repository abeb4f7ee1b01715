"""Background jobs: long engine work (table builds, prune-and-evaluate) off the caller's thread.

A web page is re-executed from the top on every interaction, and a user may switch pages
while a table is being measured. The work therefore runs in a thread owned by a
process-wide :class:`JobManager` (the module-level ``MANAGER``), and a page only keeps a
job id: on every rerun it reads the job's status and progress, and it may cancel it.

Rules:

* one job per ``(kind, key)`` at a time: asking again for the same key (for example the
  same table key) while a job for it is queued or running returns that job instead of
  starting a second one;
* at most ``max_running`` jobs run at once; the others wait in status ``queued``;
* a work function receives a :class:`JobContext`: ``ctx.cancel`` is a ``threading.Event``
  it should poll, ``ctx.progress(done, total, eta)`` / ``ctx.say(message)`` report
  progress, and ``ctx.hooks()`` is all of that as the engine's ``Hooks``;
* a :class:`~gap_engine.core.errors.GapError` ends the job as ``failed`` with its one-line
  message (``CancelledError``, or any failure after a cancel request, as ``cancelled``);
  any other exception ends it as ``failed`` with a one-line summary, and the traceback goes
  to the log, never to the user;
* a failed or cancelled job is a new job: the result of an earlier successful job with the
  same kind and key stays on that job.

This module has no dependency on any UI toolkit.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gap_engine.core.device import DeviceSpec
from gap_engine.core.errors import CancelledError, GapError, one_line
from gap_engine.core.interrupt import run_unless_cancelled
from gap_engine.core.progress import LOAD_MODEL, NO_HOOKS, RECOVERY_STAGES, Hooks, JobProgress
from gap_engine.evaluate import history
from gap_engine.evaluate.tasks import TaskSettings, prepare_tasks
from gap_engine.model.loaded import LoadedModel
from gap_engine.model.loading import load_model
from gap_engine.pipeline import learned
from gap_engine.pipeline.cost_model import Prediction, baselines_prediction, recovery_prediction
from gap_engine.pipeline.recovery import recover
from gap_engine.pipeline.runs import baseline_rows, baseline_stages, prune_and_evaluate, prune_eval_stages
from gap_engine.pipeline.stages import loss_table, table_stages
from gap_engine.recover.files import saved_step

log = logging.getLogger(__name__)

QUEUED, RUNNING, DONE, FAILED, CANCELLED = "queued", "running", "done", "failed", "cancelled"
ACTIVE_STATUSES = (QUEUED, RUNNING)


class JobContext:
    """What a work function gets: the cancel event and the progress callbacks of its job."""

    def __init__(self, job: Job):
        self._job = job
        self.cancel: threading.Event = job.cancel_event  # set when the user asks to cancel

    def progress(self, done: int, total: int, eta: float | None = None, message: str | None = None) -> None:
        """Report ``done`` of ``total`` steps (the engine's (done, total, eta) callback shape)."""
        self._job._set_progress(done=done, total=total, eta=eta, message=message)

    def say(self, message: str) -> None:
        """Report what the job is doing now, keeping the step counts (evaluate's callback shape)."""
        self._job._set_progress(message=message)

    def step(self, message: str, done: int, total: int) -> None:
        """Report a step by name with its position among the job's steps (no ETA)."""
        self._job._set_progress(done=done, total=total, eta=None, message=message)

    def plan(self, stages: tuple[str, ...], expected: dict | None = None, basis: str = "") -> None:
        """Declare the job's stages (shown from the first second) and what each is expected to take."""
        self._job._plan(tuple(stages), dict(expected or {}), basis)

    def expect(self, stages: tuple[str, ...], predicted: Prediction | None, learn: bool = True) -> None:
        """Declare the stages with the cost model's prediction (None: times unknown); ``learn``: the job's time,
        once it is done, corrects the next prediction of its kind (``learned``)."""
        self.plan(stages, predicted.seconds if predicted else None, predicted.basis if predicted else "")
        self._job.pending = predicted.pending() if predicted is not None and learn else None

    def enter(self, name: str) -> None:
        """The stage ``name`` starts (the engine's ``stage(name)`` callback): its steps start at 0."""
        self._job._enter(name)

    def hooks(self) -> Hooks:
        """The engine's hooks for this job: progress and messages shown, stages entered, its cancel event."""
        return Hooks(progress=self.progress, stage=self.enter, message=self.say, cancel=self.cancel)

    def check_cancelled(self) -> None:
        """Raise CancelledError when a cancel was requested (for work between engine calls)."""
        if self.cancel.is_set():
            raise CancelledError(f"{self._job.kind} job cancelled")


WorkFn = Callable[[JobContext], Any]


@dataclass
class Job:
    """One unit of background work and everything a page shows about it."""

    id: str  # unique within the process, e.g. "table-3"
    kind: str  # what sort of work: "table", "prune_eval", ...
    key: str  # identity of the work (e.g. a table key); one active job per (kind, key)
    label: str  # a short human description for listings
    fn: WorkFn = field(repr=False)
    params: dict = field(default_factory=dict)  # JSON-ready inputs (model, settings), so any page can show or restore them
    owner: str | None = None  # an opaque id of whoever started it, who alone may cancel it (None: anyone)
    status: str = QUEUED
    progress: JobProgress = field(default_factory=JobProgress)
    result: Any = field(default=None, repr=False)  # what fn returned, once done
    error: str | None = None  # one line: the GapError text or a summary of the exception
    cancel_event: threading.Event = field(default_factory=threading.Event, repr=False)
    created: float = field(default_factory=time.time)
    started: float | None = None
    finished: float | None = None
    cancel_requested: float | None = None  # time.time() of the first cancel request
    pending: learned.Pending | None = None  # its prediction, recorded with its time when it is done (``learned``)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _finished_event: threading.Event = field(default_factory=threading.Event, repr=False)

    # ---- read side ---------------------------------------------------------------
    @property
    def active(self) -> bool:
        return self.status in ACTIVE_STATUSES

    @property
    def elapsed(self) -> float:
        """Seconds the job has been running (or ran); 0 while queued."""
        if self.started is None:
            return 0.0
        return (self.finished or time.time()) - self.started

    @property
    def cancelling(self) -> bool:
        """A cancel was asked for and the job has not ended yet."""
        return self.cancel_requested is not None and self.active

    def snapshot(self) -> dict:
        """A consistent, JSON-ready copy of the job's state.

        Besides the fields below: ``stage`` (the current stage's name, '' before the first),
        ``stage_index``, ``stages``, ``overall`` (the whole job's fraction), ``seconds_left``
        (the whole job's, None until it can be told), ``expected_total`` and
        ``expected_basis`` (what the prediction rests on), ``overrun`` (the time left is revised: the
        current stage ran past its predicted time), ``stage_seconds``, ``cancelling`` and
        ``cancel_latency`` (seconds from the cancel request to the end).
        """
        now = time.time()
        with self._lock:
            p = self.progress
            return {
                "id": self.id,
                "kind": self.kind,
                "key": self.key,
                "label": self.label,
                "status": self.status,
                "done": p.done,
                "total": p.total,
                "fraction": p.fraction,
                "eta": p.eta,
                "message": p.message,
                "error": self.error,
                "created": self.created,
                "started": self.started,
                "finished": self.finished,
                "elapsed": self.elapsed,
                "params": dict(self.params),
                "stages": list(p.stages),
                "stage_index": p.stage,
                "stage": p.stages[p.stage] if 0 <= p.stage < len(p.stages) else "",
                "stage_elapsed": p.stage_elapsed(now),
                "stage_seconds": dict(p.stage_seconds),
                "overall": 1.0 if self.status == DONE else p.overall(now),
                "seconds_left": None if not self.active else p.seconds_left(now),
                "overrun": self.active and p.overrun(now),
                "expected_total": p.expected_total(),
                "expected_basis": p.expected_basis,
                "cancelling": self.cancelling,
                "cancel_latency": None
                if self.cancel_requested is None or self.finished is None
                else max(0.0, self.finished - self.cancel_requested),
            }

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the job ends (for scripts and tests); True when it has ended."""
        return self._finished_event.wait(timeout)

    def cancel(self) -> None:
        """Ask the job to stop; a queued job is cancelled at once, a running one at its next poll."""
        self.cancel_event.set()
        with self._lock:
            if self.cancel_requested is None and self.active:
                self.cancel_requested = time.time()
            if self.status == QUEUED:
                self._finish_locked(CANCELLED, error="cancelled before it started")

    # ---- write side (the worker thread) -------------------------------------------
    def _set_progress(self, done=None, total=None, eta=None, message=None) -> None:
        with self._lock:
            p = self.progress
            if done is not None:
                p.done = int(done)
            if total is not None:
                p.total = int(total)
                p.eta = None if eta is None else max(0.0, float(eta))
            if message is not None:
                p.message = str(message)
            p.updated = time.time()

    def _plan(self, stages: tuple[str, ...], expected: dict, basis: str) -> None:
        with self._lock:
            p = self.progress
            p.stages, p.expected, p.expected_basis = stages, expected, basis

    def _close_stage_locked(self, now: float) -> None:
        p = self.progress
        if 0 <= p.stage < len(p.stages) and p.stage_started is not None:
            ended = p.stages[p.stage]
            p.stage_seconds[ended] = round(p.stage_seconds.get(ended, 0.0) + now - p.stage_started, 3)
        p.stage_started = None

    def _enter(self, name: str) -> None:
        with self._lock:
            p = self.progress
            now = time.time()
            self._close_stage_locked(now)
            if name in p.stages:
                p.stage = p.stages.index(name)
            p.stage_started = now
            p.done, p.total, p.eta, p.message, p.updated = 0, 0, None, name, now

    def _finish_locked(self, status: str, result: Any = None, error: str | None = None) -> None:
        self._close_stage_locked(time.time())
        self.status = status
        self.result = result
        self.error = error
        self.finished = time.time()
        if status == DONE:
            self.progress.eta = 0.0
            if self.progress.total:
                self.progress.done = self.progress.total
        self._finished_event.set()


class JobManager:
    """Runs jobs in daemon threads; thread-safe; one instance per process (``MANAGER``)."""

    def __init__(self, max_running: int = 2, keep_finished: int = 50):
        """
        Args:
            max_running: jobs allowed to run at once; more wait as ``queued``.
            keep_finished: finished jobs kept for listings (oldest dropped first).
        """
        self.max_running = max_running
        self.keep_finished = keep_finished
        self._jobs: dict[str, Job] = {}
        self._lock = threading.Lock()
        self._slots = threading.Semaphore(max_running)
        self._ids = itertools.count(1)

    def submit(
        self, kind: str, fn: WorkFn, key: str | None = None, label: str | None = None, params: dict | None = None, owner: str | None = None
    ) -> Job:
        """Start ``fn(ctx)`` in the background, or attach to the active job with the same kind and key.

        Args:
            kind: the sort of work ("table", "prune_eval", ...).
            fn: the work; gets a JobContext, returns the job's result.
            key: identity of the work; None makes a fresh key (never shared).
            label: a short description; defaults to "kind key".
            params: JSON-ready inputs a page may show or restore its form from.
            owner: who starts it (an opaque id; the explorer's is a digest of a browser's token).
                Recorded, not enforced: the caller decides who may cancel. A job attached to
                keeps the owner of whoever started it.
        Returns:
            The new job, or the queued/running one it attached to.
        """
        with self._lock:
            job_id = f"{kind}-{next(self._ids)}"
            key = job_id if key is None else str(key)
            for existing in self._jobs.values():
                if existing.kind == kind and existing.key == key and existing.active:
                    return existing
            job = Job(id=job_id, kind=kind, key=key, label=label or f"{kind} {key}", fn=fn, params=dict(params or {}), owner=owner)
            self._jobs[job.id] = job
            self._prune_finished_locked()
        thread = threading.Thread(target=self._run, args=(job,), name=f"gap-job-{job.id}", daemon=True)
        thread.start()
        return job

    def _run(self, job: Job) -> None:
        self._slots.acquire()
        try:
            with job._lock:
                if job.status != QUEUED:  # cancelled while waiting for a slot
                    return
                job.status = RUNNING
                job.started = time.time()
            ctx = JobContext(job)
            try:
                if job.cancel_event.is_set():
                    raise CancelledError(f"{job.kind} job cancelled")
                result = job.fn(ctx)
            except CancelledError as exc:
                with job._lock:
                    job._finish_locked(CANCELLED, error=one_line(exc))
            except BaseException as exc:
                if not isinstance(exc, GapError):
                    log.exception("job %s (%s) failed", job.id, job.label)
                status = CANCELLED if job.cancel_event.is_set() else FAILED
                with job._lock:
                    job._finish_locked(status, error=one_line(exc))
            else:
                if job.pending is not None:  # before it reads as done, so the next prediction has it
                    learned.record(job.pending, job.elapsed)
                with job._lock:
                    job._finish_locked(DONE, result=result)
        finally:
            self._slots.release()

    # ---- queries -----------------------------------------------------------------
    def get(self, job_id: str | None) -> Job | None:
        """The job with this id, or None (unknown id, or dropped from the listing)."""
        if job_id is None:
            return None
        with self._lock:
            return self._jobs.get(job_id)

    def jobs(self, kind: str | None = None, key: str | None = None, active_only: bool = False) -> list[Job]:
        """Jobs, oldest first, filtered by kind, key and activity."""
        with self._lock:
            found = list(self._jobs.values())
        return [j for j in found if (kind is None or j.kind == kind) and (key is None or j.key == key) and (not active_only or j.active)]

    def active(self, kind: str | None = None, key: str | None = None) -> Job | None:
        """The queued or running job of this kind (and key), if any; the newest when several."""
        running = self.jobs(kind, key, active_only=True)
        return running[-1] if running else None

    def cancel(self, job_id: str) -> bool:
        """Ask one job to stop; False when there is no such active job."""
        job = self.get(job_id)
        if job is None or not job.active:
            return False
        job.cancel()
        return True

    def _prune_finished_locked(self) -> None:
        finished = [j for j in self._jobs.values() if not j.active]
        for job in finished[: max(0, len(finished) - self.keep_finished)]:
            del self._jobs[job.id]


MANAGER = JobManager()


def manager() -> JobManager:
    """The process-wide job manager (survives page reruns and page switches)."""
    return MANAGER


# ---- models shared by the jobs and the pages ---------------------------------------------
# Loading a model takes seconds and tokenising a text source takes longer; the data module
# keeps token streams per tokenizer object. So the process keeps one dense model per name
# (`shared_model`), marked ``shared``: the engine's operations that register hooks, mask weights
# in place (exact table cells, evo) or slice them (surgery) then work on `LoadedModel.private()`,
# a deep copy of the weights that shares the tokenizer, so no job needs to remember to copy.
MAX_SHARED_MODELS = 2
_shared: dict[str, LoadedModel] = {}
_shared_lock = threading.Lock()


def shared_model(name: str, device: DeviceSpec | None = None, hooks: Hooks = NO_HOOKS) -> LoadedModel:
    """The dense LoadedModel for ``name`` (on ``device``; None: CPU float32), loaded once per process. Never modify it.

    Args:
        hooks: the job's hooks: at its cancel, stop waiting for a load at once (CancelledError);
            transformers cannot stop a load half-way, so it finishes in the background and is kept.
    Raises:
        GapError: from model.loading.load_model (unknown name, unreadable weights, a device this machine lacks, ...).
    """
    key = _shared_key(name, device)

    def load() -> LoadedModel:
        with _shared_lock:
            lm = _shared.pop(key, None)
            if lm is None:
                lm = load_model(name, device)
                lm.shared = True
            _shared[key] = lm  # most recently used last
            while len(_shared) > MAX_SHARED_MODELS:
                _shared.pop(next(iter(_shared)))
            return lm

    if key in _shared:
        return load()
    return run_unless_cancelled(load, hooks, f"cancelled while loading {name} (the load finishes in the background)", "gap-load-model")


def _shared_key(name: str, device: DeviceSpec | None) -> str:
    return name if device is None else f"{name}|{device.device}|{device.dtype}|{device.stream}"


def model_loaded(name: str, device: DeviceSpec | None = None) -> bool:
    """Whether ``name`` is in memory on ``device`` (a job's load then costs nothing)."""
    return _shared_key(name, device) in _shared


# ---- the tasks the app runs --------------------------------------------------------------
# Each returns a work function for `JobManager.submit`; the work itself is the pipeline's.


def table_task(model_name: str, spec, device: DeviceSpec | None = None, cells=None, expected: Prediction | None = None) -> WorkFn:
    """Build (or read from the cache) the loss table of ``model_name`` under ``spec``; the result is the LossTable.

    Args:
        device: where the model runs (None: CPU float32).
        cells: who measures exact cells (``tables.distributed.RayCells``); None: this process.
        expected: the cost model's stages (``cost_model.table_prediction``), for the ETA; its time teaches the next.
    """

    def work(ctx: JobContext):
        ctx.expect(table_stages(spec), expected)
        ctx.enter(LOAD_MODEL)
        lm = shared_model(model_name, device, ctx.hooks())  # a build measures on a private copy (loss_table)
        unit = "cells" if spec.estimator == "exact" else "calibration batches"

        def progress(done: int, total: int, eta: float | None = None) -> None:
            ctx.progress(done, total, eta, message=f"{done} of {total} {unit}")

        return loss_table(lm, spec, ctx.hooks().replaced(progress=progress), cells=cells)

    return work


def baselines_task(model_name: str, table, budgets, allocators, constraints, compensation: str | None = None) -> WorkFn:
    """Baseline plans at a few budgets (`pipeline.baseline_rows`, charged for ``compensation``'s
    biases); the result is its list of BaselinePlan."""

    def work(ctx: JobContext):
        spec, loaded = table.spec, model_loaded(model_name)
        ctx.expect(
            baseline_stages(allocators), baselines_prediction(model_name, spec.windows, spec.criterion, allocators, len(budgets), loaded)
        )
        ctx.enter(LOAD_MODEL)
        lm = shared_model(model_name, hooks=ctx.hooks())  # FLAP and OWL hook a private copy (baseline_rows)
        return baseline_rows(lm, table, budgets, allocators, constraints, ctx.hooks(), compensation=compensation)

    return work


def _record_maker(run_id: int, maker: str, history_path: Path | None = None) -> None:
    """Record who made a finished run; a history that refuses it leaves the run standing, with no maker."""
    try:
        history.set_run_maker(run_id, maker, history_path)
    except GapError as exc:
        log.warning("run %s was recorded without its maker: %s", run_id, one_line(exc))


def prune_eval_task(
    model_name: str,
    eval_settings,
    expected: Prediction | None = None,
    task_settings: TaskSettings | None = None,
    maker: str | None = None,
    **run,
) -> WorkFn:
    """Prune a copy, measure, evaluate and record (`pipeline.prune_and_evaluate`); the result is its PruneEvalResult.

    Args:
        model_name: the dense model (built-in name, folder or hub id).
        eval_settings: evaluate.EvalSettings.
        expected: the cost model's stages (``cost_model.run_prediction``), for the ETA; its time teaches the next.
        task_settings: lm-eval tasks to score the pruned model and dense on (None: none); their
            data sets load while the model does, so a data problem ends the job before pruning.
        maker: who made the run, recorded beside it in the history (`history.set_run_maker`).
        run: the keyword arguments of `pipeline.prune_and_evaluate` (table, budget,
            allocator, constraints, plan, checkpoint_dir, history_path, compensation).
    """

    def work(ctx: JobContext):
        compensated = run.get("compensation") is not None and run["compensation"].active
        stages = prune_eval_stages(eval_settings, run.get("checkpoint_dir") is not None, task_settings is not None, compensated)
        ctx.expect(stages, expected)
        ctx.enter(LOAD_MODEL)
        prepared = None
        if task_settings is not None:
            ctx.say(f"reading the tasks {', '.join(task_settings.tasks)}")
            prepared = run_unless_cancelled(lambda: prepare_tasks(task_settings), ctx.hooks(), "cancelled while reading the tasks")
        dense = shared_model(model_name, hooks=ctx.hooks())  # forward passes only
        result = prune_and_evaluate(dense, eval_settings, hooks=ctx.hooks(), tasks=prepared, **run)
        if maker is not None:
            history_path = run.get("history_path")
            _record_maker(result.run_id, maker, Path(history_path) if history_path is not None else None)
        return result

    return work


def recover_task(checkpoint: str, settings, out_dir, task_settings: TaskSettings | None = None, maker: str | None = None) -> WorkFn:
    """Fine-tune a saved checkpoint (`recovery.recover`), resuming the run saved for ``out_dir``
    when there is one; the result is its RecoveryResult.

    Args:
        checkpoint: a pruned checkpoint folder (loaded privately: training changes its weights).
        settings: recover.RecoverySettings.
        out_dir: the recovered checkpoint's folder (see `recovery.app_output_dir`).
        task_settings: lm-eval tasks scored before and after training and on dense (None: none).
        maker: who made the run, recorded beside it in the history (`history.set_run_maker`).
    """

    def work(ctx: JobContext):
        examples = len(task_settings.tasks) * (task_settings.limit or 0) if task_settings is not None else 0
        predicted = recovery_prediction(checkpoint, settings, task_examples=examples)
        if predicted is not None:  # the ETA from the first second; measured step times replace it
            ctx.expect(RECOVERY_STAGES, predicted, learn=saved_step(out_dir) is None)  # a resumed run's time teaches nothing
        prepared = None
        if task_settings is not None:
            ctx.step(f"reading the tasks {', '.join(task_settings.tasks)}", 0, settings.steps)
            prepared = run_unless_cancelled(lambda: prepare_tasks(task_settings), ctx.hooks(), "cancelled while reading the tasks")
        ctx.step("loading the checkpoint", 0, settings.steps)
        lm = load_model(str(checkpoint))
        ctx.check_cancelled()
        judged = prepared if settings.eval_tasks else None  # the picker's tasks judge the snapshots on their last examples
        result = recover(lm, settings, ctx.hooks(), out_dir=out_dir, resume=True, lm_eval_tasks=prepared, judge_tasks=judged)
        if maker is not None and result.run_id is not None:
            _record_maker(result.run_id, maker)
        return result

    return work
