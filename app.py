"""GAP explorer: `streamlit run app.py`.

Six pages in the order of the method: Setup (model, calibration, loss table) ->
Sensitivity -> Budget planner -> Prune & evaluate -> Recover -> Export. Long work (table builds,
baseline plans, prune-and-evaluate, recovery) runs as background jobs (gap_engine.jobs), so it
survives reruns and page switches; this file applies finished jobs' results to the
session whatever page is open, and shows running jobs in the sidebar.
"""

from __future__ import annotations

import streamlit as st

from pages import common

st.set_page_config(page_title="GAP explorer", page_icon="✂️", layout="wide")

common.init_shared()
common.keep_widget_values()


def apply_finished_jobs() -> None:
    """Hand the results of this session's ended jobs to the pages that use them (once each)."""
    job = common.unseen_finished("table")
    if job is not None and common.report_finished(job, "The loss table build", "setup"):
        table = job.result
        common.set_table(table)
        common.set_message(
            "setup",
            "success",
            f"Loss table ready: {table.delta.shape[0]} components x {len(table.rate_grid)} rates "
            f"in {table.build_seconds:.0f} s ({table.key}).",
        )
    job = common.unseen_finished("baselines")
    if job is not None and common.report_finished(job, "Computing the baseline plans", "planner"):
        st.session_state["app_baselines"] = {"key": job.key, "rows": job.result}
        common.clear_message("planner")
    job = common.unseen_finished("prune_eval")
    if job is not None and common.report_finished(job, "Prune and evaluate", "eval"):
        st.session_state["app_last_run"] = job.result
        common.set_message("eval", "success", f"Run {job.result['run_id']} finished in {job.result['seconds']:.0f} s and was added to the history.")
    job = common.unseen_finished("recover")
    if job is not None and common.report_finished(job, "Recovery", "recover"):
        st.session_state["app_last_recovery"] = job.result
        common.set_message("recover", "success", f"Recovery finished in {job.result['total_seconds']:.0f} s and was added to the history.")


def sidebar_jobs() -> None:
    """Running jobs of this session, whatever the page (polls while any runs)."""
    kinds = {"table": "Loss table", "baselines": "Baseline plans", "prune_eval": "Prune & evaluate", "recover": "Recovery"}
    running = [(kind, common.session_job(kind)) for kind in kinds]
    running = [(kind, job) for kind, job in running if job is not None and job.active]
    if not running:
        return

    @st.fragment(run_every=common.POLL_SECONDS)
    def panel():
        st.caption("Background jobs")
        for kind, job in running:
            snap = job.snapshot()
            if not job.active:
                st.rerun()
            st.progress(snap["fraction"], text=f"{kinds[kind]}: {snap['status']} {snap['done']}/{snap['total'] or '?'}")

    with st.sidebar:
        panel()


apply_finished_jobs()
common.autoload_latest()

table = common.current_table()
with st.sidebar:
    if table is not None:
        st.caption(f"Model **{table.model}** · table `{table.key}`")
    else:
        st.caption("No loss table loaded yet.")
sidebar_jobs()

pages = [
    st.Page(common.SETUP_PAGE, title="Setup", icon=":material/settings:", url_path="setup", default=True),
    st.Page(common.SENSITIVITY_PAGE, title="Sensitivity", icon=":material/show_chart:", url_path="sensitivity"),
    st.Page(common.PLANNER_PAGE, title="Budget planner", icon=":material/tune:", url_path="planner"),
    st.Page(common.EVALUATE_PAGE, title="Prune & evaluate", icon=":material/science:", url_path="evaluate"),
    st.Page(common.RECOVER_PAGE, title="Recover", icon=":material/healing:", url_path="recover"),
    st.Page(common.EXPORT_PAGE, title="Export", icon=":material/download:", url_path="export"),
]
st.navigation(pages).run()
