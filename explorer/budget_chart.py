"""The budget chart: the app's one budget control (a bidirectional Streamlit v2 component).

The whole DP front (one step per front row, thinned to `front_view.MAX_STEPS`) goes to the
browser once; while the pointer moves, the slider swaps the bars, the uniform line, the
current point and the readout there, with no round trip (`budget_chart.js`). On release
the component reports the step (front, row index, removed parameters, budget) back;
`apply_pending_release` (app.py, before any page draws) checks it against the current front
and makes that row's budget and plan the app-wide ``app_budget`` and ``app_plan``, both at
once. The chart always starts at the step of ``app_budget``, so the two directions agree,
and the step's budget is its row's own removed fraction, so the value under the thumb is
what the page's plan removes.

Why in app.py and not in the planner: a release is a rerun, and a rerun that a newer one
interrupts (a page switch right after the keys stop, on a loaded machine) may never reach the
planner's body; applied there, a release would wait in session state until the planner ran
again, while Prune & evaluate and Export used the budget and plan before it. And a step the
chart never got to send (the page was left before the keys' release timer) is kept in the
tab's sessionStorage and sent by the keeper that app.py mounts on the other pages
(`keep_unsaved_release`).

plotly.js is inlined from the installed plotly package by a second, constant component
(`load_plotly`): after the first page load of a tab its element is a cached message, and no
request leaves the machine. The chart places its moving point through plotly.js's public
surface only (the figure's layout and the plot area's box in the DOM; `budget_chart.js`).
"""

from __future__ import annotations

import hashlib
import json
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

import streamlit as st

from explorer.plan_state import constraints_json, plan_compensation, release_plan, session_front
from explorer.session_keys import SHARED_DEFAULTS
from explorer.table_state import current_table
from gap_engine.core.errors import GapError, one_line
from gap_engine.pipeline.jobs import shared_model
from gap_engine.plan.front_view import RemovedShares, budget_steps, grid_indices, grid_shares, row_plan, step_at_budget, uniform_line
from gap_engine.plan.problem import Constraints
from gap_engine.views import figures
from gap_engine.views.report import plotly_js

if TYPE_CHECKING:
    from gap_engine.pipeline.runs import BaselinePlan

HERE = Path(__file__).resolve().parent
CHART_KEY = "planner_budget_chart"
RELEASE_KEY = "planner_budget_release"  # the last release, kept for the page run that follows it
KEEPER_KEY = "app_budget_keeper"  # the keeper of a step the chart showed and the server does not have yet
KEPT_KEY = "app_budget_kept"  # the id of the last step the keeper handed over (applied, or refused as stale)
_PLOTLY_KEY = "app_plotly_js"


@lru_cache(maxsize=1)
def _plotly_component():
    # The chart needs its own plotly.js: Streamlit's frontend bundles one for st.plotly_chart, but
    # as a module inside a chunk it loads on demand, with no public handle, and the chart (a v2
    # component, drawn in the page itself, not in an iframe) calls window.Plotly (react, animate,
    # Plots.resize). The source is read once per process (`report.plotly_js`, this cache) and the
    # component is defined once; Streamlit's message cache then sends the 4.6 MB to a tab once,
    # and a reference on every later run. Run as a classic script (the bundle is written for one,
    # not for a module's strict scope); it sets window.Plotly.
    js = (
        f"const SOURCE = {json.dumps(plotly_js())};\n"
        "export default function () {\n"
        "  if (window.Plotly || document.getElementById('gap-plotly-js')) return;\n"
        "  const script = document.createElement('script');\n"
        "  script.id = 'gap-plotly-js';\n"
        "  script.text = SOURCE;\n"
        "  document.head.appendChild(script);\n"
        "}\n"
    )
    return st.components.v2.component("gap_plotly_js", js=js, isolate_styles=False)


@lru_cache(maxsize=1)
def _chart_component():
    js = (HERE / "budget_chart.js").read_text(encoding="utf-8")
    css = (HERE / "budget_chart.css").read_text(encoding="utf-8")
    # Not isolated: plotly.js styles its hover labels and drag layers from document.head.
    return st.components.v2.component("gap_budget_chart", js=js, css=css, isolate_styles=False)


