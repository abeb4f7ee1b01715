"""What every page of the app shares: session-state conventions, the model cache, job panels.

Session state
-------------
Each page owns the keys with its prefix (``setup_``, ``sens_``, ``planner_``, ``eval_``,
``export_``) and initialises them behind a guard with `init_page`. What pages hand to
each other lives under ``app_``:

    app_table        the current LossTable (Setup puts it there)
    app_model        the model name the table was built for
    app_budget       the budget chosen on the planner (fraction of prunable parameters)
    app_constraints  the planner's constraints as a dict (locked, max_rate, coupled)
    app_plan         the dp plan at the chosen budget (RatePlan dict)
    app_uploaded_plan a plan uploaded on the Export page and checked against the model
    app_jobs         job kind -> id of this session's latest job of that kind
    app_seen_jobs    ids of finished jobs whose outcome was already applied

Streamlit forgets the value of a widget that a run does not draw (the user is on another
page); `keep_widget_values` (called by app.py at the top of every run) re-assigns the
registered keys so they survive page switches.

Jobs
----
Jobs belong to the server, not to a tab (``gap_engine.views.jobs.manager()``). A session keeps
the ids of the jobs whose results it wants (``app_jobs``): the ones it started, and the
ones it attached to from the sidebar's list of every running job or from its URL
(``explorer/url_state.py``). `job_controls` draws a page's start button and the progress of
its job; a page that runs a new kind of job adds it to `JOB_KINDS`.
"""

from __future__ import annotations

import json
import os
import threading

import streamlit as st

from gap_engine.core.config import DEFAULT_BUDGET, DEFAULT_MAX_RATE
from gap_engine.core.errors import GapError
from gap_engine.plan.front import dp_front, front_rows
from gap_engine.plan.problem import Constraints
from gap_engine.views.jobs import CANCELLED, DONE, FAILED, manager, shared_model

# kaleido 1.x drives a headless Chromium through choreographer; point it at Debian's.
if os.path.exists("/usr/bin/chromium"):
    os.environ.setdefault("BROWSER_PATH", "/usr/bin/chromium")

SHARED_DEFAULTS = {
    "app_table": None,
    "app_model": None,
    "app_budget": DEFAULT_BUDGET,
    "app_constraints": {"locked": {}, "max_rate": DEFAULT_MAX_RATE, "coupled": False},
    "app_plan": None,
    "app_uploaded_plan": None,
    "app_jobs": {},
    "app_seen_jobs": [],
    "app_messages": {},
    "app_baselines": None,
    "app_last_run": None,
    "app_last_recovery": None,
}
_PERSIST = "_app_widget_keys"
POLL_SECONDS = 1.0  # a page's own job panel
SIDEBAR_POLL_SECONDS = 2.0  # the sidebar's list of every running job


def init_shared() -> None:
    """Create the shared ``app_`` keys once per session."""
    for key, value in SHARED_DEFAULTS.items():
        if key not in st.session_state:
            st.session_state[key] = value.copy() if isinstance(value, (dict, list)) else value


def init_page(prefix: str, defaults: dict) -> None:
    """Guarded initialisation of one page's widget values (all keys must start with ``prefix``)."""
    init_shared()
    registered = st.session_state.setdefault(_PERSIST, set())
    for key, value in defaults.items():
        assert key.startswith(prefix), f"{key} does not start with the page prefix {prefix}"
        if key not in st.session_state:
            st.session_state[key] = value
        registered.add(key)


def keep_widget_values() -> None:
    """Re-assign registered widget values so a page switch does not drop them."""
    for key in st.session_state.get(_PERSIST, ()):
        if key in st.session_state:
            st.session_state[key] = st.session_state[key]


# ---- messages that survive a rerun ---------------------------------------------------------
def set_message(slot: str, level: str, text: str) -> None:
    """Remember a message for a page area (shown by `show_message` until replaced)."""
    st.session_state["app_messages"][slot] = (level, text)


def clear_message(slot: str) -> None:
    st.session_state["app_messages"].pop(slot, None)


def show_message(slot: str) -> None:
    level, text = st.session_state["app_messages"].get(slot, (None, None))
    if text:
        {"error": st.error, "warning": st.warning, "success": st.success, "info": st.info}[level](text)


# ---- PNG export ----------------------------------------------------------------------------
_png_lock = threading.Lock()


