"""Background jobs: status life cycle, progress, cancel, attach-by-key, failures."""

from __future__ import annotations

import sys
import threading
import time

import pytest
from conftest import stop_jobs, wait_for, wait_jobs

from gap_engine.core.errors import CancelledError, TableError, one_line
from gap_engine.pipeline.jobs import CANCELLED, DONE, FAILED, QUEUED, RUNNING, JobManager, manager


@pytest.fixture
def jobs():
    m = JobManager(max_running=2)
    yield m
    stop_jobs(m, timeout=10)


def test_done_job_keeps_result_progress_and_times(jobs):
    def work(ctx):
        for i in range(5):
            ctx.progress(i + 1, 5, eta=(4 - i) * 0.01)
        ctx.say("finishing")
        return {"answer": 42}

    job = jobs.submit("demo", work, key="k")
    assert job.wait(5)
    assert job.status == DONE
    assert job.result == {"answer": 42}
    assert job.error is None
    snap = job.snapshot()
    assert snap["done"] == snap["total"] == 5 and snap["fraction"] == 1.0
    assert snap["message"] == "finishing"
    assert job.started is not None and job.finished >= job.started >= job.created


def test_progress_is_visible_while_running(jobs):
    gate = threading.Event()

    def work(ctx):
        ctx.progress(3, 10, eta=7.0, message="cells")
        gate.wait(5)
        return None

    job = jobs.submit("demo", work)
    assert wait_for(lambda: job.snapshot()["done"] == 3)
    snap = job.snapshot()
    assert snap["status"] == RUNNING and snap["total"] == 10 and snap["eta"] == 7.0
    assert snap["fraction"] == pytest.approx(0.3)
    assert job.active
    gate.set()
    assert job.wait(5) and job.status == DONE


def test_same_key_attaches_to_the_running_job(jobs):
    gate = threading.Event()
    calls = []

    def work(ctx):
        calls.append(1)
        gate.wait(5)
        return len(calls)

    first = jobs.submit("table", work, key="same")
    second = jobs.submit("table", work, key="same")
    other_kind = jobs.submit("eval", lambda ctx: "x", key="same")
    assert second is first
    assert other_kind is not first
    gate.set()
    assert first.wait(5)
    assert calls == [1]
    # once finished, the same key starts a fresh job
    third = jobs.submit("table", lambda ctx: "again", key="same")
    assert third is not first
    assert third.wait(5) and third.result == "again"


def test_a_job_keeps_the_owner_of_whoever_started_it(jobs):
    gate = threading.Event()
    first = jobs.submit("table", lambda ctx: gate.wait(5), key="same", owner="a" * 32)
    attached = jobs.submit("table", lambda ctx: None, key="same", owner="b" * 32)
    assert attached is first and first.owner == "a" * 32  # asking again attaches; the starter stays the owner
    assert jobs.submit("eval", lambda ctx: None).owner is None  # a script's job: nobody's
    assert "owner" not in first.snapshot() and "a" * 32 not in str(first.snapshot())  # pages show snapshots, never owners
    gate.set()
    assert first.wait(5)


def test_cancel_through_the_event(jobs):
    started = threading.Event()

    def work(ctx):
        started.set()
        while not ctx.cancel.is_set():
            time.sleep(0.005)
        raise CancelledError("stopped after 3 of 10 cells")

    job = jobs.submit("table", work, key="c")
    assert started.wait(5)
    assert jobs.cancel(job.id)
    assert job.wait(5)
    assert job.status == CANCELLED
    assert job.error == "stopped after 3 of 10 cells"
    assert not jobs.cancel(job.id)  # nothing left to cancel


def test_check_cancelled_helper(jobs):
    started = threading.Event()

    def work(ctx):
        started.set()
        while True:
            ctx.check_cancelled()
            time.sleep(0.005)

    job = jobs.submit("demo", work)
    assert started.wait(5)
    job.cancel()
    assert job.wait(5) and job.status == CANCELLED


def test_gap_error_is_shown_as_its_message(jobs):
    def work(ctx):
        raise TableError("unknown criterion 'x'; choose one of magnitude, wanda")

    job = jobs.submit("table", work)
    assert job.wait(5)
    assert job.status == FAILED
    assert job.error == "unknown criterion 'x'; choose one of magnitude, wanda"


def test_other_exceptions_become_one_line(jobs, caplog):
    def work(ctx):
        raise ValueError("bad value\nsecond line that must not show")

    job = jobs.submit("demo", work)
    assert job.wait(5)
    assert job.status == FAILED
    assert job.error == "ValueError: bad value"
    assert "\n" not in job.error


def test_failure_keeps_the_earlier_result(jobs):
    good = jobs.submit("table", lambda ctx: "table v1", key="t")
    assert good.wait(5)
    bad = jobs.submit("table", lambda ctx: (_ for _ in ()).throw(TableError("broken")), key="t")
    assert bad.wait(5) and bad.status == FAILED
    assert bad.result is None
    assert good.result == "table v1"  # the earlier job is untouched


def test_queued_jobs_wait_for_a_slot_and_can_be_cancelled():
    jobs = JobManager(max_running=1)
    gate = threading.Event()
    order = []

    def first_task(ctx):
        gate.wait(5)
        order.append("first ended")

    def second_task(ctx):
        order.append("second started")
        return "ran"

    first = jobs.submit("demo", first_task)
    assert wait_for(lambda: first.status == RUNNING)
    second = jobs.submit("demo", second_task)
    third = jobs.submit("demo", lambda ctx: "ran too")
    assert second.status == QUEUED and third.status == QUEUED
    third.cancel()
    assert third.status == CANCELLED and third.wait(0)
    gate.set()
    assert second.wait(5) and second.result == "ran"
    assert order == ["first ended", "second started"]  # the only slot was held until the first ended
    assert wait_jobs(jobs, 5)
    assert third.status == CANCELLED and third.result is None


def test_listing_and_lookup(jobs):
    a = jobs.submit("table", lambda ctx: 1, key="a")
    b = jobs.submit("eval", lambda ctx: 2, key="b")
    assert wait_jobs(jobs, 5)
    assert jobs.get(a.id) is a and jobs.get("nope") is None and jobs.get(None) is None
    assert [j.id for j in jobs.jobs(kind="eval")] == [b.id]
    assert jobs.active() is None


def test_finished_jobs_are_trimmed():
    jobs = JobManager(max_running=2, keep_finished=3)
    for i in range(6):
        jobs.submit("demo", lambda ctx, i=i: i).wait(5)
    jobs.submit("demo", lambda ctx: "last").wait(5)
    assert len(jobs.jobs()) <= 4


def test_module_singleton_and_one_line():
    assert manager() is manager()
    assert one_line(TableError("x")) == "x"
    assert one_line(RuntimeError("")) == "RuntimeError"


@pytest.mark.slow
def test_engine_import_leaves_streamlit_out():
    import subprocess

    code = "import gap_engine.pipeline.jobs, gap_engine.evaluate.history, sys; print('streamlit' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
