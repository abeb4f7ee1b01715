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
    app_compensation the compensation after the cut the runs apply (a COMPENSATIONS name), one
                     selector drawn on the planner and on Prune & evaluate: the planner's front
                     pays for the biases it adds, so its parameter counts are the run's
    app_plan         the dp plan at the chosen budget (RatePlan dict): the plan the planner released
    app_plan_hash    its content hash (`RatePlan.content_hash`); the URL carries it, and the
                     plan is stored under it (`gap_engine.plan.store`) so a reload gets it back
    app_plan_missing why the plan the URL named could not be restored (None: nothing missing)
    app_uploaded_plan a plan uploaded on the Export page and checked against the model
    app_jobs         job kind -> id of this session's latest job of that kind
    app_seen_jobs    ids of finished jobs whose outcome was already applied

Streamlit forgets the value of a widget that a run does not draw (the user is on another
page); `keep_widget_values` (called by app.py at the top of every run) re-assigns the
registered keys so they survive page switches.

Jobs
----
Jobs run in the server, not in a tab (``gap_engine.pipeline.jobs.manager()``). A session keeps
the ids of the jobs whose results it wants (``app_jobs``): the ones it started, and the
ones it attached to from the sidebar's list of every running job or from its URL
(``explorer/url_state.py``). Every session sees every job's progress, but only the browser
that started a job gets its Cancel (``explorer/ownership.py``): a shared link is read-only.
`job_controls` draws a page's start button and the progress of its job; a page that runs a
new kind of job adds it to `JOB_KINDS`.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading

import streamlit as st

from explorer import ownership
from gap_engine.core.config import DEFAULT_BUDGET, DEFAULT_COMPENSATION, DEFAULT_MAX_RATE
from gap_engine.core.errors import GapError, one_line
from gap_engine.data.next_sentence import OFFLINE_TASK
from gap_engine.evaluate.lm_eval_import import import_in_background, lm_eval_imported
from gap_engine.evaluate.tasks import DEMO_LIMIT, TaskSettings, check_tasks, task_settings
from gap_engine.pipeline.jobs import CANCELLED, DONE, FAILED, manager, shared_model
from gap_engine.plan.allocators import counted_compensation
from gap_engine.plan.front import dp_front, front_rows
from gap_engine.plan.problem import Constraints, charged_counts

# kaleido 1.x drives a headless Chromium through choreographer; point it at Debian's.
if os.path.exists("/usr/bin/chromium"):
    os.environ.setdefault("BROWSER_PATH", "/usr/bin/chromium")

SHARED_DEFAULTS = {
    "app_table": None,
    "app_model": None,
    "app_budget": DEFAULT_BUDGET,
    "app_constraints": {"locked": {}, "max_rate": DEFAULT_MAX_RATE, "coupled": False},
    "app_compensation": DEFAULT_COMPENSATION,
    "app_plan": None,
    "app_plan_hash": None,
    "app_plan_missing": None,
    "app_uploaded_plan": None,
    "app_jobs": {},
    "app_seen_jobs": [],
    "app_messages": {},
    "app_confirm": {},
    "app_baselines": None,
    "app_last_run": None,
    "app_last_recovery": None,
}
_PERSIST = "_app_widget_keys"
TABLE_LINK_SLOT = "table_link"  # message slot: the table a link named could not be opened
SHARED_WIDGETS = ("app_compensation",)  # widgets drawn on more than one page: kept across page switches
POLL_SECONDS = 1.0  # a page's own job panel
SIDEBAR_POLL_SECONDS = 2.0  # the sidebar's list of every running job


