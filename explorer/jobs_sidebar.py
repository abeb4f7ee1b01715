"""The sidebar's list of every running job of this server, whichever tab started it."""

from __future__ import annotations

import streamlit as st

from explorer import ownership
from explorer.job_panel import CANCEL_REQUESTED, cancel_button
from explorer.job_text import progress_text
from explorer.session_jobs import JOB_KINDS, remember_job
from gap_engine.pipeline.jobs import manager

SIDEBAR_POLL_SECONDS = 2.0  # the sidebar's list of every running job


def sidebar_jobs() -> None:
    """Every running job of this server, whichever tab started it: progress, Watch, and Cancel for
    the jobs this browser started.

    Polls every SIDEBAR_POLL_SECONDS (a fragment), so a job started in another tab shows up
    by itself; when a job of this session ends, the whole app reruns to apply its result.
    """

    @st.fragment(run_every=SIDEBAR_POLL_SECONDS)
    def panel():
        if st.session_state.pop("app_watch_started", False) or st.session_state.pop(CANCEL_REQUESTED, False):
            st.rerun()  # the whole app: the watched job's page draws its progress, a cancelled one says so everywhere
        seen = st.session_state["app_seen_jobs"]
        mine = [manager().get(job_id) for job_id in st.session_state["app_jobs"].values()]
        if any(job is not None and not job.active and job.id not in seen for job in mine):
            st.rerun()
        running = manager().jobs(active_only=True)
        if not running:
            return
        st.caption("Running jobs (all tabs)")
        mine_ids = {job.id for job in mine if job is not None}
        for job in running:
            title, _page = JOB_KINDS.get(job.kind, (job.kind, None))
            snap = job.snapshot()
            st.progress(snap["overall"], text=progress_text(snap, f"{title}, {job.label}"))
            c1, c2 = st.columns(2)
            if job.id in mine_ids and ownership.may_control(job.owner):
                c1.caption("Started in this tab")  # its page shows it (a page link cannot be drawn before navigation)
            elif job.id in mine_ids:
                c1.caption("watched here")
            else:
                c1.button(
                    "Watch", key=f"app_watch_{job.id}", on_click=_watch, args=(job,), icon=":material/visibility:",
                    help="Show its progress here and get its result",
                )  # fmt: skip
            cancel_button(c2, job, snap, f"app_sidebar_cancel_{job.id}")

    with st.sidebar:
        panel()


def _watch(job) -> None:
    """Callback of a sidebar Watch button: the job becomes this tab's (see `remember_job`)."""
    remember_job(job.kind, job)
    st.session_state["app_watch_started"] = True
