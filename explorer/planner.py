"""Budget planner: one global budget, the DP's per-layer rates, and the baselines beside them.

The whole Pareto front is computed once per table and constraints and shipped to the
budget chart (explorer/budget_chart.py); its slider swaps the bars in the browser while the
pointer moves and, on release, sets the one budget every page uses (``app_budget``). The
plan below the chart is the released front row itself, so the numbers agree with it.
"""

from __future__ import annotations

import pandas as pd
import streamlit as st

from explorer import budget_chart, ownership
from explorer.glossary import GLOSSARY
from explorer.job_panel import job_controls
from explorer.messages import clear_message, set_message
from explorer.page_paths import EVALUATE_PAGE
from explorer.plan_state import constraints_from_state, plan_compensation, release_plan, session_front
from explorer.session_jobs import remember_job
from explorer.table_state import reference_model, table_page
from gap_engine.core.config import DEFAULT_MAX_RATE
from gap_engine.core.errors import GapError, one_line
from gap_engine.evaluate import history
from gap_engine.pipeline.jobs import baselines_task, manager
from gap_engine.plan.allocator_registry import ALLOCATORS, BASELINE_ALLOCATORS
from gap_engine.plan.front_view import baseline_budgets, front_row_at, row_plan
from gap_engine.prune.compensations import COMPENSATIONS
from gap_engine.views import figures

DEFAULTS = {
    "planner_table_key": None,
    "planner_locked": [],
    "planner_lock_rate": 0.0,
    "planner_max_rate": DEFAULT_MAX_RATE,
    "planner_coupled": False,
    "planner_baseline_allocators": ["uniform", "flap"],
}
table = table_page("planner_", DEFAULTS, "Budget planner")
ss = st.session_state
if ss["planner_table_key"] != table.key:  # a new table: its own locks, a budget it can reach
    ss["planner_table_key"] = table.key
    ss["planner_locked"] = [layer for layer in ss["planner_locked"] if layer < table.num_layers]
    grid = [float(r) for r in table.rate_grid]
    if ss["planner_lock_rate"] not in grid:
        ss["planner_lock_rate"] = 0.0
try:
    lm = reference_model(table.model)
    table.check_model(lm)
except GapError as exc:
    st.error(f"Cannot plan with this table: {one_line(exc)}")
    st.stop()

c1, c2 = st.columns([3, 2], vertical_alignment="bottom")
c1.caption(
    "Drag the budget slider: the per-layer rates chosen by GAP's exact DP follow the pointer, and releasing it sets "
    "the budget that Prune & evaluate and Export use. The dashed green line is uniform pruning at the same budget.",
    help=f"{GLOSSARY['DP front']}\n\n{GLOSSARY['prunable']}",
)
c2.selectbox(
    "Compensation after the cut",
    list(COMPENSATIONS),
    key="app_compensation",
    help=GLOSSARY["compensation"] + "\n\n" + COMPENSATIONS.help(),
)

with st.expander("Constraints", expanded=bool(ss["planner_locked"])):
    c1, c2 = st.columns([3, 1], vertical_alignment="bottom")
    c1.multiselect(
        "Lock layers",
        list(range(table.num_layers)),
        key="planner_locked",
        format_func=lambda layer: f"layer {layer}",
        help="Locked layers keep the rate on the right; the front is recomputed.",
    )
    c2.selectbox("at rate", [float(r) for r in table.rate_grid], key="planner_lock_rate", format_func=lambda r: f"{r:g}")
    c1, c2 = st.columns([1, 3], vertical_alignment="bottom")
    c1.number_input("Max rate", min_value=0.05, max_value=DEFAULT_MAX_RATE, step=0.05, key="planner_max_rate")
    c2.toggle("Couple attention and MLP", key="planner_coupled", help="One rate per layer for both components")