# One sentence per technical term the pages show, as a help popover (the ? beside a label).
GLOSSARY = {
    "fisher": "fisher: estimates each cell's loss increase from squared gradients (a second-order Taylor term), "
    "from one forward and backward pass; fast, and an estimate.",
    "taylor": "taylor: estimates each cell from gradient times weight (a first-order Taylor term); fast, NLL only.",
    "wanda": "wanda: ranks a unit by its weights' magnitudes times the size of the activations that flow into them.",
    "criterion": "The criterion ranks the heads or channels inside one layer and the lowest-ranked go first: magnitude "
    "(weight sizes), wanda (weights times activations), flap (how much a unit's output varies), taylor (gradient times weight).",
    "split": "split: attention and MLP of a layer get their own rates; block: one rate for the whole layer.",
    "nats/token": "nats/token: the loss per predicted token in natural-log units; +0.1 nats/token multiplies perplexity by about 1.105.",
    "prunable": "Prunable parameters are those in attention heads and MLP channels; embeddings and norms are never pruned, "
    "so budgets are percentages of the prunable parameters.",
    "DP front": "The DP front: for every budget, the least predicted loss increase any per-layer plan can reach, "
    "solved exactly by dynamic programming (GAP).",
    "dense objective": "The objective (NLL or KL) of the unpruned model on the calibration windows; the table's cells "
    "are increases over it (KL to itself is 0, so a KL table shows 0.0000 here).",
    "plan hash": "A plan's content hash: 12 hex digits of SHA-256 over its rates, model, budget and predicted loss. "
    "The same plan has the same hash on every page, in the run history, the checkpoint and every export.",
    "compensation": "Compensation after the cut: what the kept heads and channels get once the cut is made, fitted block by "
    "block on the table's calibration text: FLAP's bias (a bias on each o_proj and down_proj that lost inputs), a "
    "least-squares refit of those projections, or both. The biases are parameters too: the planner's budget pays for "
    "them, so its parameters left are the pruned model's. One choice for the planner and Prune & evaluate.",
    "held-out KL": "Held-out KL: the KL divergence from the dense to the pruned model's next-token distribution on the held-out "
    "text (never used to plan), in nats/token.",
    "calibration KL": "Calibration KL: the same divergence measured on the calibration windows the table was built from; "
    "it is what the table predicts, so it is the measured counterpart of the predicted increase.",
    "speed-up spread": "Speed is timed in interleaved repeats of dense and pruned; the range is the lowest to highest "
    "repeat. Two speed-ups whose ranges overlap are within noise: neither is shown to be faster.",
    "task accuracy": "Task accuracy: the share of multiple-choice questions answered right (the choice with the highest "
    "log-likelihood), computed by EleutherAI's lm-evaluation-harness as papers report it; ± is its standard error, "
    "and two models differ beyond noise only when their accuracies are more than about two standard errors apart.",
}


def init_shared() -> None:
    """Create the shared ``app_`` keys once per session."""
    for key, value in SHARED_DEFAULTS.items():
        if key not in st.session_state:
            st.session_state[key] = value.copy() if isinstance(value, (dict, list)) else value
    st.session_state.setdefault(_PERSIST, set()).update(SHARED_WIDGETS)


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


# ---- destructive actions: asked first, then done ---------------------------------------------
# app_confirm maps a destructive button's key to the thing it was pressed for (a run id, a table
# key, a folder): the question shows under the button while that thing is still the one picked.
def ask_first(where, label: str, key: str, target, **button) -> None:
    """A destructive action's button: pressing it asks (see `confirmation`), never acts."""
    where.button(label, key=key, on_click=_ask, args=(key, target), **button)


def _ask(key: str, target) -> None:
    st.session_state["app_confirm"][key] = target


def _dismiss(key: str) -> None:
    st.session_state["app_confirm"].pop(key, None)


def _confirmed(key: str, action, args: tuple) -> None:
    st.session_state["app_confirm"].pop(key, None)
    action(*args)


def confirmation(key: str, target, question: str, confirm_label: str, action, args: tuple = ()) -> None:
    """The question under `ask_first`'s button ``key`` while it was pressed for ``target``: what
    will be deleted, a button that does it (``action(*args)``, a callback, so the page that
    follows no longer shows what was deleted) and one that keeps it."""
    if st.session_state["app_confirm"].get(key) != target:
        return
    with st.container(border=True, key=f"{key}_question"):
        st.warning(question, icon=":material/warning:")
        c1, c2 = st.columns(2)
        c1.button(
            confirm_label, key=f"{key}_confirm", type="primary", on_click=_confirmed, args=(key, action, args), icon=":material/delete:"
        )
        c2.button("Keep it", key=f"{key}_keep", on_click=_dismiss, args=(key,))


