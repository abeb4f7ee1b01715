"""Job stages, the ETA from the predicted stage times, and cancel inside a forward or backward pass.

Tiny two-layer models read real tokenised text (the SmolLM2 tokenizer); a table job runs the
pipeline's real stages on one of them, placed in the job layer's model pool.
"""

from __future__ import annotations

import threading

import pytest
import torch
from conftest import wait_for

from gap_engine.core.config import WindowSpec
from gap_engine.core.device import DeviceSpec
from gap_engine.core.errors import CancelledError
from gap_engine.core.interrupt import cancel_checks, run_unless_cancelled
from gap_engine.core.progress import CELLS, DENSE_PASS, GRADIENT_PASS, LOAD_MODEL, NO_HOOKS, READ_TEXT, SCORE_UNITS, Hooks, StageTimer
from gap_engine.pipeline import jobs
from gap_engine.pipeline.jobs import CANCELLED, DONE, JobManager, JobProgress
from gap_engine.pipeline.stages import table_stages
from gap_engine.tables import cache
from gap_engine.tables.artefact import TableSpec

EXACT = TableSpec(windows=WindowSpec("news-sample", n_samples=4, seq_len=16, batch_size=1), estimator="exact", rate_grid=(0.0, 0.5))
FISHER = TableSpec(windows=WindowSpec("news-sample", n_samples=4, seq_len=16, batch_size=1), estimator="fisher", rate_grid=(0.0, 0.5))


