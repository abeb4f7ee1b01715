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

from explorer import common, ownership
from gap_engine.pipeline.jobs import manager

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
        assert common.READ_ONLY_JOB in texts(viewer.caption)
        assert viewer.query_params["jobs"] == job.id  # the link stays a link to the running job

        sender = start(query=link, token=started_here)  # the sender's reload (or second tab)
        assert "app_cancel_table" in cancel_buttons(sender) and f"app_sidebar_cancel_{job.id}" in cancel_buttons(sender)
        assert "this tab's" in texts(sender.caption)
        sender.button(key="app_cancel_table").click().run()
        assert job.snapshot()["cancelling"]
    finally:
        gate.set()
    assert job.wait(30) and job.status == "cancelled"
