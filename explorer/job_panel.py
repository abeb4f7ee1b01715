"""A page's job: the button that starts it, its progress panel and its Cancel."""

from __future__ import annotations

import streamlit as st

from explorer import ownership
from explorer.job_text import expected_text, progress_text
from explorer.messages import show_message
from explorer.session_jobs import session_job

POLL_SECONDS = 1.0  # a page's own job panel
READ_ONLY_JOB = "Started in another browser: read-only here."
CANCEL_REQUESTED = "app_cancel_requested"  # a Cancel was pressed: the fragment that drew it reruns the whole app


def job_panel(job, title: str, key: str) -> None:
    """A job's progress bar, its expected time and its Cancel button ("Cancelling…" once pressed)."""
    snap = job.snapshot()
    with st.container(border=True, key=f"app_job_{key}"):
        st.progress(snap["overall"], text=progress_text(snap, title))
        note = expected_text(snap)
        if snap["cancelling"]:
            st.caption("Stopping at the next model block; a model load in progress finishes in the background.")
        elif note:
            st.caption(note)
        cancel_button(st, job, snap, f"app_cancel_{key}")


def cancel_button(where, job, snap: dict, key: str) -> None:
    """Cancel, or a disabled "Cancelling…" once the job was asked to stop; for a job another
    browser started (a shared link), a line saying so instead."""
    if not ownership.may_control(job.owner):
        where.caption(READ_ONLY_JOB)
        return
    where.button(
        "Cancelling…" if snap["cancelling"] else "Cancel",
        key=key,
        on_click=_cancel,
        args=(job,),
        disabled=snap["cancelling"],
        icon=":material/cancel:",
    )


def _cancel(job) -> None:
    """Callback of a Cancel button: ask the job to stop, and have the fragment that drew the
    button rerun the whole app, so the page and the sidebar both say "Cancelling…" at once."""
    if not ownership.may_control(job.owner):  # never drawn for such a job; checked again all the same
        return
    job.cancel()
    st.session_state[CANCEL_REQUESTED] = True


def job_progress(kind: str, title: str) -> None:
    """Progress of this session's running job of ``kind`` (see `job_panel`).

    Redraws itself every second while the job runs (a fragment, so the rest of the page
    stays usable) and reruns the whole app once the job has ended.
    """
    job = session_job(kind)
    if job is None or not job.active:
        return

    @st.fragment(run_every=POLL_SECONDS)
    def panel():
        if not job.active or st.session_state.pop(CANCEL_REQUESTED, False):
            st.rerun()
        job_panel(job, title, kind)

    panel()


def job_controls(kind: str, label: str, key: str, on_click, icon: str, title: str, slot: str, where=None, **button) -> None:
    """A button that starts a background job (disabled while one of ``kind`` runs), its
    progress panel, and the message area ``slot``."""
    running = session_job(kind)
    (where or st).button(label, key=key, on_click=on_click, disabled=running is not None and running.active, icon=icon, **button)
    job_progress(kind, title)
    show_message(slot)
