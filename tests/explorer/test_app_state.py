"""The explorer's state across reloads and tabs, and the progress of its jobs (Streamlit's AppTest).

A reload is a new session given the URL the old one left (``AppTest.query_params``) in the same
browser (its token, explorer/ownership.py): it opens the table the user had, not the newest
cached one, and attaches to a running build with its form filled in. Jobs run in the server: a
tab that did not start a job lists it in the sidebar and can watch it; a tab of the browser
that started it can also cancel it. The real SmolLM2-135M runs every job.
"""

from __future__ import annotations

import json
import time

import pytest
from app_fixtures import cached_table, fresh_cache, start, start_exact_build, texts, tiny_table  # noqa: F401
from streamlit.testing.v1 import AppTest

from explorer import ownership
from gap_engine.core.config import WindowSpec
from gap_engine.pipeline.stages import loss_table
from gap_engine.tables.artefact import TableSpec

pytestmark = pytest.mark.slow  # the real built-in model behind every job

OTHER_SPEC = TableSpec(windows=WindowSpec("news-sample", n_samples=2, seq_len=8), estimator="taylor", rate_grid=(0.0, 0.5))


def reload(at: AppTest, page: str | None = None) -> AppTest:
    """A new session opened at the URL ``at`` shows, in the same browser (a reload, or the link
    pasted in a second tab)."""
    return start(page, query=at.query_params, token=at.session_state[ownership.TOKEN_KEY])


def progress_texts(at: AppTest) -> list[str]:
    return [el.proto.text for el in at.get("progress")]


def test_the_url_keeps_the_table_and_budget_the_user_had(cached_table, smol):
    newer = loss_table(smol, OTHER_SPEC)  # now the newest table in the cache
    at = start()
    assert at.session_state["app_table"].key == newer.key  # no URL: the newest cached table
    at.selectbox(key="setup_cached_key").set_value(cached_table.key).run()
    at.button(key="setup_load").click().run()
    assert at.session_state["app_table"].key == cached_table.key
    assert at.query_params["table"] == cached_table.key
    budget = float(at.query_params["budget"])
    assert budget == at.session_state["app_budget"]

    again = reload(at)
    assert again.session_state["app_table"].key == cached_table.key  # the user's table, not the newest
    assert again.session_state["app_budget"] == budget
    assert not any("most recent cached table" in t for t in texts(again.info))

    at.query_params.update(table="no-such-table")
    broken = reload(at)
    said = "The link names the loss table `no-such-table`, which this cache does not hold"
    assert any(said in t for t in texts(broken.warning)), texts(broken.warning)
    assert broken.session_state["app_table"] is None  # not silently another table
    elsewhere = reload(at, "explorer/planner.py")  # a page that needs a table says why it has none, not Setup alone
    assert any(said in t for t in texts(elsewhere.warning)), texts(elsewhere.warning)


def test_a_newer_table_of_a_deleted_model_folder_is_not_opened_unasked(cached_table, tmp_path, smol_tokenizer):
    # What a test suite or a scratch experiment leaves behind: the newest table names a folder
    # that is gone; `make run` opens the built-in model's table instead and lists both.
    import shutil

    from conftest import tiny_lm

    from gap_engine.model.loading import load_model

    folder = tmp_path / "scratch" / "tiny"
    made = tiny_lm("llama", smol_tokenizer)
    made.model.save_pretrained(folder)
    made.tokenizer.save_pretrained(folder)
    gone = loss_table(load_model(str(folder)), OTHER_SPEC)
    shutil.rmtree(folder)
    at = start()
    assert at.session_state["app_table"].key == cached_table.key
    said = next(t for t in texts(at.info) if "most recent cached table of a model that is still there" in t)
    assert f"`{gone.key}`" in said and "The cache holds 2" in said