# ---- the task picker (Prune & evaluate, Recover) -------------------------------------------
def task_defaults(prefix: str) -> dict:
    """The picker's starting values: the offline task, a few examples so a demo stays quick."""
    return {f"{prefix}tasks_on": True, f"{prefix}tasks": OFFLINE_TASK, f"{prefix}task_limit": DEMO_LIMIT, f"{prefix}task_folder": ""}


def task_examples(prefix: str) -> int:
    """Examples the picker asks lm-eval to score per model, every task's together (0: switched off);
    what the pages' time estimates price."""
    ss = st.session_state
    if not ss[f"{prefix}tasks_on"]:
        return 0
    names = [name for name in str(ss[f"{prefix}tasks"]).split(",") if name.strip()]
    return len(names) * int(ss[f"{prefix}task_limit"] or 0)


def task_picker(prefix: str) -> None:
    """Task accuracy through lm-eval: on or off, which tasks, how many examples, a local task folder."""
    st.toggle("Task accuracy (lm-eval)", key=f"{prefix}tasks_on", help=GLOSSARY["task accuracy"])
    if not st.session_state[f"{prefix}tasks_on"]:
        return
    import_in_background()  # lm-eval's first import takes seconds: done while the user reads the form
    st.text_input(
        "Tasks (comma-separated)",
        key=f"{prefix}tasks",
        help=f"{OFFLINE_TASK}: pick the true next sentence of a wiki-sample passage among four (offline, shipped). "
        "Also lm-eval's registered names (their data sets need the hub or its cache) and the tasks of the local folder below.",
    )
    c1, c2 = st.columns(2)
    c1.number_input(
        "Examples per task",
        min_value=1,
        max_value=100_000,
        step=10,
        key=f"{prefix}task_limit",
        help="A few keep a demo quick; the standard error says how far the accuracy can be trusted.",
    )
    c2.text_input(
        "Local task folder (optional)",
        key=f"{prefix}task_folder",
        help="A folder of lm-eval task YAMLs (dataset_path: json naming local files): lm-eval's --include-path.",
    )


def checked_task_settings(prefix: str, slot: str) -> tuple[bool, TaskSettings | None]:
    """(ok, the picker's TaskSettings or None when switched off), checked by the engine as ``gap eval
    --tasks`` checks them; a problem becomes the page's one error message and ok is False."""
    if not st.session_state[f"{prefix}tasks_on"]:
        return True, None
    try:
        settings = task_settings(
            st.session_state[f"{prefix}tasks"],
            limit=int(st.session_state[f"{prefix}task_limit"]),
            include_path=st.session_state[f"{prefix}task_folder"],
        )
        busy = (
            contextlib.nullcontext()
            if lm_eval_imported()
            else st.spinner("Loading lm-eval to check the tasks (first use after a server start: a few seconds) ...")
        )
        with busy:
            import_in_background().join()
            check_tasks(settings)
    except GapError as exc:
        set_message(slot, "error", one_line(exc))
        return False, None
    return True, settings


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
    clear_message(TABLE_LINK_SLOT)
    st.session_state["app_table"] = table
    st.session_state["app_model"] = table.model
    if previous is None or previous.key != table.key:
        st.session_state["app_plan"] = None
        st.session_state["app_plan_hash"] = None
        st.session_state["app_baselines"] = None
        if previous is None or previous.num_layers != table.num_layers:
            st.session_state["app_constraints"] = dict(SHARED_DEFAULTS["app_constraints"], locked={})


