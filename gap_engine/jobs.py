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
  it should poll (engine functions take it as ``cancel=``), and ``ctx.progress(done,
  total, eta)`` / ``ctx.say(message)`` report progress;
* a :class:`~gap_engine.errors.GapError` ends the job as ``failed`` with its one-line
  message (``CancelledError``, or any failure after a cancel request, as ``cancelled``);
  any other exception ends it as ``failed`` with a one-line summary, and the traceback goes
  to the log, never to the user;
* a failed or cancelled job never replaces the result of an earlier successful job with the
  same kind and key (see :meth:`JobManager.last_result`).

This module has no dependency on any UI toolkit.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from .device import DeviceSpec
from .errors import CancelledError, GapError, one_line
from .models import LoadedModel, load_model
from .pipeline import baseline_rows, loss_table, prune_and_evaluate
from .recover import recover

log = logging.getLogger(__name__)

QUEUED, RUNNING, DONE, FAILED, CANCELLED = "queued", "running", "done", "failed", "cancelled"
ACTIVE_STATUSES = (QUEUED, RUNNING)


@dataclass
class JobProgress:
    """The latest progress a job reported."""

    done: int = 0  # steps finished (cells, batches, stages)
    total: int = 0  # steps in all; 0 while unknown
    eta: float | None = None  # seconds left, as estimated by the work function (None: unknown)
    message: str = ""  # what the job is doing now, in a few words
    updated: float = 0.0  # time.time() of the report

    @property
    def fraction(self) -> float:
        """done / total in [0, 1]; 0 while the total is unknown."""
        if self.total <= 0:
            return 0.0
        return min(1.0, max(0.0, self.done / self.total))


class JobContext:
    """What a work function gets: the cancel event and the progress callbacks of its job."""

    def __init__(self, job: "Job"):
        self._job = job
        self.cancel: threading.Event = job.cancel_event  # set when the user asks to cancel

    def progress(self, done: int, total: int, eta: float | None = None, message: str | None = None) -> None:
        """Report ``done`` of ``total`` steps (the engine's (done, total, eta) callback shape)."""
        self._job._set_progress(done=done, total=total, eta=eta, message=message)

    def say(self, message: str) -> None:
        """Report what the job is doing now, keeping the step counts (evaluate's callback shape)."""
        self._job._set_progress(message=message)

    def stage(self, message: str, done: int, total: int) -> None:
        """Report a stage by name with its position among the job's stages (no ETA)."""
        self._job._set_progress(done=done, total=total, eta=None, message=message)

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
    status: str = QUEUED
    progress: JobProgress = field(default_factory=JobProgress)
    result: Any = field(default=None, repr=False)  # what fn returned, once done
    error: str | None = None  # one line: the GapError text or a summary of the exception
    cancel_event: threading.Event = field(default_factory=threading.Event, repr=False)
    created: float = field(default_factory=time.time)
    started: float | None = None
    finished: float | None = None
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

    def snapshot(self) -> dict:
        """A consistent, JSON-ready copy of the job's state."""
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
            }

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the job ends (for scripts and tests); True when it has ended."""
        return self._finished_event.wait(timeout)

    def cancel(self) -> None:
        """Ask the job to stop; a queued job is cancelled at once, a running one at its next poll."""
        self.cancel_event.set()
        with self._lock:
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

    def _finish_locked(self, status: str, result: Any = None, error: str | None = None) -> None:
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
        self._last_done: dict[tuple[str, str], Job] = {}
        self._lock = threading.Lock()
        self._slots = threading.Semaphore(max_running)
        self._ids = itertools.count(1)

    def submit(self, kind: str, fn: WorkFn, key: str | None = None, label: str | None = None) -> Job:
        """Start ``fn(ctx)`` in the background, or attach to the active job with the same kind and key.

        Args:
            kind: the sort of work ("table", "prune_eval", ...).
            fn: the work; gets a JobContext, returns the job's result.
            key: identity of the work; None makes a fresh key (never shared).
            label: a short description; defaults to "kind key".
        Returns:
            The new job, or the queued/running one it attached to.
        """
        with self._lock:
            job_id = f"{kind}-{next(self._ids)}"
            key = job_id if key is None else str(key)
            for existing in self._jobs.values():
                if existing.kind == kind and existing.key == key and existing.active:
                    return existing
            job = Job(id=job_id, kind=kind, key=key, label=label or f"{kind} {key}", fn=fn)
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
            except BaseException as exc:  # noqa: BLE001 - a worker thread must record every failure
                if not isinstance(exc, GapError):
                    log.exception("job %s (%s) failed", job.id, job.label)
                status = CANCELLED if job.cancel_event.is_set() else FAILED
                with job._lock:
                    job._finish_locked(status, error=one_line(exc))
            else:
                with self._lock:  # lock order: manager, then job
                    with job._lock:
                        job._finish_locked(DONE, result=result)
                    self._last_done[(job.kind, job.key)] = job
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
        return [
            j
            for j in found
            if (kind is None or j.kind == kind) and (key is None or j.key == key) and (not active_only or j.active)
        ]

    def active(self, kind: str | None = None, key: str | None = None) -> Job | None:
        """The queued or running job of this kind (and key), if any; the newest when several."""
        running = self.jobs(kind, key, active_only=True)
        return running[-1] if running else None

    def last_result(self, kind: str, key: str) -> Any:
        """The result of the newest successful job with this kind and key (failed ones never replace it)."""
        with self._lock:
            job = self._last_done.get((kind, key))
        return None if job is None else job.result

    def cancel(self, job_id: str) -> bool:
        """Ask one job to stop; False when there is no such active job."""
        job = self.get(job_id)
        if job is None or not job.active:
            return False
        job.cancel()
        return True

    def cancel_all(self) -> None:
        for job in self.jobs(active_only=True):
            job.cancel()

    def wait_all(self, timeout: float | None = None) -> bool:
        """Wait for every current job to end; True when all did within ``timeout``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for job in self.jobs():
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not job.wait(left):
                return False
        return True

    def forget(self, job_id: str) -> None:
        """Drop a finished job from the listing (an active one stays)."""
        with self._lock:
            job = self._jobs.get(job_id)
            if job is not None and not job.active:
                del self._jobs[job_id]

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
# (`shared_model`), used only for plain forward passes and for its geometry, and work that
# registers hooks, masks weights in place (exact table cells, evo) or slices them (surgery)
# runs on `LoadedModel.copy()`, a deep copy of the weights that shares the tokenizer.
MAX_SHARED_MODELS = 2
_shared: dict[str, LoadedModel] = {}
_shared_lock = threading.Lock()


