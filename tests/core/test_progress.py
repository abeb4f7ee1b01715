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
from gap_engine.core.progress import CELLS, HELD_OUT, LOAD_MODEL, NO_HOOKS, PACE_PRIOR_S, SAVE, Hooks, JobProgress, active, reporting, steps
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
    quiet = hooks.replaced(progress=None)
    quiet.report(4, 4)
    assert len(seen) == 3 and quiet.cancel is event and hooks.progress is not None


def test_steps_poll_the_stage_cancel_before_each_item_and_report_after_it():
    told: list[tuple] = []
    event = threading.Event()
    hooks = Hooks(progress=lambda done, total, eta: told.append((done, total, eta)), cancel=event)
    walked = []
    with pytest.raises(CancelledError, match="toy pass cancelled after 2 of 3 blocks"):
        with reporting(hooks):
            for item in steps(["a", "b", "c"], "toy pass", "blocks"):
                walked.append(item)
                if item == "b":
                    event.set()  # asked while block "b" runs: "c" never starts
    assert walked == ["a", "b"] and told == [(1, 3, None), (2, 3, None)]
    timed: list[float | None] = []
    with reporting(Hooks(progress=lambda done, total, eta: timed.append(eta))):
        assert list(steps(range(4), "timed pass", "batches", timed=True)) == [0, 1, 2, 3]
    assert len(timed) == 4 and all(isinstance(eta, float) for eta in timed) and timed[-1] == 0.0
    quiet_told: list[tuple] = []
    stop = threading.Event()
    with pytest.raises(CancelledError, match="backward pass cancelled after 1 of 3 blocks"):
        with reporting(Hooks(progress=lambda *told: quiet_told.append(told), cancel=stop)):
            for block in steps(range(2, -1, -1), "backward pass", "blocks", quiet=True):
                walked.append(block)
                stop.set()  # a quiet walk still polls the cancel: block 1 never starts
    assert walked[-1:] == [2] and quiet_told == []  # and tells nothing: its caller counts what it measures


def test_reporting_is_per_stage_and_per_thread():
    outer, inner = Hooks(message=lambda text: None), Hooks(message=lambda text: None)
    assert active() is NO_HOOKS  # outside any stage: nothing reported, never cancelled
    seen_in_thread = []
    with reporting(outer):
        with reporting(inner):
            assert active() is inner
            worker = threading.Thread(target=lambda: seen_in_thread.append(active()))
            worker.start()
            worker.join()
        assert active() is outer  # the enclosing stage's hooks come back
    assert active() is NO_HOOKS and seen_in_thread == [NO_HOOKS]  # a new thread reports to no one


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


# ---- a staged job's time left (JobProgress) ------------------------------------------------------
def _held_out_running(since: float) -> JobProgress:
    """A run in its held-out stage since ``since``, predicted 10 s, with 4 s of saving after it; its load took as predicted."""
    expected = {LOAD_MODEL: 2.0, HELD_OUT: 10.0, SAVE: 4.0}
    return JobProgress(stages=tuple(expected), expected=expected, stage=1, stage_started=since, stage_seconds={LOAD_MODEL: 2.0})


def test_the_time_left_never_goes_blank_when_a_stage_runs_past_its_prediction():
    p = _held_out_running(since=100.0)
    assert p.seconds_left(now=105.0) == pytest.approx(5.0 + 4.0) and not p.overrun(now=105.0)
    lefts = [p.seconds_left(now=100.0 + elapsed) for elapsed in (9.0, 10.0, 12.0, 20.0, 60.0)]
    assert all(left is not None for left in lefts), lefts
    assert lefts[1:] == sorted(lefts[1:]) and lefts[-1] == pytest.approx(0.25 * 60.0 + 4.0)  # revised from the time so far
    assert p.overrun(now=120.0) and p.overall(now=105.0) < p.overall(now=120.0) <= p.overall(now=160.0) < 1.0
    # No jump where the revision takes over (at 8 s of a 10 s prediction): the ETA a presenter reads moves smoothly.
    assert p.seconds_left(now=107.99) == pytest.approx(p.seconds_left(now=108.01), abs=0.05)
    # Steps counted: the rest of them at the rate so far.
    p.done, p.total = 3, 4
    assert p.seconds_left(now=130.0) == pytest.approx(30.0 / 3 + 4.0)


def test_later_stages_follow_the_pace_of_the_finished_ones():
    p = _held_out_running(since=100.0)
    p.stage_seconds = {LOAD_MODEL: 32.0}  # 30 s more than predicted: the job runs slower than its prices
    pace = (32.0 + PACE_PRIOR_S) / (2.0 + PACE_PRIOR_S)
    assert p.pace() == pytest.approx(pace)
    assert p.seconds_left(now=100.0) == pytest.approx((10.0 + 4.0) * pace)
    p.stage, p.eta = 2, 1.5  # the stage's own steps, once timed, tell its time
    assert p.seconds_left(now=200.0) == 1.5