def autoload_latest():
    """Once per session, for a link that names no table: open the newest cached table, and say
    so on Setup with every cached table listed (the choice is never silent).

    Returns:
        The table opened, or None (already done, a table or build in the session, an empty cache).
    """
    if st.session_state.get("app_autoloaded"):
        return None
    st.session_state["app_autoloaded"] = True
    if current_table() is not None or session_job("table") is not None:
        return None
    from gap_engine.tables import cache

    try:
        rows = sorted(cache.list_tables(), key=lambda r: r.get("created") or "", reverse=True)
        table = cache.get_table(rows[0]["key"]) if rows else None
    except GapError:
        return None
    if table is None:
        return None
    set_table(table)
    listed = "; ".join(f"`{r['key']}` ({_table_summary(r)})" for r in rows[:8]) + (f"; and {len(rows) - 8} more" if len(rows) > 8 else "")
    set_message(
        "setup",
        "info",
        f"The link names no table, so the most recent cached table was opened: `{table.key}` ({_table_summary(rows[0])}). "
        f"The cache holds {len(rows)}: {listed}. Pick another under Cached tables below, or build one.",
    )
    return table


def _table_summary(row: dict) -> str:
    """'smollm2-135m, fisher, 16 x 256 tokens of wiki-sample, built 2026-12-01T10:00' of a cache row."""
    spec = row.get("spec") or {}  # TableSpec.summary(): flat fields
    return (
        f"{row.get('model')}, {spec.get('estimator', '?')}, {spec.get('n_samples', '?')} x {spec.get('seq_len', '?')} tokens "
        f"of {spec.get('data', '?')}, built {str(row.get('created') or '?')[:16].replace('T', ' ')}"
    )


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
        show_message(TABLE_LINK_SLOT)  # a link that named a table this cache lacks: said here, not only on Setup
        st.info("No loss table yet: build one or load a cached one on the **Setup** page.")
        st.page_link(SETUP_PAGE, label="Go to Setup", icon=":material/settings:")
        st.stop()
    return table


def release_plan(plan, raw_constraints: dict) -> str:
    """Make ``plan`` the released plan every page uses, stored by its hash; returns the hash.

    A cache that cannot be written leaves the plan usable in this session (a reload then
    says it cannot restore it).
    """
    from gap_engine.plan import store as planstore

    try:
        digest = planstore.put_plan(plan, raw_constraints)
    except GapError:
        digest = plan.content_hash()
    st.session_state["app_plan"] = plan.to_dict()
    st.session_state["app_plan_hash"] = digest
    st.session_state["app_plan_missing"] = None
    return digest


def release_current_plan(table):
    """Release the plan the planner shows for this session's budget and constraints, when the
    planner was not opened in this session (a page opened directly): the same front row the
    budget chart starts at (`front_view.budget_steps`, `step_at_budget`) and the same
    `row_plan`, so it is the planner's plan, not a re-solve. Returns the RatePlan.

    Raises:
        GapError: the model cannot be loaded, or no plan satisfies the constraints.
    """
    from gap_engine.plan.front_view import budget_steps, row_plan, step_at_budget

    raw = st.session_state.get("app_constraints") or SHARED_DEFAULTS["app_constraints"]
    rows = session_front(table, raw)
    steps = budget_steps(rows)
    row = rows[steps[step_at_budget(rows, steps, float(st.session_state["app_budget"]))]]
    plan = row_plan(reference_model(table.model), table, row, plan_compensation(table))
    st.session_state["app_budget"] = float(row["budget"])
    release_plan(plan, raw)
    return plan


def constraints_from_state() -> Constraints:
    """The planner's constraints of this session."""
    return Constraints.from_dict(st.session_state.get("app_constraints"))


def constraints_json(raw: dict) -> str:
    """A canonical text of a constraints dict (a cache key)."""
    return json.dumps(raw, sort_keys=True)


def plan_compensation(table) -> str | None:
    """The compensation the planner's plans are counted for: the session's (``app_compensation``),
    as the DP's runs apply it; None where it adds nothing to count (``none``), so such plans are
    the uncharged plans they always were."""
    counted = counted_compensation("dp", table, str(st.session_state.get("app_compensation") or DEFAULT_COMPENSATION))
    return None if counted in (None, "none") else counted