@pytest.fixture
def pool(monkeypatch, tmp_path):
    """The job layer's model pool holding a tiny llama (as if loaded), in a fresh cache."""
    monkeypatch.setenv("GAP_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(jobs, "_shared", {})
    return jobs._shared


# ---- the progress of a job with stages ---------------------------------------------------------
def test_time_left_counts_the_stages_still_to_come():
    p = JobProgress(stages=("load model", "read text", "cells"), expected={"load model": 10.0, "read text": 2.0, "cells": 30.0})
    assert p.expected_total() == 42.0
    assert p.seconds_left(now=100.0) == 42.0  # before the first stage: the whole job
    p.stage, p.stage_started = 0, 100.0
    assert p.seconds_left(now=104.0) == pytest.approx(6.0 + 32.0)  # the load's rest, then the others
    assert 0.0 < p.overall(now=104.0) < 10.0 / 42.0
    p.stage, p.stage_started, p.done, p.total, p.eta = 2, 110.0, 3, 10, 21.0
    assert p.seconds_left(now=111.0) == 21.0  # the cells' own estimate, nothing after them
    assert p.overall(now=111.0) == pytest.approx((12.0 + 30.0 * 0.3) / 42.0)

    unknown = JobProgress(stages=("load model", "cells"), expected={"cells": 5.0}, stage=0, stage_started=0.0)
    assert unknown.expected_total() is None and unknown.seconds_left(now=1.0) is None  # no load time known: no ETA


def test_a_job_reports_its_stages_and_their_times():
    m = JobManager()
    gate = threading.Event()

    def work(ctx):
        ctx.plan(("load model", "cells"), {"load model": 0.0, "cells": 60.0}, "from 1 earlier build")
        ctx.enter("load model")
        ctx.enter("cells")
        ctx.progress(1, 4, None)
        gate.wait(5)
        return "ok"

    job = m.submit("table", work, params={"model": "m"})
    try:
        assert wait_for(lambda: job.snapshot()["stage"] == "cells" and job.snapshot()["done"] == 1, timeout=10)
        snap = job.snapshot()
        assert snap["stages"] == ["load model", "cells"] and snap["stage_index"] == 1
        assert snap["expected_total"] == 60.0 and snap["expected_basis"] == "from 1 earlier build"
        assert snap["seconds_left"] is not None and snap["seconds_left"] <= 60.0
        assert "load model" in snap["stage_seconds"] and snap["params"] == {"model": "m"}
    finally:
        gate.set()
    assert job.wait(5) and job.status == DONE
    assert set(job.snapshot()["stage_seconds"]) == {"load model", "cells"}


def test_cancel_shows_cancelling_then_how_long_the_stop_took():
    m = JobManager()
    asked, go_on = threading.Event(), threading.Event()

    def work(ctx):
        ctx.plan(("cells",))
        ctx.enter("cells")
        asked.set()
        go_on.wait(5)
        ctx.check_cancelled()

    job = m.submit("table", work)
    assert asked.wait(5)
    job.cancel()
    assert job.snapshot()["cancelling"] and job.snapshot()["cancel_latency"] is None
    go_on.set()
    assert job.wait(5) and job.status == CANCELLED
    snap = job.snapshot()
    assert not snap["cancelling"] and snap["cancel_latency"] >= 0.0 and snap["stage"] == "cells"


# ---- cancel inside the model ---------------------------------------------------------------
def _count_blocks(lm):
    calls = []
    handles = [layer.register_forward_hook(lambda *a, i=i: calls.append(i)) for i, layer in enumerate(lm.adapter.layers(lm.model))]
    return calls, handles


def test_cancel_stops_a_forward_pass_at_the_next_block(make_tiny):
    lm = make_tiny("llama")
    cancel = threading.Event()
    calls, handles = _count_blocks(lm)
    trigger = lm.adapter.layers(lm.model)[0].register_forward_hook(lambda *a: cancel.set())  # cancel during block 0
    ids = torch.randint(10, 1000, (1, 8))
    with pytest.raises(CancelledError, match="stopped here"), cancel_checks(lm, Hooks(cancel=cancel), "stopped here"):
        lm.model(ids)
    assert calls == [0]  # block 1 never ran
    trigger.remove()
    cancel.clear()
    with cancel_checks(lm, Hooks(cancel=cancel), "not now"):
        lm.model(ids)  # no cancel: the hooks change nothing
    assert calls == [0, 0, 1]
    for handle in handles:
        handle.remove()


def test_cancel_stops_a_backward_pass_and_only_in_its_own_thread(make_tiny):
    lm = make_tiny("llama")
    cancel = threading.Event()
    ids = torch.randint(10, 1000, (1, 8))
    for parameter in lm.model.parameters():
        parameter.requires_grad_(True)  # as a gradient pass has them
    with cancel_checks(lm, Hooks(cancel=cancel), "stopped in backward"):
        loss = lm.model(ids, labels=ids).loss
        cancel.set()  # after the forward pass, before the backward pass
        with pytest.raises(CancelledError, match="stopped in backward"):
            loss.backward()
        other = {}
        thread = threading.Thread(target=lambda: other.setdefault("logits", lm.model(ids).logits))
        thread.start()
        thread.join(60)
        assert other["logits"].shape[:2] == (1, 8)  # another thread's pass on the same model is not stopped
    with torch.no_grad():
        assert lm.model(ids).logits.shape[:2] == (1, 8)  # hooks removed on exit


def test_waiting_on_work_without_a_cancel_point_stops_at_once():
    cancel, release, finished = threading.Event(), threading.Event(), threading.Event()

    def work():
        release.wait(30)
        finished.set()
        return 1

    timer = threading.Timer(0.1, cancel.set)
    timer.start()
    with pytest.raises(CancelledError, match="gave up"):
        run_unless_cancelled(work, Hooks(cancel=cancel), "gave up")
    assert not finished.is_set()  # the caller stopped waiting while the work still ran
    release.set()
    assert run_unless_cancelled(lambda: 2, NO_HOOKS, "unused") == 2
    with pytest.raises(ValueError):
        run_unless_cancelled(lambda: int("x"), Hooks(cancel=threading.Event()), "unused")


# ---- a table job on a tiny model: stages, their times, an ETA, cancel within one batch ----------
def test_table_job_stages_are_recorded(pool, make_tiny):
    lm = make_tiny("llama")
    pool[lm.name] = lm
    m = JobManager()
    job = m.submit("table", jobs.table_task(lm.name, EXACT))
    assert job.wait(300) and job.status == DONE, job.snapshot()
    snap = job.snapshot()
    assert snap["stages"] == [LOAD_MODEL, READ_TEXT, SCORE_UNITS, DENSE_PASS, CELLS] == list(table_stages(EXACT))
    assert set(snap["stage_seconds"]) == set(snap["stages"])
    row = next(r for r in cache.list_tables() if r["key"] == job.result.key)
    assert set(row["stage_seconds"]) == {READ_TEXT, SCORE_UNITS, DENSE_PASS, CELLS}  # what the engine timed


@pytest.mark.parametrize("spec, stage", [(EXACT, DENSE_PASS), (FISHER, GRADIENT_PASS)])
def test_cancel_during_a_calibration_batch_stops_inside_it(pool, make_tiny, spec, stage):
    """The cancel lands in the middle of a batch's pass; no later block runs in the job's thread."""
    lm = make_tiny("llama")
    pool[lm.name] = lm
    m = JobManager()
    holder, after = {}, []

    def watch(index):  # the job works on a copy of the model (deepcopy keeps these hooks): go by block index
        job = holder.get("job")
        if job is None or threading.current_thread().name != f"gap-job-{job.id}":
            return
        if job.cancel_event.is_set():
            after.append(index)  # a block that finished after the cancel
        elif index == 0 and job.snapshot()["stage"] == stage:
            job.cancel()  # during block 0 of the first batch of the stage

    handles = [layer.register_forward_hook(lambda *a, i=i: watch(i)) for i, layer in enumerate(lm.adapter.layers(lm.model))]
    try:
        holder["job"] = job = m.submit("table", jobs.table_task(lm.name, spec))
        assert job.wait(300), job.snapshot()
    finally:
        for handle in handles:
            handle.remove()
    snap = job.snapshot()
    assert job.status == CANCELLED and snap["stage"] == stage, snap
    assert after == [], after  # the next block's entry raised: no block ran after the cancel
    assert snap["done"] == 0  # the batch in progress never completed
    assert cache.list_tables() == []


def test_stage_timer_adds_up_a_stage_entered_twice():
    seen = []
    timer = StageTimer(seen.append)
    timer("a")
    timer("b")
    timer("a")
    seconds = timer.finish()
    assert seen == ["a", "b", "a"] and list(seconds) == ["a", "b"] and all(v >= 0 for v in seconds.values())
    assert timer.finish() == seconds


def test_a_model_in_memory_costs_its_next_job_no_load(pool, make_tiny, monkeypatch):
    lm = make_tiny("llama")
    monkeypatch.setattr(jobs, "load_model", lambda name, device=None: lm)
    assert not jobs.model_loaded("some-model")
    assert jobs.shared_model("some-model") is lm
    assert jobs.model_loaded("some-model")  # what the pages price at 0 s
    assert not jobs.model_loaded("some-model", DeviceSpec("cpu", "bfloat16"))  # another placement loads again