@st.cache_data(max_entries=32, show_spinner="Planning uniform pruning along the budget axis ...")
def _uniform_rows(table_key: str, constraints_text: str, top: float, extra: tuple, compensation: str | None, _table, _lm) -> list[dict]:
    constraints = Constraints.from_dict(json.loads(constraints_text))
    return uniform_line(_lm, _table, constraints, top, extra=extra, compensation=compensation)


def uniform_rows(table, lm, raw_constraints: dict, top: float, baselines: list[BaselinePlan] | None) -> list[dict]:
    """`front_view.uniform_line` for the table and constraints (cached per process), charged for
    the biases of the session's compensation as the front beside it is.

    The budgets of uniform baseline markers are planned too, so the markers lie on the line.
    """
    extra = tuple(sorted({float(b.budget) for b in baselines or [] if b.allocator == "uniform" and b.planned}))
    constraints_text = json.dumps(raw_constraints, sort_keys=True)
    return _uniform_rows(table.key, constraints_text, round(float(top), 6), extra, plan_compensation(table), table, lm)


@st.cache_data(max_entries=8, show_spinner=False)
def _grid_shares(table_key: str, _table, _lm) -> list[RemovedShares]:
    return grid_shares(_lm, _table)


def rate_shares(table, lm) -> list[RemovedShares]:
    """What every grid rate really removes in every layer (`front_view.grid_shares`), once per table."""
    return _grid_shares(table.key, table, lm)


def row_shares(shares: list[RemovedShares], table, row: dict) -> RemovedShares:
    """What one front row's rates really remove, looked up in ``shares`` (`rate_shares`)."""
    attention = grid_indices(table.rate_grid, row["attention_rates"])
    mlp = grid_indices(table.rate_grid, row["mlp_rates"])
    return RemovedShares(
        attention=[shares[k].attention[layer] for layer, k in enumerate(attention)],
        mlp=[shares[k].mlp[layer] for layer, k in enumerate(mlp)],
        attention_text=[shares[k].attention_text[layer] for layer, k in enumerate(attention)],
        mlp_text=[shares[k].mlp_text[layer] for layer, k in enumerate(mlp)],
    )


def load_plotly() -> None:
    """Put plotly.js (from the installed plotly package) into the page, once per browser tab."""
    with st.sidebar:
        _plotly_component()(key=_PLOTLY_KEY)


def chart_data(
    table,
    front: list[dict],
    budget: float,
    front_id: str,
    dense_total: int,
    locked: dict | None = None,
    uniform: list[dict] | None = None,
    baselines: list[BaselinePlan] | None = None,
    measured: list[dict] | None = None,
    shares: list[RemovedShares] | None = None,
) -> dict:
    """What the browser gets: the steps (rates as grid indices), the two base figures, the start.

    Args:
        table: the LossTable.
        front: plan.front.front_rows under the current constraints.
        budget: the app's budget; the chart starts at the first step removing at least it.
        front_id: names this front (table key and constraints); a release echoes it.
        dense_total: all parameters of the dense model (readouts).
        locked: layer -> locked rate.
        uniform: rows of front_view.uniform_line.
        baselines: the plans of jobs.baselines_task.
        measured: pruned and measured runs of this table (figures.measured_traces).
        shares: what each grid rate really removes per layer (`rate_shares`): the bars show it.
    Returns:
        A JSON-ready dict; ``active`` is the starting step and ``rows`` maps steps to front rows.
    """
    extras = json.dumps(
        {
            "locked": locked or {},
            "uniform": uniform,
            "baselines": baselines and [b.to_dict() for b in baselines],
            "dense": int(dense_total),
            "measured": measured,
        },
        sort_keys=True,
        default=str,
    )
    base = _chart_base(front_id, extras, table, front, int(dense_total), locked, uniform, baselines, measured, shares)
    active = step_at_budget(front, base["rows"], budget)
    return base | {"active": active, "version": f"{base['version']}:{active}"}