def session_front(table, raw: dict | None = None) -> list[dict]:
    """The planner's front for ``table`` under ``raw`` constraints (the session's when None),
    charged for the biases of the session's compensation (`plan_compensation`)."""
    raw = raw if raw is not None else (st.session_state.get("app_constraints") or SHARED_DEFAULTS["app_constraints"])
    return pareto_rows(table.key, constraints_json(raw), plan_compensation(table) or "none", table)


@st.cache_data(max_entries=32, show_spinner=False)
def pareto_rows(table_key: str, constraints_text: str, compensation: str, _table) -> list[dict]:
    """front.front_rows of the DP front for one table, constraints and compensation (cached per
    process): a compensation that adds biases has them paid from every budget, and each row
    says how many (``bias_params``).

    Raises:
        GapError: the model cannot be loaded (the biases need its geometry), or bad constraints.
    """
    counts = charged_counts(shared_model(_table.model), compensation) if compensation != "none" else None
    return front_rows(_table, dp_front(_table, Constraints.from_dict(json.loads(constraints_text)), biases=counts), counts)


# ---- jobs ----------------------------------------------------------------------------------
def session_job(kind: str):
    """This session's latest job of ``kind`` (or None)."""
    return manager().get(st.session_state.get("app_jobs", {}).get(kind))


def remember_job(kind: str, job) -> None:
    """Make ``job`` this session's job of ``kind``: its progress shows here and its result
    is applied here when it ends (a job started in another tab can be attached this way)."""
    st.session_state["app_jobs"][kind] = job.id


def sidebar_jobs() -> None:
    """Every running job of this server, whichever tab started it: progress, Watch, and Cancel for
    the jobs this browser started.

    Polls every SIDEBAR_POLL_SECONDS (a fragment), so a job started in another tab shows up
    by itself; when a job of this session ends, the whole app reruns to apply its result.
    """

    @st.fragment(run_every=SIDEBAR_POLL_SECONDS)
    def panel():
        if st.session_state.pop("app_watch_started", False) or st.session_state.pop(_CANCEL_REQUESTED, False):
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
        # Until the stage times its own steps, the time left is the prediction's; past it, revised from the time so far.
        how = "" if snap["eta"] is not None else " (revised: past its predicted time)" if snap.get("overrun") else " (predicted)"
        parts.append(f"about {duration_text(snap['seconds_left'])} left{how}")
    elif snap["eta"] is not None:
        parts.append(f"this stage about {duration_text(snap['eta'])} left")
    parts.append(f"{duration_text(snap['elapsed'])} elapsed")
    return " · ".join(parts)


def expected_text(snap: dict) -> str | None:
    """What the whole job was predicted to take, when every stage has a prediction."""
    total = snap.get("expected_total")
    if total is None:
        return None
    return f"Expected about {duration_text(total)} in all ({snap['expected_basis']})."


def expected_caption(predicted, what: str) -> None:
    """What a job the form describes is predicted to take, before it is started.

    Args:
        predicted: a ``pipeline.cost_model.Prediction``, or None when nothing honest can be said.
        what: the job in one word ("build", "run").
    """
    if predicted is not None:
        stages = ", ".join(f"{name} {duration_text(seconds)}" for name, seconds in predicted.seconds.items())
        st.caption(f"Predicted time ({predicted.where}): about {duration_text(predicted.total)} ({stages}; {predicted.basis}).")
    else:
        st.caption(
            f"Expected time: not known yet (a model whose shape needs the network, or a device not measured yet: Estimate "
            f"measures it); the time left shows as the {what} measures its stages."
        )


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


READ_ONLY_JOB = "Started in another browser: read-only here."


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
    st.session_state[_CANCEL_REQUESTED] = True


_CANCEL_REQUESTED = "app_cancel_requested"


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
        if not job.active or st.session_state.pop(_CANCEL_REQUESTED, False):
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