raw_constraints = {
    "locked": {str(layer): float(ss["planner_lock_rate"]) for layer in sorted(ss["planner_locked"])},
    "max_rate": float(ss["planner_max_rate"]),
    "coupled": bool(ss["planner_coupled"]),
}
ss["app_constraints"] = raw_constraints
constraints = constraints_from_state()
try:
    rows = session_front(table, raw_constraints)
except GapError as exc:
    st.error(one_line(exc))
    st.stop()
if not rows:
    st.error("No plan satisfies these constraints.")
    st.stop()

front_id = budget_chart.front_id_of(table, raw_constraints)

top_pct, low_pct = rows[-1]["budget"] * 100, rows[0]["budget"] * 100
if top_pct - low_pct < 0.5:
    st.warning(
        f"Under these constraints every plan removes {low_pct:.1f}% to {top_pct:.1f}% of the prunable parameters: "
        "unlock layers or raise the max rate to open the budget range."
    )

stored = ss.get("app_baselines")
baselines = stored["rows"] if stored and stored.get("key", "").startswith(front_id + "|") else None


def bias_line(plan) -> str:
    """What the compensation adds and who pays for it, in one line under the readouts."""
    params = plan.params
    mode = ss["app_compensation"]
    if not params.get("bias_params"):
        return (
            f"Compensation `{mode}` adds no parameters: the pruned model has {params['pruned_total']:,}, "
            "the number Prune & evaluate, the report and the model card show."
        )
    return (
        f"Compensation `{mode}` adds {params['bias_params']:,} bias parameters (one on each o_proj and down_proj that loses "
        f"inputs), paid from the budget: the cut removes {params['removed']:,}, the plan {plan.budget:.2%} of the prunable "
        f"parameters net, and the pruned model has {params['pruned_total_with_biases']:,}, the number Prune & evaluate, "
        "the report and the model card show."
    )


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


uniform = budget_chart.uniform_rows(table, lm, raw_constraints, rows[-1]["budget"], baselines)
data = budget_chart.chart_data(
    table,
    rows,
    float(ss["app_budget"]),
    front_id,
    dense_total=lm.param_count(),
    locked={int(k): v for k, v in raw_constraints["locked"].items()},
    uniform=uniform,
    baselines=baselines,
    measured=measured_runs(),
    shares=budget_chart.rate_shares(table, lm),
)
row = rows[data["rows"][data["active"]]]
try:
    plan = row_plan(lm, table, row, plan_compensation(table))
except GapError as exc:
    plan_error = one_line(exc)
    ss["app_budget"], ss["app_plan"], ss["app_plan_hash"] = float(row["budget"]), None, None
else:
    plan_error = None
    # The budget every page uses is this row's own, set with its plan before the next Streamlit
    # call: a rerun interrupted there never leaves the budget of one row beside the plan of another.
    ss["app_budget"] = float(row["budget"])
    release_plan(plan, raw_constraints)
budget_chart.show(data)

if plan_error is not None:
    st.error(plan_error)
