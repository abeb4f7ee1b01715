"""Plotly figures of the loss table, the DP front, the plans and the run history.

Pure drawing: the engine's numbers in, a ``plotly.graph_objects.Figure`` out; no streamlit,
so the app, the exported HTML/PNG files and the stakeholder report (`report`) draw the
same pictures. Every figure names its template (``plotly_white``): inside a Streamlit
process the default template is Streamlit's, whose placeholder colours only its own
front end resolves, so a PNG or HTML export of an untemplated figure comes out black.
Colour scales are explicit lists for the same reason (no ``reversescale`` for a theme to
drop).

Losses are in nats per token (mean next-token NLL, or mean KL to the dense model).
"""

from gap_engine.views.figures.front_figures import (
    BASIS_TEXT,
    front_figure,
    front_traces,
    front_y_top,
    measured_traces,
    plan_figure,
    planner_figure,
    rate_traces,
    rates_figure,
    row_basis,
    step_readout,
)
from gap_engine.views.figures.run_figures import (
    curve_figure,
    history_figure,
    measured_frontier_figure,
    predicted_vs_actual_figure,
    runs_rates_figure,
)
from gap_engine.views.figures.style import (
    ATTN_COLOR,
    BYTES_PER_PARAM,
    CURRENT_COLOR,
    DEPTH_SCALE,
    DP_COLOR,
    HEAT_SCALE,
    KIND_LABEL,
    MLP_COLOR,
    OBJECTIVE_NAME,
    RUN_COLUMN_LABELS,
    SLIDER_STEPS,
    TEMPLATE,
    TEXT_COLOR,
    UNIFORM_COLOR,
    allocator_style,
    column_label,
    component_kinds,
    log_ticks,
    loss_label,
)
from gap_engine.views.figures.table_figures import cell_notes, heatmap_figure, layers_to_compare, sensitivity_figure

__all__ = [
    "ATTN_COLOR",
    "BASIS_TEXT",
    "BYTES_PER_PARAM",
    "CURRENT_COLOR",
    "DEPTH_SCALE",
    "DP_COLOR",
    "HEAT_SCALE",
    "KIND_LABEL",
    "MLP_COLOR",
    "OBJECTIVE_NAME",
    "RUN_COLUMN_LABELS",
    "SLIDER_STEPS",
    "TEMPLATE",
    "TEXT_COLOR",
    "UNIFORM_COLOR",
    "allocator_style",
    "cell_notes",
    "column_label",
    "component_kinds",
    "front_figure",
    "front_traces",
    "front_y_top",
    "heatmap_figure",
    "layers_to_compare",
    "curve_figure",
    "history_figure",
    "log_ticks",
    "loss_label",
    "measured_frontier_figure",
    "measured_traces",
    "plan_figure",
    "planner_figure",
    "predicted_vs_actual_figure",
    "rate_traces",
    "rates_figure",
    "row_basis",
    "runs_rates_figure",
    "sensitivity_figure",
    "step_readout",
]
