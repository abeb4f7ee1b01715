"""Tests of the refined loss table (``estimator="refine"``): the fisher estimate, measured
exactly where the DP's plans go, with per-cell bookkeeping that survives the cache.

Tiny two-layer models with real tokenised text; the full exact table and the fisher
estimate on the same windows are the references.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from gap_engine.core.config import WindowSpec
from gap_engine.core.errors import CancelledError, TableError
from gap_engine.core.progress import Hooks
from gap_engine.data.windows import calibration_windows, load_corpus
from gap_engine.pipeline.stages import loss_table
from gap_engine.plan.allocators import plan_from_table
from gap_engine.tables import cache
from gap_engine.tables.artefact import LossTable, TableSpec, table_key
from gap_engine.tables.build import measure_table
from gap_engine.tables.refine import chosen_cells, neighbour_cells

WINDOWS = WindowSpec("wiki-sample", n_samples=3, seq_len=24, batch_size=3)
GRID8 = tuple(i / 8 for i in range(8))
BUDGETS = (0.1, 0.2, 0.3, 0.4)


def spec(estimator: str, **kw) -> TableSpec:
    return TableSpec(**({"windows": WINDOWS, "rate_grid": GRID8, "objective": "kl", "refine_budgets": BUDGETS} | kw), estimator=estimator)


@pytest.fixture(scope="module")
def tiny(smol_tokenizer):
    from conftest import tiny_lm

    return tiny_lm("llama", smol_tokenizer, seed=1, initializer_range=0.2)


@pytest.fixture(scope="module")
def tables(tiny):
    windows = calibration_windows(tiny.tokenizer, WINDOWS)
    return {name: measure_table(tiny, spec(name), windows) for name in ("exact", "fisher", "refine")}


def chosen_of(plan, table: LossTable) -> set[tuple[int, int]]:
    """(component, rate index) of the cells a split-mode grid plan uses."""
    out = set()
    for c, (layer, kind) in enumerate(table.components):
        rate = (plan.attention_rates if kind == "attn" else plan.mlp_rates)[layer]
        out.add((c, int(np.argmin(np.abs(table.rate_grid - rate)))))
    return out


@pytest.mark.slow
def test_refined_cells_are_the_exact_ones_and_the_rest_the_estimate(tables):
    exact, fisher, refine = tables["exact"], tables["fisher"], tables["refine"]
    measured = refine.measured
    assert measured[:, 0].all() and 0 < measured[:, 1:].sum() < measured[:, 1:].size
    np.testing.assert_allclose(refine.delta[measured], exact.delta[measured], rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(refine.delta[~measured], fisher.delta[~measured], rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(refine.estimate, fisher.delta, rtol=1e-6, atol=1e-9)
    assert refine.extras["refined_cells"] < exact.extras["distinct_cells"] == refine.extras["distinct_cells"]
    assert refine.extras["refine_rounds"] >= 1
    assert (refine.cell_tokens == 3 * 24).all() and refine.window_start == "text"
    assert not fisher.measured[fisher.removed > 0].any() and exact.measured.all()


@pytest.mark.slow
def test_every_chosen_cell_of_the_refined_table_is_measured(tiny, tables):
    refine = tables["refine"]
    chosen = chosen_cells(refine.removed, refine.losses(), BUDGETS, refine.dense_prunable, rate_grid=refine.rate_grid)
    assert chosen and all(refine.measured[cell] for cell in chosen)
    for budget in BUDGETS:
        plan = plan_from_table(tiny, refine, budget)
        assert refine.basis(chosen_of(plan, refine)) == "measured"
    fisher_plan = plan_from_table(tiny, tables["fisher"], 0.3)
    assert tables["fisher"].basis(chosen_of(fisher_plan, tables["fisher"])) == "estimated"


@pytest.mark.slow
def test_refined_plan_equals_the_exact_plan_when_its_cells_are_measured(tiny, tables):
    exact, refine = tables["exact"], tables["refine"]
    compared = 0
    for budget in BUDGETS:
        exact_plan, refine_plan = plan_from_table(tiny, exact, budget), plan_from_table(tiny, refine, budget)
        cells = chosen_of(exact_plan, exact) | chosen_of(refine_plan, refine)
        # Both plans' cells measured (and smoothed alike): each plan is then optimal on a table
        # that agrees with the exact one on both, so the refined plan is the exact table's plan.
        same = [refine.measured[cell] and np.isclose(refine.losses()[cell], exact.losses()[cell], rtol=1e-6, atol=1e-9) for cell in cells]
        if not all(same):
            continue
        compared += 1
        assert refine_plan.predicted_loss == pytest.approx(exact_plan.predicted_loss, rel=1e-6, abs=1e-9)
        assert (refine_plan.attention_rates, refine_plan.mlp_rates) == (exact_plan.attention_rates, exact_plan.mlp_rates)
    assert compared >= 2, "the tiny model should give budgets where both plans rest on measured cells"


@pytest.mark.slow
def test_a_refined_table_that_measures_everything_is_the_exact_table(tiny, tables):
    windows = calibration_windows(tiny.tokenizer, WINDOWS)
    every = tuple(round(0.05 + 0.1 * i, 2) for i in range(9))  # plans from 5% to 85%: every row's rates are chosen or near
    full = measure_table(tiny, spec("refine", refine_attention="all", refine_neighbours=3, refine_budgets=every), windows)
    exact = tables["exact"]
    assert full.measured.all()
    np.testing.assert_allclose(full.delta, exact.delta, rtol=1e-6, atol=1e-9)
    for budget in BUDGETS:
        a, b = plan_from_table(tiny, full, budget), plan_from_table(tiny, exact, budget)
        assert (a.attention_rates, a.mlp_rates) == (b.attention_rates, b.mlp_rates)


def test_neighbours_step_over_rates_that_share_a_cut():
    owner = {(0, 0): None, (0, 1): None, (0, 2): (0, 2), (0, 3): (0, 2), (0, 4): (0, 4), (0, 5): (0, 5)}
    assert neighbour_cells({(0, 3)}, owner, 6, 1) == {(0, 2), (0, 4)}
    assert neighbour_cells({(0, 0)}, owner, 6, 1) == {(0, 2)}
    assert neighbour_cells({(0, 5)}, owner, 6, 2) == {(0, 2), (0, 4), (0, 5)}
    assert neighbour_cells({(0, 5)}, owner, 6, 0) == set()


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"refine_budgets": ()}, "non-empty"),
        ({"refine_budgets": (0.2, 1.0)}, "outside (0, 1)"),
        ({"refine_attention": "some"}, "refine_attention"),
        ({"refine_neighbours": 5}, "refine_neighbours"),
    ],
)
def test_refine_settings_are_checked(fields, message):
    with pytest.raises(TableError, match=message.replace("(", r"\(").replace(")", r"\)")):
        spec("refine", **fields).validate()


def test_refine_settings_enter_the_key_of_refined_tables_only(tiny):
    base = table_key(tiny, spec("refine"), "d")
    assert table_key(tiny, spec("refine", refine_budgets=(0.2,)), "d") != base
    assert table_key(tiny, spec("refine", refine_attention="all"), "d") != base
    assert table_key(tiny, spec("fisher", refine_budgets=(0.2,)), "d") == table_key(tiny, spec("fisher"), "d")
    assert "refine_budgets" not in spec("exact").summary() and spec("refine").summary()["refine_budgets"] == list(BUDGETS)
    assert TableSpec.from_dict(spec("refine").to_dict()) == spec("refine")


# ---- through the cache ---------------------------------------------------------------------------
@pytest.fixture
def tmp_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("GAP_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.mark.slow
def test_bookkeeping_survives_the_cache_and_a_second_build_is_a_hit(tmp_cache, tiny, tables):
    calls = []
    built = loss_table(tiny, spec("refine"), hooks=Hooks(progress=lambda *a: calls.append(a)))
    assert calls and calls[-1][0] == calls[-1][1]  # the last report is complete
    again = loss_table(tiny, spec("refine"), hooks=Hooks(progress=lambda *a: calls.append("hit")))
    assert "hit" not in calls
    stored = cache.get_table(built.key)
    for table in (again, stored):
        np.testing.assert_array_equal(table.measured, built.measured)
        np.testing.assert_array_equal(table.cell_tokens, built.cell_tokens)
        np.testing.assert_allclose(table.estimate, built.estimate)
        np.testing.assert_allclose(table.delta, tables["refine"].delta, rtol=1e-6, atol=1e-9)
        assert table.extras["refined_cells"] == built.extras["refined_cells"]
    csv_lines = built.to_csv().splitlines()
    assert any(line.endswith(",0,72") for line in csv_lines) and any(line.endswith(",1,72") for line in csv_lines)


@pytest.mark.slow
def test_cancel_then_resume_gives_the_uninterrupted_refined_table(tmp_cache, tiny, tables):
    event = threading.Event()

    def progress(done, total, eta):
        if total > 1 and done >= 3:  # the estimate is one batch here: past it, cells are counted
            event.set()

    with pytest.raises(CancelledError):
        loss_table(tiny, spec("refine"), hooks=Hooks(progress=progress, cancel=event))
    key = table_key(tiny, spec("refine"), load_corpus("wiki-sample").fingerprint)
    assert cache.get_table(key) is None and len(cache.PartialCells(key).load()) == 3
    resumed = loss_table(tiny, spec("refine"))
    assert resumed.extras["cells_resumed"] == 3
    assert resumed.extras["cells_resumed"] + resumed.extras["cells_measured"] == tables["refine"].extras["refined_cells"]
    np.testing.assert_array_equal(resumed.measured, tables["refine"].measured)
    np.testing.assert_allclose(resumed.delta, tables["refine"].delta, rtol=1e-6, atol=1e-9)


@pytest.mark.slow
def test_the_rounds_replayed_on_the_exact_table_choose_what_the_build_measured(tiny, tables):
    from gap_engine.prune.importance import compute_importance
    from gap_engine.tables.cells import distinct_cuts, unit_cuts
    from gap_engine.tables.refine import RefineProblem, refinement_rounds

    exact, refine = tables["exact"], tables["refine"]
    windows = calibration_windows(tiny.tokenizer, WINDOWS)
    scores = compute_importance(tiny, windows, exact.spec.criterion, 3)
    _, owner = distinct_cuts(unit_cuts(tiny, scores, exact.components, GRID8, 8))
    problem = RefineProblem(refine.estimate, owner, exact.removed, exact.dense_prunable, tuple(k for _, k in exact.components), 0.0)
    asked = []

    def measure(todo, measured):
        asked.append(list(todo))
        measured.update({cell: float(exact.cell_objective[cell]) for cell in todo})

    measured, rounds = refinement_rounds(problem, spec("refine"), measure)
    assert rounds == refine.extras["refine_rounds"] == len(asked) and len(measured) == refine.extras["refined_cells"]
    replayed = np.array([[owner[c, r] is None or owner[c, r] in measured for r in range(8)] for c in range(len(owner) // 8)])
    np.testing.assert_array_equal(replayed, refine.measured)
