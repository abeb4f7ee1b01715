"""GAP explorer: `streamlit run serve.py` (or `streamlit run app.py`; serve.py adds routes for the pages' own addresses).

Six pages in the order of the method: Setup (model, calibration, loss table) ->
Sensitivity -> Budget planner -> Prune & evaluate -> Recover -> Export. Long work (table builds,
baseline plans, prune-and-evaluate, recovery) runs as background jobs (gap_engine.pipeline.jobs), so it
survives reruns, page switches and reloads; this file applies finished jobs' results to the
session whatever page is open, lists every running job in the sidebar, and keeps the view
in the URL (explorer/url_state.py) so a reload or a shared link opens it again.
"""

from __future__ import annotations

import streamlit as st

from explorer import budget_chart, ownership, url_state
from explorer.autoload import autoload_latest
from explorer.job_text import duration_text, stage_times_text
from explorer.jobs_sidebar import sidebar_jobs
from explorer.messages import clear_message, set_message, show_message
from explorer.page_paths import EVALUATE_PAGE, EXPORT_PAGE, PLANNER_PAGE, RECOVER_PAGE, SENSITIVITY_PAGE, SETUP_PAGE
from explorer.session_jobs import report_finished, unseen_finished
from explorer.session_keys import init_shared, keep_widget_values
from explorer.table_state import current_table, set_table
from gap_engine.core.progress import SCORE_UNITS

st.set_page_config(page_title="GAP explorer", page_icon="✂️", layout="wide")

init_shared()
keep_widget_values()
ownership.keep_cookie()  # this browser's token: its jobs and runs are controlled from it alone


def apply_finished_jobs() -> None:
    """Hand the results of this session's ended jobs to the pages that use them (once each)."""
    job = unseen_finished("table")
    if job is not None and report_finished(job, "The loss table build", "setup"):
        table = job.result
        set_table(table)
        snap = job.snapshot()
        shape = f"{table.delta.shape[0]} components x {len(table.rate_grid)} rates"
        if SCORE_UNITS not in snap["stage_seconds"]:  # nothing was measured: the cache had it
            text = f"Loss table loaded from the cache in {duration_text(snap['elapsed'])}: {shape} ({table.key})."
        else:
            text = f"Loss table ready in {duration_text(snap['elapsed'])} ({stage_times_text(snap)}): {shape} ({table.key})."
        set_message("setup", "success", text)
        # The Current table's Build time shows this same number, not the measurement alone.
        st.session_state.setdefault("app_table_job_seconds", {})[table.key] = snap["elapsed"]
    job = unseen_finished("baselines")
    if job is not None and report_finished(job, "Computing the baseline plans", "planner"):
        st.session_state["app_baselines"] = {"key": job.key, "rows": job.result}
        clear_message("planner")
    job = unseen_finished("prune_eval")
    if job is not None and report_finished(job, "Prune and evaluate", "eval"):
        st.session_state["app_last_run"] = job.result
        set_message(
            "eval",
            "success",
            f"Run {job.result.run_id} finished in {duration_text(job.elapsed)} and was added to the history (plan {job.result.plan_hash}).",
        )
    job = unseen_finished("recover")
    if job is not None and report_finished(job, "Recovery", "recover"):
        st.session_state["app_last_recovery"] = job.result
        set_message("recover", "success", f"Recovery finished in {job.result.total_seconds:.0f} s and was added to the history.")


apply_finished_jobs()
if not url_state.restore():
    opened = autoload_latest()
    if opened is not None:  # the Setup form shows the settings of the table that is open
        url_state.setup_form(opened.model, opened.spec.to_dict())
apply_finished_jobs()  # a job the URL attached to may have ended already
budget_chart.apply_pending_release()  # before any page draws: every page shows the plan the slider released

table = current_table()
with st.sidebar:
    if table is not None:
        st.caption(f"Model **{table.model}** · table `{table.key}`")
    else:
        st.caption("No loss table loaded yet.")
    show_message(url_state.LINK_MESSAGE)  # what of the link was ignored, in one line
sidebar_jobs()

pages = [
    st.Page(SETUP_PAGE, title="Setup", icon=":material/settings:", url_path="setup", default=True),
    st.Page(SENSITIVITY_PAGE, title="Sensitivity", icon=":material/show_chart:", url_path="sensitivity"),
    st.Page(PLANNER_PAGE, title="Budget planner", icon=":material/tune:", url_path="planner"),
    st.Page(EVALUATE_PAGE, title="Prune & evaluate", icon=":material/science:", url_path="evaluate"),
    st.Page(RECOVER_PAGE, title="Recover", icon=":material/healing:", url_path="recover"),
    st.Page(EXPORT_PAGE, title="Export", icon=":material/download:", url_path="export"),
]
try:
    page = st.navigation(pages)
    url_state.keep_path(page.url_path)  # the address bar names the page on screen
    if page.url_path != "planner":  # there the chart sends what it shows itself
        budget_chart.keep_unsaved_release()
    page.run()
finally:
    url_state.sync()  # also after a page stops early (st.stop): the URL shows what the page showed