def test_a_reload_and_a_second_tab_see_the_running_build_and_can_cancel_it(fresh_cache):
    at = start()
    job = start_exact_build(at)
    assert job.active and at.query_params["jobs"] == job.id

    # From the first second: the stage it is in, out of all of them, before any cell is measured.
    shown = progress_texts(at)
    assert any("stage 1 of 5, load model" in t or "stage 2 of 5, read text" in t for t in shown), shown
    assert job.snapshot()["stages"] == ["load model", "read text", "score units", "dense pass", "cells"]

    # A reload: the same job is watched again and the form shows its settings.
    again = reload(at)
    assert again.session_state["app_jobs"]["table"] == job.id
    assert again.radio(key="setup_estimator").value == "exact"
    assert again.number_input(key="setup_seq_len").value == 64
    assert any(t == "Started in this tab" for t in texts(again.caption))  # the sidebar lists it as this tab's job
    assert any(t.startswith("Building the loss table: stage") and "elapsed" in t for t in progress_texts(again)), progress_texts(again)

    # A second tab of the same browser with no link: the sidebar lists the job; Watch attaches to it.
    other = start(token=at.session_state[ownership.TOKEN_KEY])
    assert "table" not in other.session_state["app_jobs"]
    assert any("Running jobs (all tabs)" in t for t in texts(other.caption))
    other.button(key=f"app_watch_{job.id}").click().run()
    assert other.session_state["app_jobs"]["table"] == job.id

    # Cancel from the second tab, once the build is past loading the model.
    deadline = time.monotonic() + 240
    while job.active and job.snapshot()["stage_index"] < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert job.active, job.snapshot()
    other.button(key="app_cancel_table").click().run()
    assert job.snapshot()["cancelling"] or not job.active
    assert job.wait(120)
    again.run()
    assert job.status == "cancelled"
    warnings = texts(again.warning)
    assert any("was cancelled during" in t and "after the request" in t for t in warnings), warnings
    assert "jobs" not in again.query_params  # nothing runs any more


def test_runs_compared_side_by_side_with_changes_and_kept_in_the_url(cached_table, smol):
    from gap_engine.evaluate import history
    from gap_engine.plan.allocators import plan_from_table

    ids = []
    for allocator, budget, ppl, ratios in (("dp", 0.2, 12.0, [1.1, 1.3, 1.2]), ("uniform", 0.2, 15.0, None)):
        plan = plan_from_table(smol, cached_table, budget, allocator)
        throughput = {"prefill_speedup_repeats": ratios, "prefill_speedup_range": [min(ratios), max(ratios)]} if ratios else None
        record = history.RunRecord(
            model=smol.name, allocator=allocator, plan=plan.to_dict(), table_key=cached_table.key, budget=budget,
            params={"throughput": throughput}, dense_params=100, pruned_params=80,
            perplexity={"wiki-sample": ppl}, dense_perplexity={"wiki-sample": 10.0}, kl={"wiki-sample": 0.1},
            prefill_speedup=1.2 if ratios else None, seconds=30.0,
        )  # fmt: skip
        ids.append(history.record_run(record))
    at = start("explorer/evaluate.py")
    at.multiselect(key="eval_compare").set_value(ids).run()
    assert not at.exception
    frame = next(t.value for t in at.table if "measure" in t.value.columns)  # a static table: it wraps, nothing runs off the right
    row = frame.set_index("measure").loc["perplexity (wiki-sample)"]
    assert row["dense"] == "10.000"
    assert row[f"run {ids[0]}"] == "12.000 (+20.0% vs dense)"
    assert row[f"run {ids[1]}"] == f"15.000 (+50.0% vs dense, +25.0% vs run {ids[0]})"
    speed = frame.set_index("measure").loc["prefill speed vs dense"]
    assert speed[f"run {ids[0]}"] == "1.20x (1.10–1.30x over 3 repeats)"
    rates = [json.loads(el.proto.spec) for el in at.get("plotly_chart") if "run " in el.proto.spec and "attention" in el.proto.spec]
    assert rates and len(rates[0]["data"]) == 4  # two runs x (attention, MLP)
    assert at.query_params["runs"] == f"{ids[0]},{ids[1]}"
    again = reload(at, "explorer/evaluate.py")
    assert again.multiselect(key="eval_compare").value == ids


def test_a_reload_shows_the_finished_runs_result_panel(cached_table, smol):
    """The run on screen is in the URL, so a reload (a new session, the job's result gone) shows
    its panel again, read back from the history, instead of only its history row."""
    from gap_engine.evaluate import history
    from gap_engine.plan.allocators import plan_from_table

    plan = plan_from_table(smol, cached_table, 0.2, "dp")
    throughput = {"prefill_speedup": 1.2, "prefill_speedup_repeats": [1.1, 1.3, 1.2], "prefill_speedup_range": [1.1, 1.3]}
    record = history.RunRecord.from_report(
        plan.to_dict(),
        {"params": 80, "dense": {"params": 100, "perplexity": {"wiki-sample": 10.0}}, "perplexity": {"wiki-sample": 12.5},
         "kl_to_dense": {"wiki-sample": 0.25}, "throughput": throughput, "generations": [{"prompt": "The", "model": "a", "dense": "b"}]},
        allocator="dp", table_key=cached_table.key, budget=0.2, predicted_loss=plan.predicted_loss, actual_loss=0.3,
        params={"throughput": throughput, "plan_hash": plan.content_hash(), "objective": cached_table.spec.objective},
    )  # fmt: skip
    run_id = history.record_run(record)
    first = start("explorer/evaluate.py", query={"table": cached_table.key, "run": str(run_id)})
    again = reload(first, "explorer/evaluate.py")
    for at in (first, again):
        assert not at.exception
        assert at.query_params["run"] == str(run_id)
        assert any(h.value.startswith(f"Run {run_id}: dp at 20.00%") and plan.content_hash() in h.value for h in at.subheader)
        metrics = {m.label: m.value for m in at.metric}
        assert metrics["Perplexity (wiki-sample)"] == "12.50"
        assert metrics["Held-out KL to dense (wiki-sample)"] == "0.2500"
        assert metrics["Prefill speed vs dense"] == "1.20x"
    assert (
        "run" not in start("explorer/evaluate.py", query={"table": cached_table.key}).query_params
    )  # no run: no panel, nothing in the URL


