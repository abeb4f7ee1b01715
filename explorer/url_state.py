"""The view in the address bar: a reload, a second tab or a shared link opens the same view.

The page is the URL's path (``/planner``, Streamlit's own); the rest is in the query string:

    table      the cache key of the loss table on screen
    budget     the chosen budget, written so it reads back to the same front row
    plan       the content hash of the plan the planner released (`gap_engine.plan.store`):
               a reload prunes and exports that plan, or says it cannot restore it
    allocator  the allocator Prune & evaluate runs
    compensation the compensation after the cut (planner and Prune & evaluate), written where it
               is not the default; a plan the link names brings its own
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
               and gets their results when they end; only the browser that started a job
               gets its Cancel (explorer/ownership.py: a cookie, never a URL parameter), so a
               shared link shows them read-only

`restore` reads it once per session, before any page draws (so a reload opens the table
the user had, not the newest cached one, and a running build is watched again with its
form filled in); `sync` writes the session's view back after every run.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import streamlit as st

from explorer.messages import TABLE_LINK_SLOT, set_message
from explorer.session_jobs import remember_job
from explorer.table_state import current_table, default_compensation, set_table
from explorer.task_picker import task_defaults
from gap_engine.core.cachepaths import KEY_PATTERN
from gap_engine.core.errors import GapError, one_line
from gap_engine.data.windows import BUILTIN_SOURCES
from gap_engine.evaluate import history
from gap_engine.model.loading import BUILTIN_MODELS
from gap_engine.pipeline.jobs import manager
from gap_engine.pipeline.recovery import finished_recovery
from gap_engine.pipeline.runs import PruneEvalResult
from gap_engine.plan import store as planstore
from gap_engine.plan.allocator_registry import ALLOCATORS
from gap_engine.prune.compensations import COMPENSATIONS
from gap_engine.recover.teacher_text import DEFAULT_TOKENS, is_teacher_source, parse_tokens
from gap_engine.recover.teacher_text import SOURCE as TEACHER_SOURCE
from gap_engine.tables import cache

TASK_PAGES = ("eval_", "recover_")  # the pages with a task picker (``explorer.task_picker``), by key prefix
PARAMS = ("table", "budget", "plan", "allocator", "compensation", "runs", "run", "recovery", "jobs") + tuple(
    f"{prefix}{name}" for prefix in TASK_PAGES for name in ("tasks", "task_limit", "task_folder")
)
_RESTORED = "app_url_restored"
LINK_MESSAGE = "link"  # the message slot the sidebar shows: what of the link was ignored, and why
WHOLE = re.compile(r"[0-9]{1,18}")  # ASCII digits only: "²".isdigit() is True, int("²") fails
PLAN_HASH = re.compile(r"[0-9a-f]{12}")
TEXT_CHARS = 1000  # longest task list or folder a link may set
TASK_LIMIT = (1, 100_000)  # the picker's own range


def _split(value: str | None) -> list[str]:
    return [part for part in (value or "").split(",") if part]


@dataclass
class Link:
    """What a query string asks for, each value parsed or left out (``problems`` says which and why)."""

    table: str | None = None
    budget: float | None = None
    plan: str | None = None
    allocator: str | None = None
    compensation: str | None = None
    runs: list[int] = field(default_factory=list)
    run: int | None = None
    recovery: int | None = None
    jobs: list[str] = field(default_factory=list)
    pickers: dict[str, dict] = field(default_factory=dict)  # prefix -> every field of its task picker
    problems: list[str] = field(default_factory=list)  # one short line per ignored parameter


def _whole(text: str, low: int = 1, high: int = 10**18) -> int | None:
    """A whole number in [low, high] written in ASCII digits, or None."""
    if not WHOLE.fullmatch(text):
        return None
    value = int(text)
    return value if low <= value <= high else None


def _shown(value: str) -> str:
    return repr(value[:40] + ("..." if len(value) > 40 else ""))


def parse_link(params: Mapping[str, str]) -> Link:
    """The one parser of the app's query string: every value checked for what it must be (whole
    numbers in ASCII digits and in range, a budget in [0, 1), a known allocator, a plan hash);
    one that is not is left out and named in ``problems``, never raised. A task picker the link
    names gets its other fields' defaults (``explorer.task_picker.task_defaults``), so no page meets a picker
    half set."""
    link = Link()

    def bad(name: str, why: str) -> None:
        link.problems.append(f"{name}={_shown(str(params[name]))} {why}")

    if params.get("table"):
        key = str(params["table"])
        link.table = key if KEY_PATTERN.fullmatch(key) and ".." not in key else None
        if link.table is None:
            bad("table", "is not a loss-table cache key")
    if params.get("budget"):
        try:
            link.budget = float(params["budget"])
        except ValueError:
            link.budget = None
        if link.budget is None or not (math.isfinite(link.budget) and 0.0 <= link.budget < 1.0):
            link.budget = None
            bad("budget", "is not a budget in [0, 1)")
    if params.get("plan"):
        link.plan = params["plan"] if PLAN_HASH.fullmatch(params["plan"]) else None
        if link.plan is None:
            bad("plan", "is not a plan hash (12 hex digits)")
    if params.get("allocator"):
        link.allocator = params["allocator"] if params["allocator"] in ALLOCATORS else None
        if link.allocator is None:
            bad("allocator", f"is not one of {', '.join(ALLOCATORS)}")
    if params.get("compensation"):
        link.compensation = params["compensation"] if params["compensation"] in COMPENSATIONS else None
        if link.compensation is None:
            bad("compensation", f"is not one of {', '.join(COMPENSATIONS)}")
    for name in ("run", "recovery"):
        if params.get(name):
            setattr(link, name, _whole(params[name]))
            if getattr(link, name) is None:
                bad(name, "is not a run number")
    if params.get("runs"):
        runs = [_whole(part) for part in _split(params["runs"])]
        link.runs = [] if None in runs else [int(r) for r in runs if r is not None]
        if not link.runs:
            bad("runs", "is not a list of run numbers")
    link.jobs = [job[:100] for job in _split(params.get("jobs"))]
    for prefix in TASK_PAGES:
        _parse_picker(params, prefix, link, bad)
    return link


def _parse_picker(params: Mapping[str, str], prefix: str, link: Link, bad) -> None:
    """The task picker of one page: its fields from the link, the defaults for those it leaves out."""
    names = [f"{prefix}{name}" for name in ("tasks", "task_limit", "task_folder")]
    if not any(params.get(name) for name in names):
        return
    picker = dict(task_defaults(prefix))
    tasks = params.get(names[0])
    if tasks == "off":
        picker[f"{prefix}tasks_on"] = False
    elif tasks:
        picker[f"{prefix}tasks_on"], picker[names[0]] = True, tasks[:TEXT_CHARS]
    limit = params.get(names[1])
    if limit:
        value = _whole(limit, *TASK_LIMIT)
        if value is None:
            bad(names[1], f"is not a number of examples from {TASK_LIMIT[0]} to {TASK_LIMIT[1]:,}")
        else:
            picker[names[1]] = value
    if params.get(names[2]):
        picker[names[2]] = params[names[2]][:TEXT_CHARS]
    link.pickers[prefix] = picker


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
    sources = [part.strip() for part in str(data).split(",") if part.strip()]
    if sources and all(source in BUILTIN_SOURCES for source in sources):
        ss["setup_data_kind"], ss["setup_builtin_data"], ss["setup_mixed_data"] = "Built-in sample", sources[0], sources[1:]
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
            set_message("setup", "warning", f"The job {job_id} from the link is gone (the server was restarted).")
            continue
        remember_job(job.kind, job)
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
        text = f"The table in the link cannot be read: {one_line(exc)}"
        set_message("setup", "error", text)
        set_message(TABLE_LINK_SLOT, "error", text)
        return False
    if table is None:
        text = f"The link names the loss table `{key}`, which this cache does not hold: build it on Setup or pick another."
        set_message("setup", "warning", text)
        set_message(TABLE_LINK_SLOT, "warning", text)  # every page that needs a table says so, not Setup alone
        return False
    set_table(table)
    setup_form(table.model, table.spec.to_dict())
    return True


def _restore_plan(plan_hash: str) -> None:
    """The released plan the link names, with the planner constraints it was chosen under;
    or, when it cannot be had, a note saying so (Prune & evaluate then refuses to re-derive one)."""
    ss = st.session_state
    table = current_table()
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
    # The front the plan came from was charged for its compensation: the pages go on with that one.
    ss["app_compensation"] = plan.compensation or "none"
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


def _task_picker_view(ss) -> dict:
    """The task pickers' settings that differ from their defaults, as query parameters."""
    want = {}
    for prefix in TASK_PAGES:
        if f"{prefix}tasks_on" not in ss:
            continue  # the page was not opened in this session
        defaults = task_defaults(prefix)
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
    st.session_state["app_last_run"] = PruneEvalResult.from_record(record, current_table())


