"""Tables that know compensation follows: cells measured with the cut block compensated.

An exact cell with compensation is the loss of what surgery with that compensation ships
(checked against ``prune_compensated`` of a one-component plan); such tables are keyed apart;
the estimators that measure no cell refuse it and say so in their metadata.
"""

from __future__ import annotations

import pytest
import torch

from gap_engine.core.config import WindowSpec
from gap_engine.core.device import Placement
from gap_engine.core.errors import TableError
from gap_engine.data.windows import calibration_windows, load_corpus
from gap_engine.model.loading import place_model
from gap_engine.model.rateplan import make_plan
from gap_engine.pipeline.stages import loss_table, objective_increase
from gap_engine.prune.compensation_pass import prune_compensated
from gap_engine.prune.compensations import CompensationSettings
from gap_engine.prune.importance import compute_importance
from gap_engine.tables.artefact import TableSpec, table_key
from gap_engine.tables.build import measure_table

GRID = (0.0, 0.25, 0.5, 0.75)
HALF = (0.0, 0.5)  # one cell per component: the tests that measure tables stay cheap
WINDOWS = WindowSpec(n_samples=4, seq_len=48, batch_size=2)  # 192 tokens: more than any kept width of the tiny model


def _spec(**fields) -> TableSpec:
    return TableSpec(**({"windows": WINDOWS, "rate_grid": GRID, "objective": "kl", "estimator": "exact"} | fields)).validate()


@pytest.fixture
def tiny(make_tiny):
    return make_tiny("llama", num_attention_heads=8, num_key_value_heads=2, intermediate_size=64)


def test_compensated_tables_are_keyed_apart(tiny):
    data = load_corpus(WINDOWS.data).fingerprint
    keys = {mode: table_key(tiny, _spec(compensation=mode), data) for mode in ("none", "bias", "refit", "bias+refit")}
    assert len(set(keys.values())) == 4
    assert keys["refit"].startswith("tiny-llama-kl-split-exact.refit-") and keys["bias+refit"].startswith(
        "tiny-llama-kl-split-exact.bias_refit-"
    )
    assert "compensation" not in _spec().summary()  # an uncompensated table keeps the key it always had
    assert _spec(compensation="refit").summary()["compensation"] == "refit"
    assert TableSpec.from_dict(_spec(compensation="bias").to_dict()).compensation == "bias"


@pytest.mark.parametrize("estimator", ["fisher", "taylor"])
def test_an_estimate_cannot_include_compensation(estimator):
    with pytest.raises(TableError, match=f"the {estimator} estimate measures no cell.*use the exact or refine estimator"):
        TableSpec(windows=WINDOWS, rate_grid=GRID, objective="nll", estimator=estimator, compensation="refit").validate()


@pytest.mark.parametrize("mode", ["bias", "refit"])
@pytest.mark.slow
def test_a_compensated_cell_is_the_loss_of_what_surgery_ships(tiny, mode):
    spec = _spec(compensation=mode, rate_grid=HALF)
    windows = calibration_windows(tiny.tokenizer, WINDOWS)
    table = measure_table(tiny, spec, windows)
    plain = measure_table(tiny, _spec(rate_grid=HALF), windows)
    assert table.extras["compensation"] == mode and "compensation" not in plain.extras
    scores = compute_importance(tiny, windows, spec.criterion, WINDOWS.batch_size)
    for row, (layer, kind) in enumerate(table.components):
        if (layer, kind) not in ((0, "mlp"), (1, "attn")):
            continue
        attention = [0.5 if (i == layer and kind == "attn") else 0.0 for i in range(2)]
        mlp = [0.5 if (i == layer and kind == "mlp") else 0.0 for i in range(2)]
        pruned = tiny.copy()
        prune_compensated(pruned, make_plan(tiny, attention, mlp, spec.criterion), scores, WINDOWS, CompensationSettings(mode=mode))
        shipped = objective_increase(pruned, tiny, windows, "kl", WINDOWS.batch_size)
        assert table.delta[row, 1] == pytest.approx(shipped, rel=1e-4, abs=1e-7), (layer, kind)
        assert table.delta[row, 1] != pytest.approx(plain.delta[row, 1], rel=1e-3)  # compensation changed the cell


@pytest.mark.slow
def test_a_streamed_compensated_table_equals_the_resident_one(tiny):
    streamed = place_model(tiny.copy(), Placement(device=torch.device("cpu"), dtype=torch.float32, stream=True))
    spec = _spec(compensation="bias+refit", rate_grid=HALF)
    windows = calibration_windows(tiny.tokenizer, WINDOWS)
    expected, got = measure_table(tiny, spec, windows), measure_table(streamed, spec, windows)
    assert (got.cell_objective == expected.cell_objective).all()


@pytest.mark.slow
def test_refine_measures_its_cells_compensated_and_says_the_estimate_is_not(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("GAP_CACHE_DIR", str(tmp_path / "cache"))
    spec = TableSpec(windows=WINDOWS, rate_grid=HALF, objective="kl", estimator="refine", compensation="refit", refine_budgets=(0.2,))
    table = loss_table(tiny, spec.validate())
    assert table.extras["compensation"] == "refit" and table.extras["estimated_cells_compensation"] == "none"
    assert table.key.startswith("tiny-llama-kl-split-refine.refit-") and table.measured_cells().any()
    fisher = loss_table(tiny, TableSpec(windows=WINDOWS, rate_grid=HALF, objective="kl", estimator="fisher"))
    assert "compensation" not in fisher.extras and fisher.extras["estimated_cells_compensation"] == "none"
