"""Budget planner: one global budget, the DP's per-layer rates, and the baselines beside them.

The whole Pareto front is computed once per table and constraints and shipped inside one
Plotly figure; its slider swaps the bars in the browser while the pointer moves. The
server-side slider below it picks the budget the next page prunes with.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import streamlit as st

from gap_engine import history
from gap_engine.allocate import plan_from_table
from gap_engine.allocate.front import baseline_budgets, front_row_at
from gap_engine.config import DEFAULT_BUDGET, DEFAULT_MAX_RATE
from gap_engine.errors import GapError, one_line
from gap_engine.jobs import baselines_task, manager
from pages import common, figures

BASELINE_ALLOCATORS = ("uniform", "flap", "owl")
DEFAULTS = {
    "planner_table_key": None,
    "planner_locked": [],
    "planner_lock_rate": 0.0,
    "planner_max_rate": DEFAULT_MAX_RATE,
    "planner_coupled": False,
    "planner_budget_pct": DEFAULT_BUDGET * 100,
    "planner_baseline_allocators": ["uniform", "flap"],
}
table = common.table_page("planner_", DEFAULTS, "Budget planner")
ss = st.session_state

if ss["planner_table_key"] != table.key:  # a new table: its own locks, a budget it can reach
    ss["planner_table_key"] = table.key
    ss["planner_locked"] = [layer for layer in ss["planner_locked"] if layer < table.num_layers]
    grid = [float(r) for r in table.rate_grid]
    if ss["planner_lock_rate"] not in grid:
        ss["planner_lock_rate"] = 0.0
try:
    lm = common.reference_model(table.model)
    table.check_model(lm)
except GapError as exc:
    st.error(f"Cannot plan with this table: {one_line(exc)}")
    st.stop()

st.caption(
    "Drag the budget slider inside the chart: the per-layer rates chosen by GAP's exact DP follow the pointer. "
    "The dashed green line is uniform pruning at the same budget; the right panel is the predicted loss of every budget."
)

with st.expander("Constraints", expanded=bool(ss["planner_locked"])):
    c1, c2, c3, c4 = st.columns([3, 1, 1, 1], vertical_alignment="bottom")
    c1.multiselect(
        "Lock layers", list(range(table.num_layers)), key="planner_locked", format_func=lambda layer: f"layer {layer}",
        help="Locked layers keep the rate on the right; the front is recomputed.",
    )
    c2.selectbox("at rate", [float(r) for r in table.rate_grid], key="planner_lock_rate", format_func=lambda r: f"{r:g}")
    c3.number_input("Max rate", min_value=0.05, max_value=DEFAULT_MAX_RATE, step=0.05, key="planner_max_rate")
    c4.toggle("Couple attn + MLP", key="planner_coupled", help="One rate per layer for both components")

raw_constraints = {
    "locked": {str(layer): float(ss["planner_lock_rate"]) for layer in sorted(ss["planner_locked"])},
    "max_rate": float(ss["planner_max_rate"]),
    "coupled": bool(ss["planner_coupled"]),
}
ss["app_constraints"] = raw_constraints
constraints = common.constraints_from_state()
try:
    rows = common.pareto_rows(table.key, common.constraints_json(raw_constraints), table)
except GapError as exc:
    st.error(one_line(exc))
    st.stop()
if not rows:
    st.error("No plan satisfies these constraints.")
    st.stop()

top_pct = float(np.floor(rows[-1]["budget"] * 1000) / 10)
low_pct = float(np.ceil(rows[0]["budget"] * 1000) / 10)
ss["planner_budget_pct"] = float(min(max(ss["planner_budget_pct"], low_pct), top_pct))

baseline_key = table.key + "|" + common.constraints_json(raw_constraints)
stored = ss.get("app_baselines")
baselines = stored["rows"] if stored and stored.get("key", "").startswith(baseline_key + "|") else None


def measured_runs() -> list[dict]:
    """Prune & evaluate runs of this table: where the predicted front meets measurement."""
    try:
        frame = history.list_runs()
    except GapError:
        return []
    if frame.empty:
        return []
    frame = frame[(frame["table_key"] == table.key) & frame["actual_loss"].notna() & frame["budget"].notna()]
    return frame[["id", "allocator", "budget", "predicted_loss", "actual_loss"]].to_dict("records")


fig = figures.planner_figure(
    table,
    rows,
    dense_total=lm.param_count(),
    active_budget=ss["planner_budget_pct"] / 100,
    locked={int(k): v for k, v in raw_constraints["locked"].items()},
    baselines=baselines,
    measured=measured_runs(),
)
# theme=None: Streamlit's theme rewrites the title on every redraw, which would fight the slider's title updates.
st.plotly_chart(fig, key="planner_chart", width="stretch", theme=None, config={"displaylogo": False})

st.subheader("Choose the budget to prune with")
st.caption("The slider in the chart is for exploring; this one picks the budget that Prune & evaluate and Export use.")
if top_pct - low_pct < 0.5:
    st.warning(
        f"Under these constraints every plan removes {low_pct:.1f}% to {top_pct:.1f}% of the prunable parameters: "
        "unlock layers or raise the max rate to open the budget range."
    )
else:
    st.slider(
        "Budget (% of prunable parameters removed)",
        min_value=low_pct,
        max_value=top_pct,
        step=0.5,
        key="planner_budget_pct",
        format="%.1f%%",
    )
budget = ss["planner_budget_pct"] / 100
ss["app_budget"] = budget
try:
    plan = plan_from_table(lm, table, budget, "dp", constraints)
except GapError as exc:
    ss["app_plan"] = None
    st.error(one_line(exc))
else:
    ss["app_plan"] = plan.to_dict()
    params = plan.params
    c1, c2, c3, c4 = st.columns(4)
    c1.metric("Removed", f"{params['removed'] / 1e6:.2f}M", f"{params['removed_fraction_of_total']:.1%} of all", delta_color="off", delta_arrow="off")
    c2.metric("Parameters left", f"{params['pruned_total'] / 1e6:.1f}M", f"of {params['dense_total'] / 1e6:.1f}M", delta_color="off", delta_arrow="off")
    c3.metric("Size (fp32)", f"{params['pruned_total'] * figures.BYTES_PER_PARAM / 2**20:.0f} MiB")
    basis = table.basis(table.cells_for(plan.attention_rates, plan.mlp_rates))
    c4.metric(
        f"Predicted {table.spec.objective} increase", f"{plan.predicted_loss:.4f}", figures.BASIS_TEXT[basis], delta_color="off", delta_arrow="off",
        help="The table's single-component increases added up; components interact, so the measured increase "
        "(Prune & evaluate) is usually larger. Measured runs of this table appear as x marks on the right panel.",
    )
    with st.expander("Per-layer rates of this plan"):
        st.dataframe(
            pd.DataFrame({"layer": range(table.num_layers), "attention rate": plan.attention_rates, "MLP rate": plan.mlp_rates}),
            hide_index=True,
            width="stretch",
            key="planner_rates_table",
        )
    st.page_link(common.EVALUATE_PAGE, label="Prune & evaluate this plan", icon=":material/science:")

st.subheader("Baseline allocations")
st.caption(
    "The exact plans of the baselines at a few budgets, scored by the same table (markers on the right panel). "
    "FLAP and OWL read the model's activations, so this runs in the background."
)
c1, c2 = st.columns([3, 1], vertical_alignment="bottom")
c1.multiselect("Allocators", BASELINE_ALLOCATORS, key="planner_baseline_allocators")


def start_baselines() -> None:
    allocators = list(ss["planner_baseline_allocators"])
    if not allocators:
        common.set_message("planner", "warning", "Pick at least one baseline allocator.")
        return
    job = manager().submit(
        "baselines",
        baselines_task(table.model, table, baseline_budgets(rows[-1]["budget"]), allocators, constraints),
        key=baseline_key + "|" + ",".join(allocators),
        label="baseline plans",
    )
    common.remember_job("baselines", job)
    common.clear_message("planner")


common.job_controls(
    "baselines", "Compute baselines", "planner_compute_baselines", start_baselines, ":material/calculate:", "Baseline plans", "planner", where=c2
)
if baselines:
    records = []
    for r in baselines:
        dp_row = front_row_at(rows, r["budget"])
        records.append(
            {
                "allocator": r["allocator"],
                "budget": f"{r['budget']:.0%}",
                "removed (of prunable)": r.get("removed_fraction"),
                "predicted loss": r.get("predicted_loss"),
                "GAP DP at that budget": None if dp_row is None else dp_row["predicted_loss"],
                "note": r.get("error", ""),
            }
        )
    frame = pd.DataFrame(records)
    st.dataframe(frame, hide_index=True, width="stretch", key="planner_baselines_table")
