"""The view in the address bar: a reload, a second tab or a shared link opens the same view.

The page is the URL's path (``/planner``, Streamlit's own); the rest is in the query string:

    table      the cache key of the loss table on screen
    budget     the chosen budget, written so it reads back to the same front row
    plan       the content hash of the plan the planner released (`gap_engine.plan.store`):
               a reload prunes and exports that plan, or says it cannot restore it
    allocator  the allocator Prune & evaluate runs
    runs       the runs compared on Prune & evaluate
    run        the run whose result Prune & evaluate shows: a reload shows the same panel
               (read back from the run history)
    recovery   the history id of the recovery whose result Recover shows: a reload shows the
               same panel (read back from the recovered checkpoint's recovery.json)
    eval_tasks, eval_task_limit, eval_task_folder, recover_tasks, recover_task_limit,
    recover_task_folder
               the task pickers of Prune & evaluate and Recover (``off`` when switched off),
               written only where they differ from the picker's defaults
    jobs       this tab's running jobs: a reload attaches to them, shows their progress
               and gets their results when they end

`restore` reads it once per session, before any page draws (so a reload opens the table
the user had, not the newest cached one, and a running build is watched again with its
form filled in); `sync` writes the session's view back after every run.
"""

from __future__ import annotations

from pathlib import Path

import streamlit as st

from gap_engine.core.errors import GapError, one_line
from gap_engine.data.windows import BUILTIN_SOURCES
from gap_engine.evaluate import history
from gap_engine.model.loading import BUILTIN_MODELS
from gap_engine.pipeline.jobs import manager
from gap_engine.pipeline.recovery import finished_recovery
from gap_engine.pipeline.runs import PruneEvalResult
from gap_engine.plan import store as planstore
from gap_engine.plan.allocator_registry import ALLOCATORS
from gap_engine.recover.teacher_text import DEFAULT_TOKENS, is_teacher_source, parse_tokens
from gap_engine.recover.teacher_text import SOURCE as TEACHER_SOURCE
from gap_engine.tables import cache
from pages import common

TASK_PAGES = ("eval_", "recover_")  # the pages with a task picker (``common.task_picker``), by key prefix
PARAMS = ("table", "budget", "plan", "allocator", "runs", "run", "recovery", "jobs") + tuple(
    f"{prefix}{name}" for prefix in TASK_PAGES for name in ("tasks", "task_limit", "task_folder")
)
_RESTORED = "app_url_restored"


def _split(value: str | None) -> list[str]:
    return [part for part in (value or "").split(",") if part]


def setup_form(model: str, spec: dict) -> None:
    """Fill the Setup form with a table's model and settings (``TableSpec.to_dict()``)."""
    ss = st.session_state
    if model in BUILTIN_MODELS:
        ss["setup_model_kind"], ss["setup_builtin"] = "Built-in", model
    elif Path(model).exists():
        ss["setup_model_kind"], ss["setup_local_path"] = "Local folder", model
    else:
        ss["setup_model_kind"], ss["setup_hub_id"] = "Hub id", model
    data = spec.get("data", "")
    if data in BUILTIN_SOURCES:
        ss["setup_data_kind"], ss["setup_builtin_data"] = "Built-in sample", data
    elif data:
        ss["setup_data_kind"], ss["setup_uploaded_path"] = "Uploaded file", data
    fields = {
        "criterion": "setup_criterion", "objective": "setup_objective", "mode": "setup_mode",
        "estimator": "setup_estimator", "n_samples": "setup_samples", "seq_len": "setup_seq_len",
        "seed": "setup_seed", "batch_size": "setup_batch", "channel_multiple": "setup_channel_multiple",
    }  # fmt: skip
    for name, key in fields.items():
        if name in spec:
            ss[key] = spec[name]
    if spec.get("rate_grid"):
        ss["setup_rate_grid"] = ", ".join(f"{float(r):g}" for r in spec["rate_grid"])


def _attach_jobs(ids: list[str]) -> bool:
    """Watch the jobs named in the URL again; True when one was found."""
    found = False
    for job_id in ids:
        job = manager().get(job_id)
        if job is None:
            common.set_message("setup", "warning", f"The job {job_id} from the link is gone (the server was restarted).")
            continue
        common.remember_job(job.kind, job)
        if job.kind == "table" and job.params.get("model"):
            setup_form(job.params["model"], job.params.get("spec") or {})
        if job.kind == "recover" and job.params.get("settings"):
            recover_form(job.params.get("checkpoint"), job.params["settings"])
        found = True
    return found