@st.cache_data(max_entries=16, show_spinner=False)
def _chart_base(
    front_id: str, extras: str, _table, _front, dense_total, _locked, _uniform, _baselines, _measured=None, _shares=None
) -> dict:
    """Everything but the starting step (the browser draws any step itself), once per front."""
    table, front = _table, _front
    steps = budget_steps(front)
    first = front[steps[0]]
    rates = figures.rates_figure(table, first, _locked, shares=row_shares(_shares, table, first) if _shares else None)
    front_fig = figures.front_figure(table, front, None, _uniform, _baselines, measured=_measured)  # the browser draws the moving point
    data = {
        "front_id": front_id,
        "objective": figures.OBJECTIVE_NAME.get(table.spec.objective, table.spec.objective),
        "dense_total": dense_total,
        "prunable": int(table.dense_prunable),
        "grid": [float(r) for r in table.rate_grid],
        "rows": steps,
        "budgets": [float(front[i]["budget"]) for i in steps],
        "removed": [int(front[i]["removed"]) for i in steps],
        "bias": [int(front[i].get("bias_params", 0)) for i in steps],
        "loss": [float(front[i]["predicted_loss"]) for i in steps],
        "attn": [grid_indices(table.rate_grid, front[i]["attention_rates"]) for i in steps],
        "mlp": [grid_indices(table.rate_grid, front[i]["mlp_rates"]) for i in steps],
        # per grid rate, per layer: the share of the component each rate removes, and its hover
        "attn_share": [s.attention for s in _shares] if _shares else None,
        "mlp_share": [s.mlp for s in _shares] if _shares else None,
        "attn_text": [s.attention_text for s in _shares] if _shares else None,
        "mlp_text": [s.mlp_text for s in _shares] if _shares else None,
        "marker_color": figures.CURRENT_COLOR,
        "rates_figure": rates.to_json(),
        "front_figure": front_fig.to_json(),
        "legend": _legend(_locked, _uniform, _baselines)
        + ([{"label": "pruned and measured (x; hover: predicted)", "color": figures.DP_COLOR, "shape": "x"}] if _measured else []),
    }
    data["version"] = hashlib.sha1((front_id + extras).encode()).hexdigest()[:16]
    return data


def _legend(locked, uniform, baselines) -> list[dict]:
    """The chart's legend, drawn in HTML so it wraps on a narrow screen."""
    items = [
        {"label": "attention removed (GAP DP)", "color": figures.ATTN_COLOR, "shape": "bar"},
        {"label": "MLP removed (GAP DP)", "color": figures.MLP_COLOR, "shape": "bar"},
        {"label": "GAP DP front", "color": figures.DP_COLOR, "shape": "line"},
        {"label": "uniform: every layer at the budget's rate" + (" (exact plans on the right)" if uniform else ""),
         "color": figures.UNIFORM_COLOR, "shape": "dash"},
        {"label": "chosen budget", "color": figures.CURRENT_COLOR, "shape": "dot"},
    ]  # fmt: skip
    if locked:
        items.append({"label": "locked layer", "color": "#666", "shape": "x"})
    for allocator in sorted({b.allocator for b in baselines or [] if b.planned}):
        items.append({"label": f"{allocator} plan", "color": figures.allocator_style(allocator)[1], "shape": "dot"})
    return items


def release_of(front: list[dict], front_id: str, payload) -> dict | None:
    """The front row a release names, or None when it is stale or malformed.

    A release is honoured only for the front it was made on (the same table and
    constraints) and only if its row index and removed parameters agree with that row.
    """
    if not isinstance(payload, dict) or payload.get("front_id") != front_id:
        return None
    index = payload.get("row")
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(front):
        return None
    row = front[index]
    if payload.get("removed") != int(row["removed"]):
        return None
    return row


def _remember(component_key: str) -> None:
    value = (st.session_state.get(component_key) or {}).get("release")
    if isinstance(value, list):  # several releases in one message: the latest counts
        value = value[-1] if value else None
    if value is not None:
        st.session_state[RELEASE_KEY] = value


def _remember_release() -> None:
    _remember(CHART_KEY)


def _remember_kept_release() -> None:
    entry = (st.session_state.get(KEEPER_KEY) or {}).get("unsaved")
    if isinstance(entry, dict):
        st.session_state[RELEASE_KEY] = entry
        st.session_state[KEPT_KEY] = entry.get("id")