def render_png(figures: dict, width: int = 1400) -> dict:
    """Name -> PNG bytes of each figure, through kaleido and one headless Chromium for the batch.

    Raises:
        whatever kaleido raises when no browser can start (the caller shows it).
    """
    import warnings

    import kaleido

    out = {}
    with _png_lock, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # kaleido warns that per-call options are ignored with a server
        kaleido.start_sync_server(silence_warnings=True)
        try:
            for name, fig in figures.items():
                out[name] = fig.to_image(format="png", width=width, height=int(fig.layout.height or 500), scale=1)
        finally:
            kaleido.stop_sync_server(silence_warnings=True)
    return out


# ---- models ------------------------------------------------------------------------------
def reference_model(name: str):
    """The dense model, loaded once per process and shared read-only with the jobs.

    Raises:
        GapError: from load_model (bad name or path, unreadable weights).
    """
    with st.spinner(f"Loading {name} ..."):
        return shared_model(name)


def current_table():
    return st.session_state.get("app_table")


def set_table(table) -> None:
    """Make ``table`` the current one; plans and constraints made for another table are dropped."""
    previous = st.session_state.get("app_table")
    st.session_state["app_table"] = table
    st.session_state["app_model"] = table.model
    if previous is None or previous.key != table.key:
        st.session_state["app_plan"] = None
        st.session_state["app_baselines"] = None
        if previous is None or previous.num_layers != table.num_layers:
            st.session_state["app_constraints"] = dict(SHARED_DEFAULTS["app_constraints"], locked={})


def autoload_latest() -> None:
    """Once per session: make the newest cached table current, so a later visit starts at once."""
    if st.session_state.get("app_autoloaded"):
        return
    st.session_state["app_autoloaded"] = True
    if current_table() is not None or session_job("table") is not None:
        return
    from gap_engine.tables import cache

    try:
        rows = cache.list_tables()
        newest = max(rows, key=lambda r: r.get("created") or "") if rows else None
        table = cache.get_table(newest["key"]) if newest else None
    except GapError:
        return
    if table is not None:
        set_table(table)
        set_message("setup", "info", f"Loaded the most recent cached table ({table.key}); build or pick another below.")


def table_page(prefix: str, defaults: dict, title: str):
    """Start a page that needs a loss table: its widget state, its title, and the current table
    (or a pointer to Setup, and the page stops)."""
    init_page(prefix, defaults)
    st.title(title)
    return require_table()


def require_table():
    """The current table, or stop the page with a pointer to Setup."""
    init_shared()
    table = current_table()
    if table is None:
        st.info("No loss table yet: build one or load a cached one on the **Setup** page.")
        st.page_link(SETUP_PAGE, label="Go to Setup", icon=":material/settings:")
        st.stop()
    return table


def constraints_from_state() -> Constraints:
    """The planner's constraints of this session."""
    return Constraints.from_dict(st.session_state.get("app_constraints"))


def constraints_json(raw: dict) -> str:
    """A canonical text of a constraints dict (a cache key)."""
    return json.dumps(raw, sort_keys=True)


@st.cache_data(max_entries=32, show_spinner=False)
def pareto_rows(table_key: str, constraints_text: str, _table) -> list[dict]:
    """allocate.front_rows of the DP front for one table and constraints (cached per process)."""
    return front_rows(_table, dp_front(_table, Constraints.from_dict(json.loads(constraints_text))))


# ---- jobs ----------------------------------------------------------------------------------
def session_job(kind: str):
    """This session's latest job of ``kind`` (or None)."""
    return manager().get(st.session_state.get("app_jobs", {}).get(kind))


def remember_job(kind: str, job) -> None:
    """Make ``job`` this session's job of ``kind``: its progress shows here and its result
    is applied here when it ends (a job started in another tab can be attached this way)."""
    st.session_state["app_jobs"][kind] = job.id


def sidebar_jobs() -> None:
    """Every running job of this server, whichever tab started it: progress, Watch, Cancel.

    Polls every SIDEBAR_POLL_SECONDS (a fragment), so a job started in another tab shows up
    by itself; when a job of this session ends, the whole app reruns to apply its result.
    """

    @st.fragment(run_every=SIDEBAR_POLL_SECONDS)
    def panel():
        if st.session_state.pop("app_watch_started", False):
            st.rerun()  # the whole app: the watched job's page draws its progress
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
            if job.id in mine_ids:
                c1.caption("this tab's")  # its page shows it (a page link cannot be drawn before navigation)
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