# Recover's form fields, by the RecoverySettings field each shows (the task picker travels in the URL).
_RECOVER_FIELDS = {
    "method": "recover_method", "temperature": "recover_temperature", "steps": "recover_steps",
    "batch_size": "recover_batch_size", "seq_len": "recover_seq_len", "rank": "recover_rank",
    "mask_fraction": "recover_mask_fraction", "eval_samples": "recover_eval_samples",
    "eval_seq_len": "recover_eval_seq_len", "eval_generations": "recover_generations",
}  # fmt: skip


def recover_form(checkpoint: str | None, settings: dict) -> None:
    """Fill Recover's form with a recovery's checkpoint and settings (``asdict(RecoverySettings)``),
    so a reload shows what the run on screen was asked, not the page's defaults."""
    ss = st.session_state
    for name, key in _RECOVER_FIELDS.items():
        if settings.get(name) is not None:
            ss[key] = settings[name]
    ss["recover_objective"] = settings.get("objective") or "default"  # None: the page's "default"
    ss["recover_lr"] = float(settings.get("lr") or 0.0)  # 0: the method's default rate
    ss["recover_minutes"] = float(settings.get("time_budget_s") or 0.0) / 60
    sources = [name for name in settings.get("tasks") or () if name in BUILTIN_SOURCES or is_teacher_source(name)]
    if sources:
        ss["recover_sources"] = [TEACHER_SOURCE if is_teacher_source(name) else name for name in sources]
        ss["recover_teacher_tokens"] = next((parse_tokens(name) for name in sources if is_teacher_source(name)), DEFAULT_TOKENS)
    ss["recover_eval_every"] = int(settings.get("eval_every") or 0)
    if checkpoint:
        source = Path(checkpoint).resolve()
        try:
            found = [r.id for r in history.runs() if r.checkpoint and Path(r.checkpoint).resolve() == source]
        except GapError:
            found = []  # an unreadable history: Recover says so and offers what it can
        if found:
            ss["recover_run"] = int(found[-1])


def _load_table(key: str) -> bool:
    try:
        table = cache.get_table(key)
    except GapError as exc:
        common.set_message("setup", "error", f"The table in the link cannot be read: {one_line(exc)}")
        return False
    if table is None:
        common.set_message("setup", "warning", f"The table {key} from the link is not in the cache; build it or pick another.")
        return False
    common.set_table(table)
    setup_form(table.model, table.spec.to_dict())
    return True


def _restore_plan(plan_hash: str) -> None:
    """The released plan the link names, with the planner constraints it was chosen under;
    or, when it cannot be had, a note saying so (Prune & evaluate then refuses to re-derive one)."""
    ss = st.session_state
    table = common.current_table()
    try:
        stored = planstore.get_plan(plan_hash)
    except GapError as exc:
        stored, why = None, one_line(exc)
    else:
        why = "no plan with this hash is stored here"
    if stored is not None and (table is None or stored[0].table_key != table.key):
        stored, why = None, "it was made for another loss table than the one open"
    if stored is None:
        ss["app_plan_missing"] = f"The plan {plan_hash[:40]} from the link cannot be restored: {why}."
        return
    plan, constraints = stored
    ss["app_plan"], ss["app_plan_hash"], ss["app_plan_missing"] = plan.to_dict(), plan_hash, None
    if plan.budget is not None:
        ss["app_budget"] = float(plan.budget)
    if constraints:
        ss["app_constraints"] = constraints
        # The planner's widgets start from them, so its front (and plan) is the one the link had.
        locked = constraints.get("locked") or {}
        ss["planner_locked"] = sorted(int(layer) for layer in locked)
        ss["planner_lock_rate"] = float(next(iter(locked.values()), 0.0))
        ss["planner_max_rate"] = float(constraints.get("max_rate", ss.get("planner_max_rate", 0.95)))
        ss["planner_coupled"] = bool(constraints.get("coupled", False))


def _restore_task_pickers(params) -> None:
    """The task pickers' settings from the link (checked by the engine when Start is pressed)."""
    ss = st.session_state
    for prefix in TASK_PAGES:
        tasks = params.get(f"{prefix}tasks")
        if tasks == "off":
            ss[f"{prefix}tasks_on"] = False
        elif tasks:
            ss[f"{prefix}tasks_on"], ss[f"{prefix}tasks"] = True, tasks[:1000]
        limit = str(params.get(f"{prefix}task_limit", ""))
        if limit.isdigit() and 1 <= int(limit) <= 100_000:
            ss[f"{prefix}task_limit"] = int(limit)
        if params.get(f"{prefix}task_folder"):
            ss[f"{prefix}task_folder"] = params[f"{prefix}task_folder"][:1000]


