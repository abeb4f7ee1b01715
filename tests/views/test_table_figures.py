"""The loss table's figures on a small hand-made table (no model): every picked layer stays on the
log-axis comparison chart, its cells at or below 0 drawn on a floor that says so."""

from __future__ import annotations

import numpy as np

from gap_engine.core.config import WindowSpec
from gap_engine.tables.artefact import LossTable, TableSpec
from gap_engine.views import figures

GRID = (0.0, 0.25, 0.5, 0.75)


def small_table() -> LossTable:
    """Three layers (attention and MLP each): layer 0 sensitive, layer 1 not at all (every cell 0),
    layer 2 with a negative (noise) cell at 0.25 in its MLP."""
    components = [(layer, kind) for layer in range(3) for kind in ("attn", "mlp")]
    delta = np.array(
        [
            [0.0, 0.02, 0.3, 2.0],  # layer 0 attention
            [0.0, 0.05, 0.4, 3.0],  # layer 0 MLP
            [0.0, 0.0, 0.0, 0.0],  # layer 1 attention: the model does not miss it
            [0.0, 0.0, 0.0, 0.0],  # layer 1 MLP
            [0.0, 0.004, 0.01, 0.08],  # layer 2 attention
            [0.0, -0.003, 0.006, 0.05],  # layer 2 MLP: noise below 0 at 0.25
        ]
    )
    removed = np.tile(np.array([0, 1000, 2000, 3000], dtype=np.int64), (len(components), 1))
    return LossTable(
        model="hand-made", model_fingerprint="0" * 16, num_layers=3,
        spec=TableSpec(windows=WindowSpec("news-sample", n_samples=2, seq_len=16), rate_grid=GRID),
        data_fingerprint="hand-made", components=components, rate_grid=np.asarray(GRID), delta=delta, removed=removed,
        dense_objective=3.0, cell_objective=3.0 + delta, smoothed=None, dense_prunable=36_000, build_seconds=0.0, key="hand-made",
    )  # fmt: skip


def test_every_picked_layer_stays_on_the_log_axis_with_its_zeros_on_a_floor():
    fig = figures.sensitivity_figure(small_table(), layers=[0, 1, 2], smoothed=False)
    lines = {(t.name, t.xaxis): t for t in fig.data}
    assert {name for name, _ in lines} == {"layer 0", "layer 1", "layer 2"}
    bottom, top = fig.layout.yaxis.range
    floor = fig.layout.yaxis.tickvals[0]
    assert fig.layout.yaxis.type == "log" and fig.layout.yaxis.ticktext[0] == "≤ 0"
    assert bottom < np.log10(floor) < np.log10(0.004)  # on the chart, under the smallest positive cell
    assert all(np.log10(floor) < np.log10(v) - 0.49 for v in fig.layout.yaxis.tickvals[1:])  # apart from the decade ticks
    for trace in fig.data:
        assert list(trace.x) == [0.25, 0.5, 0.75]  # every rate that removes something, rate 0 removes nothing
        assert all(bottom < np.log10(y) < top for y in trace.y)  # inside the axis: drawn
    layer1 = lines[("layer 1", "x")]
    assert list(layer1.y) == [floor] * 3
    assert all("≤ 0: drawn at the axis floor" in text for _, text in layer1.customdata)
    assert list(layer1.marker.symbol) == ["triangle-down-open"] * 3
    noisy = lines[("layer 2", "x2")]  # the MLP panel
    assert list(noisy.y) == [floor, 0.006, 0.05] and noisy.customdata[0][1].startswith("-0.003 (≤ 0")
    assert noisy.customdata[1][1] == "+0.006" and noisy.customdata[1][0] == 2000
    assert list(lines[("layer 0", "x")].y) == [0.02, 0.3, 2.0] and lines[("layer 0", "x")].marker.symbol is None


def test_without_zeros_the_axis_is_whole_decades_and_on_a_linear_axis_zeros_are_plain_points():
    fig = figures.sensitivity_figure(small_table(), layers=[0], smoothed=False)
    ticks = list(fig.layout.yaxis.tickvals)
    assert "≤ 0" not in fig.layout.yaxis.ticktext and all(np.isclose(np.log10(v), round(np.log10(v))) for v in ticks)
    linear = figures.sensitivity_figure(small_table(), layers=[1, 2], log_y=False, smoothed=False)
    assert linear.layout.yaxis.type in (None, "linear")
    assert [list(t.y) for t in linear.data if t.name == "layer 1"] == [[0.0] * 4, [0.0] * 4]