def shared_model(name: str, device: DeviceSpec | None = None) -> LoadedModel:
    """The dense LoadedModel for ``name`` (on ``device``; None: CPU float32), loaded once per process. Never modify it.

    Raises:
        GapError: from models.load_model (unknown name, unreadable weights, a device this machine lacks, ...).
    """
    key = name if device is None else f"{name}|{device.device}|{device.dtype}|{device.stream}"
    with _shared_lock:
        lm = _shared.pop(key, None)
        if lm is None:
            lm = load_model(name, device)
        _shared[key] = lm  # most recently used last
        while len(_shared) > MAX_SHARED_MODELS:
            _shared.pop(next(iter(_shared)))
        return lm


# ---- the tasks the app runs --------------------------------------------------------------
# Each returns a work function for `JobManager.submit`; the work itself is the pipeline's.


def table_task(model_name: str, spec, device: DeviceSpec | None = None, cells=None) -> WorkFn:
    """Build (or read from the cache) the loss table of ``model_name`` under ``spec``; the result is the LossTable.

    Args:
        device: where the model runs (None: CPU float32).
        cells: who measures exact cells (``tables.distributed.RayCells``); None: this process.
    """

    def work(ctx: JobContext):
        ctx.stage("loading the model", 0, 0)
        lm = shared_model(model_name, device).copy()  # an exact build masks weights cell by cell
        ctx.check_cancelled()
        unit = "cells" if spec.estimator == "exact" else "calibration batches"

        def progress(done: int, total: int, eta: float | None = None) -> None:
            ctx.progress(done, total, eta, message=f"{spec.estimator} table: {done} of {total} {unit}")

        return loss_table(lm, spec, progress=progress, cancel=ctx.cancel, stage=ctx.say, cells=cells)

    return work


def baselines_task(model_name: str, table, budgets, allocators, constraints) -> WorkFn:
    """Baseline plans at a few budgets (`pipeline.baseline_rows`); the result is its rows."""

    def work(ctx: JobContext):
        ctx.stage("loading the model", 0, 0)
        lm = shared_model(model_name).copy()  # FLAP and OWL hook the model
        return baseline_rows(lm, table, budgets, allocators, constraints, step=ctx.stage, cancel=ctx.cancel)

    return work


def prune_eval_task(model_name: str, eval_settings, **run) -> WorkFn:
    """Prune a copy, measure, evaluate and record (`pipeline.prune_and_evaluate`); the result is its dict.

    Args:
        model_name: the dense model (built-in name, folder or hub id).
        eval_settings: evaluate.EvalSettings.
        run: the keyword arguments of `pipeline.prune_and_evaluate` (table, budget,
            allocator, constraints, plan, checkpoint_dir, history_path).
    """

    def work(ctx: JobContext):
        ctx.stage("loading the dense model", 0, 6)
        dense = shared_model(model_name)  # forward passes only
        return prune_and_evaluate(dense, eval_settings, step=ctx.stage, cancel=ctx.cancel, **run)

    return work


def recover_task(checkpoint: str, settings, out_dir) -> WorkFn:
    """Fine-tune a saved checkpoint (`recover.recover`), resuming the run saved for ``out_dir``
    when there is one; the result is its RecoveryResult as a dict.

    Args:
        checkpoint: a pruned checkpoint folder (loaded privately: training changes its weights).
        settings: recover.RecoverySettings.
        out_dir: the recovered checkpoint's folder (see `recover.app_output_dir`).
    """
    def work(ctx: JobContext):
        ctx.stage("loading the checkpoint", 0, settings.steps)
        lm = load_model(str(checkpoint))
        ctx.check_cancelled()
        return recover(lm, settings, progress=ctx.progress, cancel=ctx.cancel, out_dir=out_dir, resume=True).to_dict()

    return work