def _task_picker_view(ss) -> dict:
    """The task pickers' settings that differ from their defaults, as query parameters."""
    want = {}
    for prefix in TASK_PAGES:
        if f"{prefix}tasks_on" not in ss:
            continue  # the page was not opened in this session
        defaults = common.task_defaults(prefix)
        if not ss[f"{prefix}tasks_on"]:
            want[f"{prefix}tasks"] = "off"
        elif ss[f"{prefix}tasks"] != defaults[f"{prefix}tasks"]:
            want[f"{prefix}tasks"] = str(ss[f"{prefix}tasks"])
        if ss.get(f"{prefix}task_limit") != defaults[f"{prefix}task_limit"]:
            want[f"{prefix}task_limit"] = str(ss[f"{prefix}task_limit"])
        if ss.get(f"{prefix}task_folder"):
            want[f"{prefix}task_folder"] = str(ss[f"{prefix}task_folder"])
    return want


def _restore_run(run_id: int) -> None:
    """The finished run the link names, as its history row keeps it (gone: nothing shown)."""
    try:
        record = history.get_run(run_id)
    except GapError:
        return  # deleted since, or an unreadable history (the history table says so)
    st.session_state["app_last_run"] = PruneEvalResult.from_record(record, common.current_table())


def _restore_recovery(run_id: int) -> None:
    """The finished recovery the link names, read back from its recovered checkpoint; when that
    cannot be read, Recover says so (the run's history row is still listed in the history)."""
    try:
        result = finished_recovery(run_id)
        source = history.get_run(run_id).params["recovery"].get("source")
    except GapError as exc:
        common.set_message("recover", "warning", f"The recovery run {run_id} from the link cannot be shown: {one_line(exc)}")
        return
    st.session_state["app_last_recovery"] = result
    recover_form(source, result.settings)


def restore() -> bool:
    """Once per session: take the table, budget, allocator, runs and jobs from the URL.

    Returns:
        True when the URL named a table, or a job that was found: the newest cached table is
        then not loaded in its place (a table the cache lacks leaves a warning and no table).
    """
    ss = st.session_state
    if _RESTORED in ss:
        return ss[_RESTORED]
    params = st.query_params
    named = _attach_jobs(_split(params.get("jobs")))
    if params.get("table") and common.current_table() is None:
        _load_table(params["table"])
        named = True  # a table the link names and the cache lacks is said so, not swapped for another
    try:
        budget = float(params.get("budget", ""))
    except ValueError:
        budget = None
    if budget is not None and 0.0 <= budget < 1.0:
        ss["app_budget"] = budget
    if params.get("plan"):
        _restore_plan(params["plan"])
    if params.get("allocator") in ALLOCATORS:
        ss["eval_allocator"] = params["allocator"]
    runs = [int(r) for r in _split(params.get("runs")) if r.isdigit()]
    if runs:
        ss["eval_compare"] = runs
    _restore_task_pickers(params)
    if str(params.get("run", "")).isdigit() and not ss.get("app_last_run"):
        _restore_run(int(params["run"]))
    if str(params.get("recovery", "")).isdigit() and not ss.get("app_last_recovery"):
        _restore_recovery(int(params["recovery"]))
    ss[_RESTORED] = named
    return named


def view() -> dict:
    """The query string this session's view calls for (absent keys are removed)."""
    ss = st.session_state
    want = {}
    table = common.current_table()
    if table is not None:
        want["table"] = table.key
        want["budget"] = repr(float(ss["app_budget"]))  # repr reads back to the same float
        if ss.get("app_plan") and ss.get("app_plan_hash") and ss["app_plan"].get("budget") == ss["app_budget"]:
            # A run interrupted by the next one (a release under load) has set the new budget and
            # not yet released its plan; this sync runs in app.py's finally all the same. Pairing
            # that budget with the old plan's hash put a plan of another budget in the link.
            want["plan"] = ss["app_plan_hash"]
    if ss.get("eval_allocator") in ALLOCATORS:
        want["allocator"] = ss["eval_allocator"]
    if ss.get("app_last_run"):
        want["run"] = str(ss["app_last_run"].run_id)
    if ss.get("app_last_recovery") and ss["app_last_recovery"].run_id is not None:
        want["recovery"] = str(ss["app_last_recovery"].run_id)
    if ss.get("eval_compare"):
        want["runs"] = ",".join(str(r) for r in ss["eval_compare"])
    want |= _task_picker_view(ss)
    running = [job_id for job_id in ss.get("app_jobs", {}).values() if (job := manager().get(job_id)) is not None and job.active]
    if running:
        want["jobs"] = ",".join(running)
    return want


def sync() -> None:
    """Write the session's view into the query string, touching only what changed."""
    want = view()
    params = st.query_params
    for name in PARAMS:
        if name not in want:
            if name in params:
                del params[name]
        elif params.get(name) != want[name]:
            params[name] = want[name]