def unsent_release() -> dict | None:
    """A step the keeper reports in this very run and has not handed over yet (its callback runs
    after a button's in the same run), for the session's front; else None.

    Prune & evaluate refuses to start while one is on its way: the page on screen was drawn
    before the budget the slider showed reached the session.
    """
    entry = (st.session_state.get(KEEPER_KEY) or {}).get("unsaved")
    table = current_table()
    if not isinstance(entry, dict) or table is None or entry.get("id") == st.session_state.get(KEPT_KEY):
        return None
    raw = st.session_state.get("app_constraints") or SHARED_DEFAULTS["app_constraints"]
    return entry if entry.get("front_id") == front_id_of(table, raw) else None


def front_id_of(table, raw_constraints: dict) -> str:
    """Names the front of one table under one set of planner constraints and the compensation it
    is charged for (a release echoes it)."""
    return table.key + "|" + constraints_json(raw_constraints) + "|" + (plan_compensation(table) or "none")


def apply_pending_release() -> dict | None:
    """Make the chart's pending release the app's budget and plan; returns its front row (or None).

    Called by app.py on every run before any page draws, so whichever page the rerun shows
    (the planner, or the page the user switched to right after the keys stopped) shows the
    released plan. The budget and the plan change together, with no Streamlit call between
    them: a rerun interrupted at its next Streamlit call never leaves one without the other.
    A release made for another table or other constraints than the session's is dropped.
    """
    ss = st.session_state
    payload = ss.pop(RELEASE_KEY, None)
    table = current_table()
    if payload is None or table is None:
        return None
    raw = ss.get("app_constraints") or SHARED_DEFAULTS["app_constraints"]
    try:
        rows = session_front(table, raw)
        row = release_of(rows, front_id_of(table, raw), payload)
        if row is None:
            return None
        plan = row_plan(shared_model(table.model), table, row, plan_compensation(table))  # the planner's model: no spinner
    except GapError as exc:
        ss["app_plan"], ss["app_plan_hash"] = None, None
        ss["app_plan_missing"] = f"The released budget has no plan: {one_line(exc)}"
        return None
    ss["app_budget"] = float(row["budget"])
    release_plan(plan, raw)
    return row


# Mounted by app.py on every page but the planner: the step the budget chart showed and did not
# get to the server (the user left the planner before the keys were sent, or while the release
# was lost) is in the tab's sessionStorage (budget_chart.js, with an id per step chosen); when it
# belongs to the session's front and is not the session's budget, it is handed over here. As a
# state, not a trigger: every later message of the tab carries it, so a click that races it
# finds it (`unsent_release`) and waits instead of pruning the plan drawn before it.
KEEPER_JS = """
const UNSAVED = "gap-budget-unsaved";
export default function ({ data, setStateValue }) {
  let unsaved = null;
  try {
    unsaved = JSON.parse(window.sessionStorage.getItem(UNSAVED) || "null");
  } catch (error) {
    return;
  }
  if (!unsaved) return;
  if (unsaved.front_id !== data.front_id || unsaved.budget === data.budget) {
    window.sessionStorage.removeItem(UNSAVED); // another table or constraints, or saved
    return;
  }
  if (unsaved.id !== data.kept) setStateValue("unsaved", unsaved);
}
"""


@lru_cache(maxsize=1)
def _keeper_component():
    return st.components.v2.component("gap_budget_keeper", js=KEEPER_JS)


def keep_unsaved_release() -> None:
    """Mount the keeper (see KEEPER_JS) with the session's front and budget; app.py calls it on
    every page but the planner, where the chart itself sends what it shows."""
    table = current_table()
    if table is None:
        return
    raw = st.session_state.get("app_constraints") or SHARED_DEFAULTS["app_constraints"]
    data = {"front_id": front_id_of(table, raw), "budget": float(st.session_state["app_budget"]), "kept": st.session_state.get(KEPT_KEY)}
    with st.sidebar:
        _keeper_component()(key=KEEPER_KEY, data=data, on_unsaved_change=_remember_kept_release)


def show(data: dict) -> None:
    """Mount the chart (plotly.js first); a release lands in `apply_pending_release` on the next run."""
    load_plotly()
    _chart_component()(key=CHART_KEY, data=data, on_release_change=_remember_release)
