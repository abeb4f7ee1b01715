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
"""

from __future__ import annotations

import json
import os
import threading
import time

import streamlit as st

from gap_engine.allocate import Constraints, dp_front, front_rows
from gap_engine.config import DEFAULT_BUDGET, DEFAULT_MAX_RATE
from gap_engine.errors import GapError
from gap_engine.jobs import CANCELLED, DONE, FAILED, manager, shared_model

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
POLL_SECONDS = 1.0


def init_shared() -> None:
    """Create the shared ``app_`` keys once per session."""
    for key, value in SHARED_DEFAULTS.items():
        if key not in st.session_state:
            st.session_state[key] = value.copy() if isinstance(value, (dict, list)) else value


def ensure_entry_point() -> None:
    """Make sure a page runs inside app.py's navigation.

    When the very first request to a fresh server is a deep link (``/planner``),
    Streamlit's legacy multipage mode (chosen because a ``pages/`` folder sits beside
    app.py) runs ``pages/planner.py`` on its own, without app.py. Leave that mode and
    rerun: app.py then runs and opens the same page (page identity is the url path, the
    same in both modes). AppTest resets the mode before every run, so there each run of a
    page goes through this rerun; pages therefore act on buttons in ``on_click``
    callbacks, which run before it.
    """
    from streamlit.runtime.pages_manager import PagesManager

    if PagesManager.uses_pages_directory:
        PagesManager.uses_pages_directory = False
        st.rerun()


def init_page(prefix: str, defaults: dict) -> None:
    """Guarded initialisation of one page's widget values (all keys must start with ``prefix``)."""
    ensure_entry_point()
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
    from gap_engine import cache

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
    st.session_state["app_jobs"][kind] = job.id


def unseen_finished(kind: str):
    """This session's latest job of ``kind`` once it has ended and was not yet handled; marks it handled."""
    job = session_job(kind)
    if job is None or job.active or job.id in st.session_state["app_seen_jobs"]:
        return None
    st.session_state["app_seen_jobs"].append(job.id)
    return job


def _eta_text(seconds) -> str:
    if seconds is None:
        return "estimating time left"
    seconds = int(round(seconds))
    return f"about {seconds // 60} min {seconds % 60:02d} s left" if seconds >= 60 else f"about {seconds} s left"


def job_progress(kind: str, title: str) -> None:
    """Progress bar, ETA and Cancel button of this session's running job of ``kind``.

    Redraws itself every second while the job runs (a fragment, so the rest of the page
    stays usable) and reruns the whole app once the job has ended.
    """
    job = session_job(kind)
    if job is None or not job.active:
        return

    @st.fragment(run_every=POLL_SECONDS)
    def panel():
        snap = job.snapshot()
        if not job.active:
            st.rerun()
        with st.container(border=True, key=f"app_job_{kind}"):
            if snap["status"] == "queued":
                st.progress(0.0, text=f"{title}: waiting for another job to finish")
            else:
                left = f" · {_eta_text(snap['eta'])}" if snap["total"] else ""  # no ETA before the steps are known
                st.progress(
                    snap["fraction"],
                    text=f"{title}: {snap['message'] or 'starting'}{left} · {snap['elapsed']:.0f} s elapsed",
                )
            st.button("Cancel", key=f"app_cancel_{kind}", on_click=job.cancel, icon=":material/cancel:")

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


def report_finished(job, what: str, slot: str) -> bool:
    """Turn an ended job into a page message; True when it succeeded."""
    if job.status == DONE:
        return True
    if job.status == CANCELLED:
        set_message(slot, "warning", f"{what} was cancelled: {job.error}")
    elif job.status == FAILED:
        set_message(slot, "error", f"{what} failed: {job.error}")
    return False


def wait_briefly(job, seconds: float = 0.3) -> None:
    """Let a job that finishes at once (a cache hit) end before the page draws."""
    deadline = time.monotonic() + seconds
    while job.active and time.monotonic() < deadline:
        time.sleep(0.02)


SETUP_PAGE = "pages/setup.py"
SENSITIVITY_PAGE = "pages/sensitivity.py"
PLANNER_PAGE = "pages/planner.py"
EVALUATE_PAGE = "pages/evaluate.py"
EXPORT_PAGE = "pages/export.py"
RECOVER_PAGE = "pages/recover.py"