else:
    params = plan.params
    objective = figures.loss_label(table.spec.objective)
    biases = int(params.get("bias_params", 0))
    left = int(params.get("pruned_total_with_biases", params["pruned_total"]))
    # The two counts carry the longest captions, the size the shortest: equal columns cut the captions at 1366 px.
    c1, c2, c3, c4 = st.columns([5, 5, 3, 4])
    c1.metric(
        "Removed parameters",
        f"{params['removed']:,}",
        f"{plan.budget:.2%} of prunable{' net' if biases else ''} · {(params['dense_total'] - left) / params['dense_total']:.2%} of all",
        delta_color="off",
        delta_arrow="off",
        help=GLOSSARY["prunable"],
    )
    c2.metric(
        "Parameters left",
        f"{left:,}",
        f"of {params['dense_total']:,}" + (f" · {biases:,} biases added" if biases else ""),
        delta_color="off",
        delta_arrow="off",
        help="What the pruned model has, the biases its compensation adds included: Prune & evaluate, the report and the "
        "checkpoint's model card show this same number.",
    )
    c3.metric("Size (fp32)", f"{left * figures.BYTES_PER_PARAM / 2**20:.0f} MiB")
    basis = figures.row_basis(table, row)
    c4.metric(
        f"Predicted {figures.OBJECTIVE_NAME.get(table.spec.objective, table.spec.objective)} increase",  # nats/token: in the help
        f"{plan.predicted_loss:+.4f}",
        figures.BASIS_TEXT[basis],
        delta_color="off",
        delta_arrow="off",
        help=f"{objective}: the table's single-component increases added up; components interact, so the measured increase "
        "(Prune & evaluate) is usually larger. Measured runs of this table appear as x marks on the loss panel.\n\n"
        + GLOSSARY["nats/token"]
        + "\n\n"
        + GLOSSARY["DP front"],
    )
    st.caption(bias_line(plan))
    st.caption(
        f"Plan `{ss['app_plan_hash']}` (its content hash): Prune & evaluate prunes this very plan, and the run, "
        "the checkpoint and every export carry the same hash and budget.",
        help=GLOSSARY["plan hash"],
    )
    with st.expander("Per-layer rates of this plan"):
        shares = budget_chart.row_shares(budget_chart.rate_shares(table, lm), table, row)
        st.dataframe(
            pd.DataFrame(
                {
                    "layer": range(table.num_layers),
                    "attention rate asked": plan.attention_rates,
                    "attention removed": shares.attention,
                    "attention kept": [text.split(":")[0].removeprefix("attention keeps ") for text in shares.attention_text],
                    "MLP rate asked": plan.mlp_rates,
                    "MLP removed": shares.mlp,
                }
            ),
            hide_index=True,
            width="stretch",
            key="planner_rates_table",
            column_config={
                "attention removed": st.column_config.NumberColumn(format="percent"),
                "MLP removed": st.column_config.NumberColumn(format="percent"),
            },
        )
    st.page_link(EVALUATE_PAGE, label="Prune & evaluate this plan", icon=":material/science:")

st.subheader("Baseline allocations")
st.caption(
    "The exact plans of the baselines at a few budgets, scored by the same table (markers on the right panel). "
    "FLAP and OWL read the model's activations, so this runs in the background."
)
c1, c2 = st.columns([3, 1], vertical_alignment="bottom")
c1.multiselect(
    "Allocators",
    BASELINE_ALLOCATORS.names,
    key="planner_baseline_allocators",
    help="; ".join(ALLOCATORS.label(name) for name in BASELINE_ALLOCATORS),
)


def start_baselines() -> None:
    allocators = list(ss["planner_baseline_allocators"])
    if not allocators:
        set_message("planner", "warning", "Pick at least one baseline allocator.")
        return
    job = manager().submit(
        "baselines",
        baselines_task(table.model, table, baseline_budgets(rows[-1]["budget"]), allocators, constraints, plan_compensation(table)),
        key=front_id + "|" + ",".join(allocators),
        label="baseline plans",
        owner=ownership.owner(),
    )
    remember_job("baselines", job)
    clear_message("planner")


job_controls(
    "baselines",
    "Compute baselines",
    "planner_compute_baselines",
    start_baselines,
    ":material/calculate:",
    "Baseline plans",
    "planner",
    where=c2,
)
if baselines:
    records = []
    for r in baselines:
        dp_row = front_row_at(rows, r.budget)
        records.append(
            {
                "allocator": r.allocator,
                "budget": f"{r.budget:.2%}",  # budgets are percentages everywhere, with two decimals
                "removed (of prunable)": None if r.removed_fraction is None else f"{r.removed_fraction:.2%}",
                "predicted loss": r.predicted_loss,
                "GAP DP at that budget": None if dp_row is None else dp_row["predicted_loss"],
                "note": r.error or "",
            }
        )
    st.dataframe(pd.DataFrame(records), hide_index=True, width="stretch", key="planner_baselines_table", placeholder="—")