def unseen_finished(kind: str):
    """This session's latest job of ``kind`` once it has ended and was not yet handled; marks it handled."""
    job = session_job(kind)
    if job is None or job.active or job.id in st.session_state["app_seen_jobs"]:
        return None
    st.session_state["app_seen_jobs"].append(job.id)
    return job


def duration_text(seconds: float) -> str:
    """'42 s', '2 min 05 s' or '1 h 02 min'."""
    seconds = int(round(max(0.0, seconds)))
    if seconds >= 3600:
        return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"
    return f"{seconds // 60} min {seconds % 60:02d} s" if seconds >= 60 else f"{seconds} s"


def progress_text(snap: dict, title: str) -> str:
    """One line for a running job: its stage, the stage's steps, the time left and the time so far."""
    if snap["status"] == "queued":
        return f"{title}: waiting for another job to finish"
    where = snap["message"] or "starting"
    if snap["stages"] and snap["stage_index"] >= 0:
        stage = snap["stage"]
        detail = f": {snap['message']}" if snap["message"] and snap["message"] != stage else ""
        where = f"stage {snap['stage_index'] + 1} of {len(snap['stages'])}, {stage}{detail}"
    parts = [f"{title}: {where}"]
    if snap["cancelling"]:
        parts.append("cancelling…")
    elif snap["seconds_left"] is not None:
        parts.append(f"about {duration_text(snap['seconds_left'])} left")
    elif snap["eta"] is not None:
        parts.append(f"this stage about {duration_text(snap['eta'])} left")
    parts.append(f"{duration_text(snap['elapsed'])} elapsed")
    return " · ".join(parts)


def expected_text(snap: dict) -> str | None:
    """What earlier jobs of this kind say the whole job takes, when they say it."""
    total = snap.get("expected_total")
    if total is None:
        return None
    return f"Expected about {duration_text(total)} in all ({snap['expected_basis']})."


def expected_caption(expected, what: str) -> None:
    """What a job the form describes is expected to take, before it is started.

    Args:
        expected: a ``buildtime.Expectation``.
        what: the job in one word ("build", "run").
    """
    total, known = expected.total, expected.known
    if total is not None:
        st.caption(f"Expected time: about {duration_text(total)} ({expected.basis}).")
    elif known:
        missing = ", ".join(expected.unknown())
        st.caption(f"Expected time: about {duration_text(sum(known.values()))} for the stages measured before ({expected.basis}), plus {missing}.")
    else:
        st.caption(f"Expected time: {expected.basis}; the time left shows as the {what} runs.")


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
    """Cancel, or a disabled "Cancelling…" once the job was asked to stop."""
    where.button(
        "Cancelling…" if snap["cancelling"] else "Cancel", key=key, on_click=job.cancel, disabled=snap["cancelling"], icon=":material/cancel:"
    )


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
        if not job.active:
            st.rerun()
        job_panel(job, title, kind)

    panel()


def job_controls(kind: str, label: str, key: str, on_click, icon: str, title: str, slot: str, where=None, **button) -> None:
    """A button that starts a background job (disabled while one of ``kind`` runs), its
    progress panel, and the message area ``slot``."""
    running = session_job(kind)
    (where or st).button(
        label, key=key, on_click=on_click, disabled=running is not None and running.active, icon=icon, **button
    )
    job_progress(kind, title)
    show_message(slot)


def stage_times_text(snap: dict) -> str:
    """'load model 3 s, read text 1 s, ...' of a job's finished stages."""
    return ", ".join(f"{name} {duration_text(seconds)}" for name, seconds in snap["stage_seconds"].items())


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


SETUP_PAGE = "explorer/setup.py"
SENSITIVITY_PAGE = "explorer/sensitivity.py"
PLANNER_PAGE = "explorer/planner.py"
EVALUATE_PAGE = "explorer/evaluate.py"
EXPORT_PAGE = "explorer/export.py"
RECOVER_PAGE = "explorer/recover.py"

# Job kind -> (what a reader calls it, the page that shows its result). A page that runs a
# new kind of job (a recovery stage, say) adds its entry, and the sidebar lists its jobs.
JOB_KINDS = {
    "table": ("Loss table build", SETUP_PAGE),
    "baselines": ("Baseline plans", PLANNER_PAGE),
    "prune_eval": ("Prune & evaluate", EVALUATE_PAGE),
    "recover": ("Recovery", RECOVER_PAGE),
}
