"""Files read for meaning, not only for types: numbers that no build produces, counts
that contradict each other, strict JSON out, inputs that would be silently dropped.

No model is loaded: tables and plans are written by hand from a valid two-layer table (rates 0
and 0.5, 61,440 prunable parameters: the tiny Llama's geometry) and changed one thing at a time.
"""

from __future__ import annotations

import copy
import json
import math

import numpy as np
import pytest

from gap_engine.core.config import WindowSpec
from gap_engine.core.errors import DataError, PlanError, TableError
from gap_engine.core.jsontext import json_text
from gap_engine.core.memory import parse_max_memory
from gap_engine.core.validate_meaning import check_kept_fits, check_plan_params
from gap_engine.model.rateplan import RatePlan
from gap_engine.plan.front_view import plan_figures
from gap_engine.tables.artefact import LossTable, TableSpec, isotonic_smooth


def table_dict() -> dict:
    """A table a build could have written: deltas are cells over dense, smoothed is their smoothing."""
    spec = TableSpec(windows=WindowSpec("news-sample", n_samples=2, seq_len=16), estimator="taylor", objective="nll", rate_grid=(0.0, 0.5))
    delta = [[0.0, 0.25], [0.0, 0.5], [0.0, -0.125], [0.0, 0.375]]
    return {
        "format_version": 2,
        "key": "tiny-nll-split-taylor-0123456789abcdef0123",
        "model": "tiny-llama",
        "model_fingerprint": "0123456789abcdef",
        "num_layers": 2,
        "spec": spec.to_dict(),
        "data_fingerprint": "f" * 64,
        "components": [[0, "attn"], [0, "mlp"], [1, "attn"], [1, "mlp"]],
        "rate_grid": [0.0, 0.5],
        "dense_objective": 3.5,
        "dense_prunable": 61_440,
        "build_seconds": 1.0,
        "delta": delta,
        "smoothed": isotonic_smooth(np.array(delta)).tolist(),
        "cell_objective": [[3.5 + d for d in row] for row in delta],
        "removed": [[0, 6_144], [0, 9_216], [0, 6_144], [0, 9_216]],
        "extras": {},
        "window_start": "text",
        "measured": [[True, False]] * 4,
        "cell_tokens": None,
        "estimate": None,
    }


def changed(change) -> str:
    data = copy.deepcopy(table_dict())
    change(data)
    return json.dumps(data)


def test_the_valid_table_reads():
    table = LossTable.from_json(json.dumps(table_dict()))
    assert table.removed[:, 1].tolist() == [6_144, 9_216, 6_144, 9_216]


def _three_rates(d: dict) -> None:
    """Rates 0, 0.25, 0.5 with removals that shrink from 0.25 to 0.5."""
    d["rate_grid"] = d["spec"]["rate_grid"] = [0.0, 0.25, 0.5]
    d["removed"] = [[0, 4_000, 2_000]] * 4
    d["delta"] = d["smoothed"] = [[0.0, 0.1, 0.2]] * 4
    d["cell_objective"] = [[3.5, 3.6, 3.7]] * 4
    d["measured"] = [[True, False, False]] * 4


TABLE_LIES = {
    "removes-at-rate-0": (lambda d: d["removed"].__setitem__(0, [100, 6_144]), "removes 100 parameters at rate 0"),
    "removal-shrinks": (_three_rates, "fewer than 4,000 at rate 0.25"),
    "removes-everything": (lambda d: d.update(removed=[[0, 61_440]] * 4), "not less than the model's 61,440"),
    "delta-minus-1e300": (lambda d: d.update(delta=[[0.0, -1e300]] * 4, smoothed=None), "no loss is that far"),
    "loss-minus-1e300": (lambda d: d.update(cell_objective=[[3.5, -1e300]] * 4), "no loss is that far"),
    "delta-not-its-cell": (lambda d: d["delta"].__setitem__(0, [0.0, 2.0]), "minus the dense"),
    "smoothed-not-smoothing": (lambda d: d["smoothed"].__setitem__(3, [0.0, 0.0]), "smoothing its delta row"),
    "measured-negative-loss": (
        lambda d: d.update(cell_objective=[[3.5, -0.5]] * 4, delta=[[0.0, -4.0]] * 4, smoothed=None, measured=[[True, True]] * 4),
        "never negative",
    ),
    "dense-negative": (lambda d: d.update(dense_objective=-1.0), "is not a loss"),
    "delta-at-rate-0": (lambda d: d["delta"].__setitem__(1, [0.5, 0.5]), "changes the loss at rate 0"),
}


@pytest.mark.parametrize("name", list(TABLE_LIES))
def test_a_table_no_build_produces_is_refused(name):
    change, message = TABLE_LIES[name]
    with pytest.raises(TableError, match=message):
        LossTable.from_json(changed(change))


def test_a_cache_meta_spec_is_held_to_a_tables_rules():
    from gap_engine.core.errors import CacheError
    from gap_engine.core.validate import check_cache_meta

    meta = {"key": "k", "table_sha256": "0" * 64, "spec": {"rate_grid": [0.0, 0.5]}}
    check_cache_meta(meta, "k")
    for bad in (5, None, ["x"], [0.0, 2.0]):
        with pytest.raises(CacheError, match="rate_grid"):
            check_cache_meta(meta | {"spec": {"rate_grid": bad}}, "k")


# ---- plans --------------------------------------------------------------------------------------
def plan(**changes) -> RatePlan:
    data = {
        "model": "tiny-llama",
        "num_layers": 2,
        "criterion": "magnitude",
        "attention_rates": [0.5, 0.5],
        "mlp_rates": [0.5, 0.5],
        "allocator": "manual",
        "budget": 0.5,
    }
    return RatePlan.from_dict(data | changes)


