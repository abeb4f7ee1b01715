"""The one hooks object (core.progress.Hooks) and the surfaces that produce it: a background
job's context, the CLI's stderr progress and the recover command's step lines."""

from __future__ import annotations

import io
import threading

import pytest
from conftest import stop_jobs, wait_for

from gap_engine.cli.output import StderrProgress
from gap_engine.cli.recover_commands import _StageProgress
from gap_engine.core.errors import CancelledError
from gap_engine.core.progress import CELLS, NO_HOOKS, Hooks
from gap_engine.pipeline.jobs import DONE, JobManager


def test_empty_hooks_report_nothing_and_never_cancel():
    NO_HOOKS.report(1, 2, 0.5)
    NO_HOOKS.enter(CELLS)
    NO_HOOKS.say("nothing listens")
    NO_HOOKS.check_cancelled("not raised")
    assert not NO_HOOKS.is_cancelled()


def test_hooks_forward_each_part_and_raise_once_cancelled():
    seen: list[tuple] = []
    event = threading.Event()
    hooks = Hooks(
        progress=lambda done, total, eta: seen.append(("progress", done, total, eta)),
        stage=lambda name: seen.append(("stage", name)),
        message=lambda text: seen.append(("message", text)),
        cancel=event,
    )
    hooks.enter(CELLS)
    hooks.report(3, 4)
    hooks.say("three of four")
    assert seen == [("stage", CELLS), ("progress", 3, 4, None), ("message", "three of four")]
    hooks.check_cancelled("not yet")
    event.set()
    assert hooks.is_cancelled()
    with pytest.raises(CancelledError, match="stopped at 3"):
        hooks.check_cancelled("stopped at 3")
    quiet = hooks.but(progress=None)
    quiet.report(4, 4)
    assert len(seen) == 3 and quiet.cancel is event and hooks.progress is not None


def test_a_job_context_gives_hooks_that_show_in_the_job():
    manager = JobManager()
    release = threading.Event()

    def work(ctx):
        hooks = ctx.hooks()
        ctx.plan(("load model", CELLS))
        hooks.enter(CELLS)
        hooks.report(2, 5, 9.0)
        hooks.say("two of five cells")
        release.wait(10)
        return hooks.is_cancelled()

    job = manager.submit("hooks", work)
    try:
        assert wait_for(lambda: job.progress.message == "two of five cells")
        snapshot = job.snapshot()
        assert (snapshot["stage"], snapshot["done"], snapshot["total"], snapshot["eta"]) == (CELLS, 2, 5, 9.0)
        release.set()
        assert wait_for(lambda: job.status == DONE)
        assert job.result is False
    finally:
        release.set()
        stop_jobs(manager, timeout=10)


def test_stderr_progress_hooks_print_stages_messages_and_steps():
    stream = io.StringIO()
    hooks = StderrProgress("table cells", stream=stream, every=0.0).hooks()
    hooks.enter(CELLS)
    hooks.say("round 1 of 2")
    hooks.report(4, 4, 0.0)
    assert stream.getvalue().splitlines() == [CELLS, "round 1 of 2", "table cells: 4/4 (100%), eta 0s"]


def test_recover_lines_put_the_message_beside_its_step():
    stream = io.StringIO()
    hooks = _StageProgress(stream).hooks()
    for _ in range(2):  # a phase told twice is printed once
        hooks.say("reading the calibration text")
        hooks.report(0, 2, None)
    hooks.say("mezo step 2/2: loss 1.0000")
    hooks.report(2, 2, 0.0)
    assert stream.getvalue() == "\rrecover: reading the calibration text\n\rrecover: mezo step 2/2: loss 1.0000, eta 0s   \n"