def _restore_recovery(run_id: int) -> None:
    """The finished recovery the link names, read back from its recovered checkpoint; when that
    cannot be read, Recover says so (the run's history row is still listed in the history)."""
    try:
        result = finished_recovery(run_id)
        source = history.get_run(run_id).params["recovery"].get("source")
    except GapError as exc:
        set_message("recover", "warning", f"The recovery run {run_id} from the link cannot be shown: {one_line(exc)}")
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
    link = parse_link({name: str(st.query_params[name]) for name in PARAMS if name in st.query_params})
    if link.problems:
        set_message(LINK_MESSAGE, "warning", "Ignored from the link: " + "; ".join(link.problems) + ".")
    named = _attach_jobs(link.jobs)
    if link.table and current_table() is None:
        _load_table(link.table)
        named = True  # a table the link names and the cache lacks is said so, not swapped for another
    if link.budget is not None:
        ss["app_budget"] = link.budget
    if link.compensation:
        ss["app_compensation"] = link.compensation
    if link.plan:
        _restore_plan(link.plan)
    if link.allocator:
        ss["eval_allocator"] = link.allocator
    if link.runs:
        ss["eval_compare"] = link.runs
    for picker in link.pickers.values():  # the engine checks the tasks when Start is pressed
        ss.update(picker)
    if link.run is not None and not ss.get("app_last_run"):
        _restore_run(link.run)
    if link.recovery is not None and not ss.get("app_last_recovery"):
        _restore_recovery(link.recovery)
    ss[_RESTORED] = named
    return named