def test_the_task_pickers_settings_are_kept_in_the_url(cached_table):
    """The task picker follows the URL state like the other settings: on/off, names, examples, folder."""
    at = start("explorer/evaluate.py")
    assert "eval_tasks" not in at.query_params  # the defaults leave the URL short
    at.text_input(key="eval_tasks").set_value("gap_wiki_next,my_task").run()
    at.number_input(key="eval_task_limit").set_value(7).run()
    at.text_input(key="eval_task_folder").set_value("/data/my-tasks").run()
    assert at.query_params["eval_tasks"] == "gap_wiki_next,my_task" and at.query_params["eval_task_limit"] == "7"
    again = reload(at, "explorer/evaluate.py")
    assert again.toggle(key="eval_tasks_on").value is True
    assert again.text_input(key="eval_tasks").value == "gap_wiki_next,my_task"
    assert again.number_input(key="eval_task_limit").value == 7
    assert again.text_input(key="eval_task_folder").value == "/data/my-tasks"
    again.toggle(key="eval_tasks_on").set_value(False).run()
    assert again.query_params["eval_tasks"] == "off"
    assert reload(again, "explorer/evaluate.py").toggle(key="eval_tasks_on").value is False


def test_while_a_job_stops_the_sidebar_says_cancelling_with_no_time_left_and_no_live_cancel(fresh_cache):
    """Finding 9 of the demo walkthrough: for ~7 s after Cancel the sidebar still showed a time
    left and an active Cancel. A real job in the app's manager that is mid-batch when cancelled
    (it notices at the end of its batch, as a build does) shows what the sidebar draws meanwhile."""
    import threading

    from gap_engine.pipeline.jobs import manager

    batch_done = threading.Event()

    def work(ctx):
        ctx.plan(("load model", "cells"), expected={"load model": 5.0, "cells": 60.0}, basis="from 1 earlier build")
        ctx.enter("cells")
        ctx.progress(1, 10, eta=50.0, message="cell 1 of 10")
        batch_done.wait(60)  # the batch in flight when Cancel is pressed
        ctx.check_cancelled()

    job = manager().submit("table", work, label="a build in another tab")
    try:
        deadline = time.monotonic() + 30
        while job.snapshot()["message"] != "cell 1 of 10" and time.monotonic() < deadline:
            time.sleep(0.05)
        at = start()
        (before,) = [t for t in progress_texts(at) if "a build in another tab" in t]
        assert " left" in before and "cancelling" not in before, before
        at.button(key=f"app_sidebar_cancel_{job.id}").click().run()
        assert job.active and job.snapshot()["cancelling"]  # still finishing its batch
        (during,) = [t for t in progress_texts(at) if "a build in another tab" in t]
        assert "cancelling…" in during and " left" not in during, during
        button = at.button(key=f"app_sidebar_cancel_{job.id}")
        assert button.disabled and button.label == "Cancelling…"
    finally:
        batch_done.set()
    assert job.wait(30) and job.status == "cancelled"


def test_the_address_bar_is_told_the_page_on_screen(cached_table):
    """Every run tells the browser the path of the page it drew (a page switch and a query update
    can cross under load and leave the bar on the page before)."""

    def told(at) -> dict:
        (data,) = [json.loads(e.proto.json) for e in at.get("bidi_component") if e.proto.component_name == "gap_url_path"]
        return data

    at = start("explorer/planner.py")
    first = told(at)
    assert first["path"] == "/planner"
    at.switch_page("explorer/evaluate.py")
    at.run()
    assert told(at)["path"] == "/evaluate" and told(at)["run"] > first["run"]  # a new run, told again