@pytest.mark.parametrize(
    "params, message",
    [
        ({"removed": 1e300}, "removed = 1e\\+300 is not a parameter count"),
        ({"removed": -20_000}, "removed = -20000 is not a parameter count"),
        ({"removed": 0.5}, "not a parameter count"),
        ({"removed": 70_000, "dense_prunable": 61_440}, "more than its dense_prunable"),
        ({"removed": 100, "dense_prunable": 61_440, "pruned_prunable": 5}, "pruned_prunable 5 is not"),
        ({"removed": 100, "dense_prunable": 1_000, "removed_fraction_of_prunable": 0.5}, "is not removed / dense_prunable"),
        ({"removed_fraction_of_prunable": -0.5}, "outside \\[0, 1\\)"),
    ],
)
def test_plan_counts_that_contradict_each_other_are_refused(params, message):
    with pytest.raises(PlanError, match=message):
        plan(params=params)


def test_a_made_plans_counts_agree():
    params = {"dense_total": 6_353_216, "dense_prunable": 61_440, "pruned_prunable": 30_720, "pruned_total": 6_322_496, "removed": 30_720}
    params |= {"removed_fraction_of_prunable": 0.5, "removed_fraction_of_total": 30_720 / 6_353_216}
    check_plan_params(params, PlanError)


def test_a_reported_plan_is_counted_from_the_table_cells():
    table = LossTable.from_json(json.dumps(table_dict()))
    figures = plan_figures(table, plan())  # no counts of its own: on the grid, the cells say
    assert figures["removed"] == 30_720 and figures["budget"] == 0.5
    assert figures["predicted_loss"] == pytest.approx(0.25 + 0.5 + 0.0 + 0.375)  # smoothed cells
    assert plan_figures(table, plan(predicted_loss=1.0))["predicted_loss"] == 1.0  # the raw cells' sum: checked, shown


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"params": {"removed": 0}, "budget": 0.01}, "says it removes 0 parameters, but its rates remove 30,720"),
        ({"predicted_loss": -5.0}, "predicts a loss increase of -5"),
        ({"attention_rates": [0.3, 0.3], "params": {"removed": 50_000}}, "remove 18,432 to 30,720"),
        ({"params": {"removed": 30_720, "dense_prunable": 99_999}}, "counts 99,999 prunable"),
    ],
)
def test_a_plans_own_numbers_that_contradict_its_rates_are_refused(changes, message):
    table = LossTable.from_json(json.dumps(table_dict()))
    with pytest.raises(PlanError, match=message):
        plan_figures(table, plan(**changes))


def test_an_off_grid_plans_recorded_count_is_shown_when_the_cells_allow_it():
    table = LossTable.from_json(json.dumps(table_dict()))
    figures = plan_figures(table, plan(attention_rates=[0.3, 0.3], params={"removed": 24_000}, predicted_loss=1.0))
    assert figures["removed"] == 24_000 and figures["predicted_loss"] == 1.0
    unknown = plan_figures(table, plan(attention_rates=[0.3, 0.3]))  # no count of its own: only the range is known
    assert unknown["removed"] is None and unknown["removed_range"] == (18_432, 30_720) and unknown["predicted_loss"] is None


# ---- checkpoints -----------------------------------------------------------------------------------
WIDTHS = [{"num_attention_heads": 2, "num_key_value_heads": 1, "intermediate_size": 3}] * 2
DENSE = {"num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 8}
KEPT = {"kept_kv_heads": [[0], [1]], "kept_heads": [[0, 1], [2, 3]], "kept_channels": [[0, 1, 2], [5, 6, 7]]}


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda k: k["kept_heads"].__setitem__(0, [0, 99]), "names unit 99, but the dense model has 4"),
        (lambda k: k["kept_channels"].__setitem__(1, list(range(2))), "lists 2 units, but config.json keeps 3"),
        (lambda k: [k[key].append(k[key][0]) for key in KEPT], "lists 3 blocks, but config.json has 2"),
    ],
)
def test_kept_indices_that_disagree_with_the_config_are_refused(change, message):
    check_kept_fits(KEPT, WIDTHS, DENSE, "ck", DataError)
    kept = copy.deepcopy(KEPT)
    change(kept)
    with pytest.raises(DataError, match=message):
        check_kept_fits(kept, WIDTHS, DENSE, "ck", DataError)


# ---- what we write, what we read ---------------------------------------------------------------------
def strict(text: str):
    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


def test_json_we_write_is_strict_and_says_no_number_as_null():
    data = {"curve": [{"step": 1, "loss": math.nan}, {"step": 2, "loss": 2.5}], "probe": (math.inf, -math.inf)}
    assert strict(json_text(data)) == {"curve": [{"step": 1, "loss": None}, {"step": 2, "loss": 2.5}], "probe": [None, None]}
    with pytest.raises(TypeError):  # anything else json cannot encode still fails loudly
        json_text({"x": object()})


@pytest.mark.parametrize(
    "text, message",
    [("cpu=1GB,cpu=2GB", "names cpu twice"), ("cuda=1GB,cuda:0=2GB", "names cuda:0 twice"), ("cuda:²=1GB", "is not cuda or cuda:N")],
)
def test_max_memory_refuses_a_device_named_twice(text, message):
    with pytest.raises(DataError, match=message):
        parse_max_memory(text, DataError)
    assert parse_max_memory("cuda:0=70GiB,cpu=200GiB", DataError) == {0: "70GiB", "cpu": "200GiB"}