def view() -> dict:
    """The query string this session's view calls for (absent keys are removed)."""
    ss = st.session_state
    want = {}
    table = current_table()
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
    if ss.get("app_compensation") not in (None, default_compensation(table)):  # the model's default goes unsaid
        want["compensation"] = str(ss["app_compensation"])
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
    """Write the session's view into the query string, touching only what changed.

    Every assignment sends the whole query string to the browser, so the values that change go in
    one update: a budget and its plan hash never reach the address bar one at a time (a reader
    between the two saw the new budget beside the old plan's hash). Removals go first; what they
    leave is part of the old view, never new values beside old ones.
    """
    want = view()
    params = st.query_params
    for name in PARAMS:
        if name not in want and name in params:
            del params[name]
    changed = {name: want[name] for name in PARAMS if name in want and params.get(name) != want[name]}
    if changed:
        params.update(changed)


# The address bar's path is Streamlit's: it pushes the page's path when a page's run starts and, for
# every query-string update, re-uses whatever path the bar shows then. Under load a page switch and
# a query update of the page before it can cross, and the bar kept "/planner" while Prune & evaluate
# was on screen (a reload or a shared link then opened the planner). So every run also states the
# path of the page it drew, and this sets the bar to it, keeping the query string; a run counter
# makes it act on every run, not only when the page changes.
_PATH_KEY = "app_url_path"
_PATH_JS = """
export default function ({ data }) {
  const here = window.location.pathname.replace(/\\/+$/, "") || "/";
  if (here === data.path) return;
  window.history.replaceState(window.history.state, "", data.path + window.location.search + window.location.hash);
}
"""


@lru_cache(maxsize=1)
def _path_component():
    return st.components.v2.component("gap_url_path", js=_PATH_JS)


def page_path(url_path: str) -> str:
    """The address-bar path of a page (``st.Page.url_path``; "" is the default page), under the
    server's base URL path when one is set."""
    base = str(st.get_option("server.baseUrlPath") or "").strip("/")
    return "/" + "/".join(part for part in (base, url_path.strip("/")) if part)


def keep_path(url_path: str) -> None:
    """Make the address bar show the page this run drew (see `_PATH_JS`); app.py calls it on every run."""
    ss = st.session_state
    ss["app_url_runs"] = int(ss.get("app_url_runs", 0)) + 1
    with st.sidebar:
        _path_component()(key=_PATH_KEY, data={"path": page_path(url_path), "run": ss["app_url_runs"]})
