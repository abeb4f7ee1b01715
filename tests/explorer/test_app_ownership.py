"""Jobs and runs belong to the browser that started them; destructive actions ask first (AppTest).

A browser is its token (explorer/ownership.py: a cookie in a real browser; AppTest sends none, so
``start(token=...)`` gives a session its browser's token). A session opened from a shared link
in another browser watches a running job without its Cancel and lists the sender's runs without
a Delete; the browser that started them (a reload, a second tab) keeps both. Deleting a run
says what goes (the run, its checkpoint) before it is done, and the page that follows no longer
shows it. Same tiny real table and fresh cache as tests/explorer/test_app.py.
"""

from __future__ import annotations

import secrets
import threading

import pytest
from app_fixtures import cached_table, fresh_cache, start, texts, tiny_table  # noqa: F401

from explorer import ownership
from explorer.job_panel import READ_ONLY_JOB
from gap_engine.evaluate import history
from gap_engine.evaluate.history import RunRecord
from gap_engine.pipeline.jobs import manager
from gap_engine.plan.front import dp_front, front_rows
from gap_engine.plan.front_view import row_plan

pytestmark = pytest.mark.slow  # the real built-in model behind the pages


def cancel_buttons(at) -> list[str]:
    return [b.key for b in at.button if b.key and "cancel" in b.key]


def test_a_shared_link_watches_a_running_job_read_only_and_its_browser_still_cancels_it(fresh_cache):
    started_here = secrets.token_urlsafe(32)
    gate = threading.Event()

    def work(ctx):
        ctx.plan(("load model", "cells"), expected={"load model": 5.0, "cells": 60.0}, basis="a test")
        ctx.enter("cells")
        ctx.progress(1, 10, eta=50.0, message="cell 1 of 10")
        gate.wait(60)
        ctx.check_cancelled()

    job = manager().submit("table", work, label="a build in the sender's browser", owner=ownership.owner_of(started_here))
    try:
        link = {"jobs": job.id}
        viewer = start(query=link)  # the link opened in another browser
        assert viewer.session_state["app_jobs"]["table"] == job.id  # it watches the job: progress, and its result
        assert any("a build in the sender's browser" in str(p.proto.text) for p in viewer.get("progress"))
        assert cancel_buttons(viewer) == []  # neither the page's Cancel nor the sidebar's
        assert READ_ONLY_JOB in texts(viewer.caption)
        assert viewer.query_params["jobs"] == job.id  # the link stays a link to the running job

        sender = start(query=link, token=started_here)  # the sender's reload (or second tab)
        assert "app_cancel_table" in cancel_buttons(sender) and f"app_sidebar_cancel_{job.id}" in cancel_buttons(sender)
        assert "Started in this tab" in texts(sender.caption)
        sender.button(key="app_cancel_table").click().run()
        assert job.snapshot()["cancelling"]
    finally:
        gate.set()
    assert job.wait(30) and job.status == "cancelled"


def record_run(plan, checkpoint: str | None) -> int:
    """A finished run of ``plan`` in the history, as a prune-and-evaluate job records it."""
    report = {
        "model": f"{plan.model} (pruned)",
        "params": plan.params["pruned_total"],
        "perplexity": {"news-sample": 40.0},
        "dense": {"params": plan.params["dense_total"], "perplexity": {"news-sample": 33.0}},
        "kl_to_dense": {"news-sample": 0.2},
        "top1_agreement": {"news-sample": 0.7},
        "generations": [],
    }
    record = RunRecord.from_report(
        plan.to_dict(),
        report,
        allocator="dp",
        table_key=plan.table_key,
        budget=plan.budget,
        params={"plan_hash": plan.content_hash(), "objective": "nll"},
        predicted_loss=plan.predicted_loss,
        actual_loss=plan.predicted_loss,
        checkpoint=checkpoint,
    )
    return history.record_run(record)


def test_a_run_is_deleted_only_by_its_browser_after_saying_what_goes_and_leaves_the_page_at_once(cached_table, smol):
    front = front_rows(cached_table, dp_front(cached_table))
    plan = row_plan(smol, cached_table, front[len(front) // 3])
    checkpoint = history.new_checkpoint_dir("dp", plan.budget)
    checkpoint.mkdir(parents=True)
    (checkpoint / "model.safetensors").write_bytes(b"weights")
    mine, sender = secrets.token_urlsafe(32), secrets.token_urlsafe(32)
    my_run = record_run(plan, str(checkpoint))
    history.set_run_maker(my_run, ownership.owner_of(mine))
    their_run = record_run(plan, None)
    history.set_run_maker(their_run, ownership.owner_of(sender))
    link = {"table": cached_table.key, "run": str(my_run)}

    viewer = start("explorer/evaluate.py", query=link)  # the link in a third browser: read-only
    assert any(s.value.startswith(f"Run {my_run}:") for s in viewer.subheader)
    assert not [b for b in viewer.button if b.key and b.key.startswith("eval_delete")]
    assert "2 of these runs were made in another browser: only that browser can delete them." in texts(viewer.caption)

    at = start("explorer/evaluate.py", query=link, token=mine)
    assert at.selectbox(key="eval_delete_id").options == [f"run {my_run}"]  # not the sender's run
    at.button(key="eval_delete").click().run()
    (question,) = [w.value for w in at.warning if "cannot be undone" in w.value]
    assert question.startswith(f"Delete run {my_run}?") and str(checkpoint) in question and "checkpoint" in question
    assert [r.id for r in history.runs()] == [my_run, their_run] and checkpoint.is_dir()  # asked, nothing deleted
    at.button(key="eval_delete_keep").click().run()
    assert not [w for w in at.warning if "cannot be undone" in w.value]
    assert [r.id for r in history.runs()] == [my_run, their_run]

    at.button(key="eval_delete").click().run()
    assert at.button(key="eval_delete_confirm").label == f"Delete run {my_run} and its checkpoint"
    at.button(key="eval_delete_confirm").click().run()
    assert not at.exception, [e.value for e in at.exception]
    assert [r.id for r in history.runs()] == [their_run] and not checkpoint.exists()
    # The page drawn right after it no longer shows the run: no panel, no link to it.
    assert at.session_state["app_last_run"] is None
    assert not any(s.value.startswith(f"Run {my_run}:") for s in at.subheader)
    assert "run" not in at.query_params
    assert f"Deleted run {my_run} and its checkpoint." in texts(at.success)
    assert not [b for b in at.button if b.key and b.key.startswith("eval_delete")]  # the sender's run is not mine to delete
