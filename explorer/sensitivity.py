"""Sensitivity: how much each layer's loss grows with its pruning rate (the loss table, drawn)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import streamlit as st

from explorer.glossary import GLOSSARY
from explorer.table_state import table_page
from gap_engine.views import figures

DEFAULTS = {
    "sens_kinds": ["attn", "mlp"],
    "sens_log_y": True,  # one steep curve flattens the rest on a linear axis
    "sens_smoothed": True,
    "sens_log_color": False,
    "sens_layers": None,  # the layers whose curves are drawn; None: `figures.layers_to_compare`
}
table = table_page("sens_", DEFAULTS, "Sensitivity")
ss = st.session_state
kinds = [k for k in ("attn", "mlp", "block") if any(kind == k for _, kind in table.components)]
if not set(ss["sens_kinds"]) & set(kinds):
    ss["sens_kinds"] = kinds

cutting = table.removed > 0
n_measured = int(table.measured_cells()[cutting].sum())
st.caption(
    "How much worse the model gets when one part of one layer is pruned and everything else stays whole: "
    "a pale cell is a part the model barely misses, a dark one a part it needs. The planner spends its budget "
    "on the pale cells first.",
    help=GLOSSARY["nats/token"],
)
c1, c2, c3, c4 = st.columns([2, 1, 1, 1], vertical_alignment="bottom")
c1.multiselect("Components", kinds, key="sens_kinds", format_func=lambda k: figures.KIND_LABEL[k])
c2.radio("Y axis", (False, True), key="sens_log_y", format_func=lambda v: "log" if v else "linear", horizontal=True)
c3.toggle(
    "Smoothed", key="sens_smoothed", help="Isotonic (non-decreasing, non-negative) version of the measured rows; the planner uses it."
)
c4.toggle("Log colours", key="sens_log_color", help="Heatmap colour on a log10 scale")

# The heatmap leads: every layer and rate in one picture; curves only for a few layers, so they can be told apart.
st.plotly_chart(
    figures.heatmap_figure(table, smoothed=ss["sens_smoothed"], log_color=ss["sens_log_color"]),
    key="sens_heatmap",
    width="stretch",
    theme=None,
)
st.caption(
    f"Each cell: the increase of the {table.spec.objective} objective when only that component is pruned at that rate "
    f"({table.spec.estimator} table, dense objective {table.dense_objective:.4f}). "
    f"{n_measured} of {int(cutting.sum())} cells are measured exactly"
    + (" (ringed on the heatmap)" if 0 < n_measured < int(cutting.sum()) else "")
    + "; the others are estimated from one gradient pass."
)
st.subheader("Compare a few layers")
if ss.get("sens_layers") is None or not set(ss["sens_layers"]) <= set(range(table.num_layers)):
    ss["sens_layers"] = figures.layers_to_compare(table, ss["sens_smoothed"])
st.multiselect(
    "Layers",
    list(range(table.num_layers)),
    key="sens_layers",
    format_func=lambda layer: f"layer {layer}",
    help="Starts with the two most and the two least sensitive layers at the middle rate; add or remove any.",
)
shown = ss["sens_kinds"] or kinds
if ss["sens_layers"]:
    st.plotly_chart(
        figures.sensitivity_figure(table, shown, log_y=ss["sens_log_y"], smoothed=ss["sens_smoothed"], layers=ss["sens_layers"]),
        key="sens_curves",
        width="stretch",
        theme=None,  # the figure's own template and colours, as in its HTML/PNG export
    )
else:
    st.caption("Pick layers above to see their loss against the pruning rate.")

with st.expander("Most and least sensitive components at the middle rate"):
    middle = len(table.rate_grid) // 2
    losses = table.losses(ss["sens_smoothed"])[:, middle]
    frame = pd.DataFrame(
        {
            "layer": [layer for layer, _ in table.components],
            "component": [figures.KIND_LABEL[kind] for _, kind in table.components],
            f"loss increase at rate {table.rate_grid[middle]:g}": losses,
            "removes": table.removed[:, middle],
        }
    ).sort_values(f"loss increase at rate {table.rate_grid[middle]:g}", ascending=False)
    st.dataframe(frame, hide_index=True, width="stretch", key="sens_ranking", placeholder="—")
    st.caption(f"Negative raw values are measurement noise: {int(np.sum(table.delta < 0))} cells of {table.delta.size}.")
