"""The jobs a session wants the results of.

Jobs run in the server, not in a tab (``gap_engine.pipeline.jobs.manager()``). A session keeps
the ids of the jobs whose results it wants (``app_jobs``): the ones it started, and the
ones it attached to from the sidebar's list of every running job (`explorer.jobs_sidebar`)
or from its URL (``explorer/url_state.py``). Every session sees every job's progress, but only
the browser that started a job gets its Cancel (``explorer/ownership.py``): a shared link is
read-only. `explorer.job_panel.job_controls` draws a page's start button and the progress of
its job; a page that runs a new kind of job adds it to `JOB_KINDS`.
"""

from __future__ import annotations

import streamlit as st

from explorer.job_text import duration_text
from explorer.messages import set_message
from explorer.page_paths import EVALUATE_PAGE, PLANNER_PAGE, RECOVER_PAGE, SETUP_PAGE
from gap_engine.pipeline.jobs import CANCELLED, DONE, FAILED, manager

# Job kind -> (what a reader calls it, the page that shows its result). A page that runs a
# new kind of job (a recovery stage, say) adds its entry, and the sidebar lists its jobs.
JOB_KINDS = {
    "table": ("Loss table build", SETUP_PAGE),
    "baselines": ("Baseline plans", PLANNER_PAGE),
    "prune_eval": ("Prune & evaluate", EVALUATE_PAGE),
    "recover": ("Recovery", RECOVER_PAGE),
}


def session_job(kind: str):
    """This session's latest job of ``kind`` (or None)."""
    return manager().get(st.session_state.get("app_jobs", {}).get(kind))


def remember_job(kind: str, job) -> None:
    """Make ``job`` this session's job of ``kind``: its progress shows here and its result
    is applied here when it ends (a job started in another tab can be attached this way)."""
    st.session_state["app_jobs"][kind] = job.id


def unseen_finished(kind: str):
    """This session's latest job of ``kind`` once it has ended and was not yet handled; marks it handled."""
    job = session_job(kind)
    if job is None or job.active or job.id in st.session_state["app_seen_jobs"]:
        return None
    st.session_state["app_seen_jobs"].append(job.id)
    return job


def report_finished(job, what: str, slot: str) -> bool:
    """Turn an ended job into a page message in the page's words; True when it succeeded."""
    if job.status == DONE:
        return True
    snap = job.snapshot()
    if job.status == CANCELLED:
        during = f" during {snap['stage']}" if snap["stage"] else ""
        latency = snap["cancel_latency"]
        stopped = f"; it stopped {latency:.1f} s after the request" if latency is not None else ""
        set_message(slot, "warning", f"{what} was cancelled{during}, after {duration_text(snap['elapsed'])}{stopped}.")
    elif job.status == FAILED:
        set_message(slot, "error", f"{what} failed: {job.error}")
    return False
