"""Tests of gap_engine.plan (allocators, the DP front, baselines) and the plan/front/compare CLI, on synthetic loss tables.

A synthetic table has the real parameter counts of its model (from units) and smooth,
increasing made-up losses, so the planner's answer is known without measuring anything.
"""

import copy
import csv
import io
import json
import math
import threading

import numpy as np
import pytest
import torch
from reference import brute_force
from synthetic_tables import SMOL_GRID, TINY_GRID, WORDS, mlp_unit, synthetic_table  # noqa: F401

from gap_engine import cli
from gap_engine.cli.output import csv_text
from gap_engine.core.config import WindowSpec
from gap_engine.core.errors import BudgetError, CancelledError, PlanError, TableError
from gap_engine.core.knapsack import solve_budget
from gap_engine.core.progress import Hooks
from gap_engine.data.windows import calibration_windows
from gap_engine.evaluate.metrics import mean_nll
from gap_engine.model.rateplan import RatePlan
from gap_engine.model.storage import round_to_storage
from gap_engine.model.units import block_geometries
from gap_engine.pipeline.compare import Outcome, measure_plan, reference_numbers
from gap_engine.plan.allocators import ALLOCATORS, check_reach, plan_from_table
from gap_engine.plan.baselines import owl_offsets
from gap_engine.plan.evo import EvoSettings, evolve
from gap_engine.plan.front import dp_front, front_rows
from gap_engine.plan.problem import Constraints, planning_problem, predicted_loss
from gap_engine.plan.slimgpt import log_increase
from gap_engine.prune.importance import ImportanceScores, LayerScores, compute_importance, flap_standardised
from gap_engine.prune.surgery import apply_plan, masked_plan
from gap_engine.tables.artefact import TABLE_FORMAT_VERSION


@pytest.fixture
def tiny(make_tiny):
    return make_tiny("llama")


@pytest.fixture(scope="module")
def calib(tmp_path_factory) -> WindowSpec:
    """A small local text file (parsed in milliseconds, unlike the built-in corpora)."""
    rng = np.random.default_rng(0)
    paragraphs = [" ".join(rng.choice(WORDS, size=120)) + "." for _ in range(40)]
    path = tmp_path_factory.mktemp("text") / "calib.txt"
    path.write_text("\n\n".join(paragraphs))
    return WindowSpec(data=str(path), n_samples=2, seq_len=32, batch_size=2)


def random_scores(lm, seed=0) -> ImportanceScores:
    """Importance scores without a forward pass (for allocation tests on the real geometry)."""
    gen = torch.Generator().manual_seed(seed)
    layers = []
    for g in block_geometries(lm):
        layers.append(
            LayerScores(
                head=torch.rand(g.geometry.n_heads, generator=gen, dtype=torch.float64),
                channel=torch.rand(g.geometry.intermediate_size, generator=gen, dtype=torch.float64) ** 3,
            )
        )
    return ImportanceScores("wanda", layers)


@pytest.fixture(scope="module")
def smol_table(smol):
    return synthetic_table(smol, grid=SMOL_GRID, seed=1)


@pytest.fixture(scope="module")
def smol_windows(smol, calib):
    """Two short calibration windows for the real model (FLAP reads its fluctuation on them)."""
    return calibration_windows(smol.tokenizer, calib)


# ---- dp --------------------------------------------------------------------------------------
@pytest.mark.parametrize("budget", [0.0, 0.1, 0.3, 0.55])
def test_dp_plan_meets_budget_and_equals_brute_force(tiny, budget):
    table = synthetic_table(tiny)
    plan = plan_from_table(tiny, table, budget, n_buckets=100_000)  # exact: one parameter per bucket
    problem = planning_problem(table)
    target = budget * table.dense_prunable
    best_loss, best_choice = brute_force(problem.costs, problem.losses, problem.allowed, target)
    assert plan.params["removed"] >= target
    assert plan.predicted_loss == pytest.approx(best_loss, abs=1e-12)
    assert plan.allocator == "dp" and plan.budget == budget and plan.table_key == table.key
    expected = problem.rates(best_choice)
    assert (plan.attention_rates, plan.mlp_rates) == expected


def test_dp_plan_equals_planner_optimum_on_real_geometry(smol, smol_table):
    constraints = Constraints(locked={0: 0.0, -1: 0.0})
    plan = plan_from_table(smol, smol_table, 0.3, constraints=constraints)
    problem = planning_problem(smol_table, constraints)
    choice = solve_budget(problem.costs, problem.losses, problem.allowed, removed_params=0.3 * smol_table.dense_prunable)
    assert (plan.attention_rates, plan.mlp_rates) == problem.rates(choice)
    assert plan.params["removed"] == problem.removed(choice) >= 0.3 * smol_table.dense_prunable
    assert plan.predicted_loss == pytest.approx(problem.loss(choice))
    assert plan.attention_rates[0] == plan.mlp_rates[0] == plan.attention_rates[29] == plan.mlp_rates[29] == 0.0


def test_predicted_loss_reads_cells_on_grid_and_interpolates_between(tiny):
    table = synthetic_table(tiny)
    geoms = block_geometries(tiny)
    on_grid = predicted_loss(table, geoms, [0.25, 0.0], [0.0, 0.5])
    assert on_grid == pytest.approx(table.smoothed[0, 1] + table.smoothed[3, 2])
    # MLP width 96 in groups of 8: rate 1/3 keeps 64 channels, a third of the way from the
    # 0.25 cell (72 kept) to the 0.5 cell (48 kept).
    between = predicted_loss(table, geoms, [0.0, 0.0], [1 / 3, 0.0])
    low, high = table.smoothed[1, 1], table.smoothed[1, 2]
    assert between == pytest.approx(low + (high - low) / 3)


# ---- constraints ----------------------------------------------------------------------------
@pytest.mark.parametrize("allocator", ["dp", "uniform", "flap", "slimgpt"])
def test_locked_layers_keep_their_rate(smol, smol_table, smol_windows, allocator):
    constraints = Constraints(locked={0: 0.0, 29: 0.25}, min_rate=0.125)
    plan = plan_from_table(smol, smol_table, 0.3, allocator, constraints, smol_windows, scores=random_scores(smol))
    assert plan.attention_rates[0] == plan.mlp_rates[0] == 0.0
    assert plan.attention_rates[29] == plan.mlp_rates[29] == 0.25
    unlocked = plan.attention_rates[1:29] + plan.mlp_rates[1:29]
    assert min(unlocked) >= 0.125 - 1e-9 and max(unlocked) <= 0.95
    assert plan.params["removed"] >= 0.3 * plan.params["dense_prunable"]


def test_locked_layer_keeps_its_rate_under_owl(make_tiny, calib):
    lm = make_tiny("qwen3", num_hidden_layers=3)
    windows = calibration_windows(lm.tokenizer, calib)
    plan = plan_from_table(lm, synthetic_table(lm), 0.3, "owl", Constraints(locked={-1: 0.25}), windows=windows)
    assert plan.attention_rates[2] == plan.mlp_rates[2] == 0.25
    assert plan.params["removed"] >= 0.3 * plan.params["dense_prunable"]


@pytest.mark.parametrize("allocator", ["dp", "uniform", "flap", "slimgpt"])
def test_coupled_plans_share_one_rate_per_layer(smol, smol_table, smol_windows, allocator):
    plan = plan_from_table(smol, smol_table, 0.25, allocator, Constraints(coupled=True), smol_windows, scores=random_scores(smol))
    assert plan.attention_rates == plan.mlp_rates
    assert plan.params["removed"] >= 0.25 * plan.params["dense_prunable"]


def test_coupled_owl_plan_shares_one_rate_per_layer(tiny, calib):
    windows = calibration_windows(tiny.tokenizer, calib)
    plan = plan_from_table(tiny, synthetic_table(tiny), 0.3, "owl", Constraints(coupled=True), windows=windows)
    assert plan.attention_rates == plan.mlp_rates


@pytest.mark.parametrize(
    "constraints, message",
    [
        (Constraints(locked={0: 0.3}), "not on the rate grid"),
        (Constraints(locked={5: 0.0}), "out of range"),
        (Constraints(locked={1: 0.0, -1: 0.25}), "locked twice"),
        (Constraints(min_rate=0.6, max_rate=0.4), "above max_rate"),
        (Constraints(min_rate=0.8), "no grid rate"),
    ],
)
def test_contradictory_constraints_raise(tiny, constraints, message):
    with pytest.raises(BudgetError, match=message):
        plan_from_table(tiny, synthetic_table(tiny), 0.2, constraints=constraints)


def test_bad_budgets_and_allocators_raise(tiny):
    table = synthetic_table(tiny)
    for budget in (-0.1, 1.0, float("nan")):
        with pytest.raises(BudgetError):
            plan_from_table(tiny, table, budget)
    with pytest.raises(BudgetError, match=r"out of reach for dp: .* 0\.0% to 71\.7%"):
        plan_from_table(tiny, table, 0.8)
    with pytest.raises(BudgetError, match="out of reach"):
        check_reach(tiny, table, 0.7, "uniform", Constraints(max_rate=0.5))
    with pytest.raises(PlanError, match="unknown allocator"):
        plan_from_table(tiny, table, 0.2, allocator="random")
    with pytest.raises(PlanError, match="reads calibration windows"):
        plan_from_table(tiny, table, 0.2, allocator="owl")
    with pytest.raises(PlanError, match="reads calibration windows"):
        plan_from_table(tiny, table, 0.2, allocator="flap", scores=random_scores(tiny))  # FLAP reads its own metric
    assert set(ALLOCATORS) == {"dp", "uniform", "flap", "owl", "evo", "slimgpt"}


def test_table_for_another_model_raises(tiny, make_tiny):
    other = make_tiny("llama", seed=1)
    with pytest.raises(TableError, match="fingerprint"):
        plan_from_table(other, synthetic_table(tiny), 0.2)


# ---- baselines at equal budget -------------------------------------------------------------------
@pytest.mark.parametrize("allocator", ["uniform", "flap", "slimgpt"])
@pytest.mark.parametrize("budget", [0.1, 0.2, 0.45])
def test_baselines_hit_the_budget_within_one_unit(smol, smol_table, smol_windows, allocator, budget):
    plan = plan_from_table(smol, smol_table, budget, allocator, windows=smol_windows, scores=random_scores(smol))
    target = budget * plan.params["dense_prunable"]
    assert 0 <= plan.params["removed"] - target < mlp_unit(smol)
    assert plan.allocator == allocator and plan.predicted_loss > 0 and plan.table_key == smol_table.key


@pytest.mark.parametrize("allocator", ["uniform", "flap", "owl", "slimgpt"])
@pytest.mark.parametrize("model_type", ["llama", "gemma3_text"])
def test_baselines_hit_the_budget_within_one_unit_on_tiny_models(make_tiny, calib, allocator, model_type):
    lm = make_tiny(model_type)
    table = synthetic_table(lm)
    windows = calibration_windows(lm.tokenizer, calib)
    for budget in (0.15, 0.4):
        plan = plan_from_table(lm, table, budget, allocator, windows=windows)
        target = budget * plan.params["dense_prunable"]
        assert 0 <= plan.params["removed"] - target < mlp_unit(lm)


def test_uniform_is_one_rate_up_to_one_unit(smol, smol_table):
    plan = plan_from_table(smol, smol_table, 0.2, "uniform")
    mlp_widths = {round((1 - r) * 1536) for r in plan.mlp_rates}
    assert max(mlp_widths) - min(mlp_widths) <= 8
    assert len(set(plan.attention_rates)) <= 2


def test_baselines_from_papers_record_their_own_criterion(smol, smol_table, smol_windows):
    """FLAP prunes by its fluctuation metric and SlimGPT by its OBS, whatever the table's criterion."""
    assert smol_table.spec.criterion == "wanda"
    flap = plan_from_table(smol, smol_table, 0.3, "flap", windows=smol_windows, scores=random_scores(smol))
    slim = plan_from_table(smol, smol_table, 0.3, "slimgpt")
    uniform = plan_from_table(smol, smol_table, 0.3, "uniform")
    assert (flap.criterion, slim.criterion, uniform.criterion) == ("flap", "obs", "wanda")


def test_slimgpt_rates_rise_logarithmically_with_depth(smol, smol_table):
    plan = plan_from_table(smol, smol_table, 0.3, "slimgpt")
    shares = log_increase(30)
    assert shares[0] == 0.0 and shares[-1] == 1.0 and np.all(np.diff(shares) > 0)
    assert plan.attention_rates[0] == plan.mlp_rates[0] == 0.0  # block 0 stays dense
    # before settling, every slot sits at the unit rounding of r_last * share; settling moves
    # a few slots by one ladder step, so the rates follow the curve within one step of each ladder
    last = plan.mlp_rates[-1]
    wanted = last * shares
    assert np.max(np.abs(np.array(plan.mlp_rates) - wanted)) <= 16 / 1536 + 1e-9
    assert max(plan.mlp_rates) == plan.mlp_rates[-1] > 0.3


def test_flap_standardised_scores_are_z_scores_per_layer_and_rank_like_the_criterion(smol, smol_windows):
    standardised = flap_standardised(smol, smol_windows, 2)
    criterion = compute_importance(smol, smol_windows, "flap", 2)
    for z, raw in zip(standardised, criterion.layers):
        assert z.channel.mean().item() == pytest.approx(0.0, abs=1e-9) and z.channel.std().item() == pytest.approx(1.0)
        assert z.head.mean().item() == pytest.approx(0.0, abs=1e-9)  # heads average equal column counts
        assert torch.equal(torch.argsort(z.channel, stable=True), torch.argsort(raw.channel, stable=True))
        assert torch.equal(torch.argsort(z.head, stable=True), torch.argsort(raw.head, stable=True))


def test_owl_offsets_follow_outliers():
    offsets = owl_offsets(np.array([0.01, 0.03, 0.02]), lam=0.08)
    assert offsets.sum() == pytest.approx(0.0)
    assert offsets[0] == pytest.approx(0.08) and offsets[1] == pytest.approx(-0.08)  # most outliers: pruned least


# ---- evo --------------------------------------------------------------------------------------
def sliced_nll(lm, plan, scores, windows) -> float:
    pruned = copy.copy(lm)
    pruned.model = copy.deepcopy(lm.model)
    apply_plan(pruned, plan, scores)
    return mean_nll(pruned, windows, 2)


@pytest.mark.slow
def test_masked_plan_equals_slicing_and_restores(tiny, calib):
    windows = calibration_windows(tiny.tokenizer, calib)
    scores = compute_importance(tiny, windows, "wanda", 2)
    plan = plan_from_table(tiny, synthetic_table(tiny), 0.4, "uniform")
    before = {k: v.clone() for k, v in tiny.model.state_dict().items()}
    with masked_plan(tiny, plan.attention_rates, plan.mlp_rates, scores, 8):
        masked = mean_nll(tiny, windows, 2)
    assert masked == pytest.approx(sliced_nll(tiny, plan, scores, windows), abs=1e-5)
    for k, v in tiny.model.state_dict().items():
        assert torch.equal(v, before[k])


@pytest.mark.slow
def test_evo_never_worse_than_its_dp_seed(tiny, calib):
    table = synthetic_table(tiny, seed=3)
    windows = calibration_windows(tiny.tokenizer, calib)
    scores = compute_importance(tiny, windows, "wanda", 2)
    result = evolve(tiny, table, 0.35, windows, scores, settings=EvoSettings(generations=3, offspring=3, seed=1))
    assert result.actual <= result.seed_actual
    assert sliced_nll(tiny, result.plan, scores, windows) <= sliced_nll(tiny, result.seed_plan, scores, windows) + 1e-5
    assert result.plan.params["removed"] >= 0.35 * table.dense_prunable
    assert result.plan.allocator == "evo" and result.seed_plan.allocator == "dp"
    assert len(result.history) == 3 and result.evaluations >= 1
    assert result.gain >= 0
    # its generations are its progress, and a cancel stops it between two of them
    told, cancel = [], threading.Event()
    hooks = Hooks(progress=lambda done, total, eta: (told.append((done, total)), cancel.set()), cancel=cancel)
    with pytest.raises(CancelledError, match="evolutionary search cancelled after 1 of 3 generations"):
        evolve(tiny, table, 0.35, windows, scores, settings=EvoSettings(generations=3, offspring=3, seed=1), hooks=hooks)
    assert told == [(1, 3)]


@pytest.mark.slow
def test_measured_plans_report_truth_beside_prediction(tiny, calib):
    heldout = {"wiki-sample": calibration_windows(tiny.tokenizer, WindowSpec(calib.data, 2, 32, seed=5))}
    windows = calibration_windows(tiny.tokenizer, calib)
    scores = compute_importance(tiny, windows, "wanda", 2)
    reference = reference_numbers(tiny, windows, heldout, 2)
    zero = plan_from_table(tiny, synthetic_table(tiny), 0.0)
    outcome = measure_plan(tiny, zero, calib, windows, heldout, scores, reference)
    # What a checkpoint of the zero plan stores: the dense weights rounded to bfloat16, nothing cut.
    stored = tiny.copy()
    round_to_storage(stored.model, "bfloat16")
    assert outcome.calib_loss_increase == pytest.approx(mean_nll(stored, windows, 2) - reference.calib_loss, abs=1e-9)
    assert outcome.perplexity["wiki-sample"] == pytest.approx(math.exp(mean_nll(stored, heldout["wiki-sample"], 2)), rel=1e-9)
    plan = plan_from_table(tiny, synthetic_table(tiny), 0.4)
    outcome = measure_plan(tiny, plan, calib, windows, heldout, scores, reference)
    assert outcome.removed == plan.params["removed"] and outcome.predicted_loss == plan.predicted_loss
    assert math.isfinite(outcome.calib_loss_increase) and outcome.row()["ppl_wiki-sample"] > 1
    # a benchmark resumed from its CSV reads back the same outcome (floats to the 6 digits written)
    outcome.extras = {"seconds": 1.5, "evo_evaluations": 12}
    (row,) = csv.DictReader(io.StringIO(csv_text([outcome.row()])))
    back = Outcome.from_row(row)
    assert (back.allocator, back.removed, back.objective, back.extras) == (
        outcome.allocator,
        outcome.removed,
        outcome.objective,
        outcome.extras,
    )
    assert back.perplexity["wiki-sample"] == pytest.approx(outcome.perplexity["wiki-sample"], rel=1e-5)
    assert back.calib_objective_increase == pytest.approx(outcome.calib_objective_increase, rel=1e-5, abs=1e-9)


# ---- the front ---------------------------------------------------------------------------------
@pytest.mark.parametrize("coupled", [False, True])
def test_front_rows_are_monotone_and_optimal(tiny, coupled):
    table = synthetic_table(tiny, seed=2)
    constraints = Constraints(coupled=coupled)
    rows = front_rows(table, dp_front(table, constraints, n_buckets=100_000))
    removed = [r["removed"] for r in rows]
    losses = [r["predicted_loss"] for r in rows]
    assert removed == sorted(set(removed)) and removed[0] == 0
    assert all(b >= a for a, b in zip(losses, losses[1:]))
    assert all(0.0 <= r["budget"] < 1.0 and len(r["attention_rates"]) == 2 for r in rows)
    problem = planning_problem(table, constraints)
    for budget in (0.1, 0.3, 0.6):
        row = next(r for r in rows if r["removed"] >= budget * table.dense_prunable)
        best, _ = brute_force(problem.costs, problem.losses, problem.allowed, budget * table.dense_prunable)
        assert row["predicted_loss"] == pytest.approx(best)
        if coupled:
            assert row["attention_rates"] == row["mlp_rates"]


# ---- the CLI -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_saved(smol_tokenizer, calib, tmp_path_factory):
    """A tiny model saved as a folder (so the CLI can load it by path) and a table for it."""
    from conftest import tiny_lm

    lm = tiny_lm("llama", smol_tokenizer, num_hidden_layers=3)
    folder = tmp_path_factory.mktemp("tiny") / "model"
    lm.model.save_pretrained(folder)
    smol_tokenizer.save_pretrained(folder)
    table = synthetic_table(lm, model=str(folder), data=calib.data)
    path = folder.parent / "table.json"
    path.write_text(table.to_json())
    return lm, table, path


@pytest.mark.parametrize("suffix", [".json", ".yaml"])
@pytest.mark.slow
def test_cli_plan_writes_a_valid_plan(tiny_saved, tmp_path, capsys, suffix):
    lm, table, table_path = tiny_saved
    out = tmp_path / f"plan{suffix}"
    rc = cli.main(["plan", "--table", str(table_path), "--budget", "0.2", "--lock", "-1", "--out", str(out), "--json"])
    assert rc == 0
    plan = RatePlan.load(out)
    plan.check_model(lm)
    assert plan.allocator == "dp" and plan.budget == 0.2 and plan.attention_rates[2] == plan.mlp_rates[2] == 0.0
    assert plan.params["removed"] >= 0.2 * plan.params["dense_prunable"] and plan.table_key == table.key
    assert json.loads(capsys.readouterr().out)["removed"] == plan.params["removed"]


@pytest.mark.slow
def test_cli_plan_uniform_with_explicit_model(tiny_saved, tmp_path):
    _, table, table_path = tiny_saved
    out = tmp_path / "plan.json"
    args = ["plan", "--table", str(table_path), "--model", table.model, "--budget", "0.3", "--allocator", "uniform"]
    assert cli.main(args + ["--coupled", "--out", str(out)]) == 0
    plan = RatePlan.load(out)
    assert plan.allocator == "uniform" and plan.attention_rates == plan.mlp_rates


def test_cli_old_method_flag_still_works_and_says_so(tiny_saved, tmp_path, capsys):
    _, table, table_path = tiny_saved
    out = tmp_path / "plan.json"
    args = ["plan", "--table", str(table_path), "--budget", "0.3", "--method", "uniform", "--out", str(out)]
    assert cli.main(args) == 0
    assert RatePlan.load(out).allocator == "uniform"
    assert "--method is deprecated and will be removed in gap-engine 0.3.0; use --allocator" in capsys.readouterr().err


def test_cli_plan_keep_params_sets_the_budget_from_a_parameter_count(tiny_saved, tmp_path, capsys):
    lm, table, table_path = tiny_saved
    keep = lm.param_count() - int(0.3 * table.dense_prunable)
    out = tmp_path / "plan.json"
    assert cli.main(["plan", "--table", str(table_path), "--keep-params", str(keep), "--out", str(out)]) == 0
    plan = RatePlan.load(out)
    assert plan.budget == pytest.approx(0.3, abs=1e-6)
    assert plan.params["pruned_total"] <= keep
    capsys.readouterr()
    too_few = tmp_path / "too-few.json"
    assert cli.main(["plan", "--table", str(table_path), "--keep-params", "10", "--out", str(too_few)]) == 2
    assert "cannot keep only 10 parameters" in capsys.readouterr().err and not too_few.exists()
    assert cli.main(["plan", "--table", str(table_path), "--out", str(too_few)]) == 2
    assert "exactly one of --budget" in capsys.readouterr().err


@pytest.mark.slow
def test_cli_compare_prunes_and_measures_every_allocator(tiny_saved, calib, tmp_path, capsys):
    _, table, table_path = tiny_saved
    out = tmp_path / "results.csv"
    args = ["compare", "--model", table.model, "--table", str(table_path), "--budgets", "0.1,0.3"]
    args += ["--allocators", "dp,uniform,owl", "--eval-data", calib.data, "--eval-samples", "1", "--eval-seq-len", "16"]
    assert cli.main(args + ["--out", str(out)]) == 0
    rows = list(csv.DictReader(io.StringIO(out.read_text())))
    assert [(r["allocator"], float(r["budget"])) for r in rows] == [(m, b) for b in (0.1, 0.3) for m in ("dp", "uniform", "owl")]
    assert all(int(r["removed"]) >= float(r["budget"]) * table.dense_prunable for r in rows)
    assert all(float(r[f"ppl_{calib.data}"]) > 1 for r in rows)
    printed = capsys.readouterr().out
    assert "dense" in printed and "uniform" in printed


@pytest.mark.slow
def test_cli_compare_prunes_paper_baselines_by_their_own_criterion(tiny_saved, calib, tmp_path):
    """flap prunes by FLAP's metric, slimgpt block by block with OBS, beside a table of another criterion."""
    _, table, table_path = tiny_saved
    out = tmp_path / "results.csv"
    args = ["compare", "--model", table.model, "--table", str(table_path), "--budgets", "0.3", "--allocators", "flap,slimgpt,uniform"]
    assert cli.main(args + ["--eval-data", calib.data, "--eval-samples", "1", "--eval-seq-len", "16", "--out", str(out)]) == 0
    rows = list(csv.DictReader(io.StringIO(out.read_text())))
    assert [r["allocator"] for r in rows] == ["flap", "slimgpt", "uniform"]
    assert all(int(r["removed"]) >= 0.3 * table.dense_prunable and math.isfinite(float(r[f"ppl_{calib.data}"])) for r in rows)


def test_cli_compare_unreachable_budget_exits_2(tiny_saved, calib, tmp_path, capsys):
    _, table, table_path = tiny_saved
    out = tmp_path / "results.csv"
    args = ["compare", "--model", table.model, "--table", str(table_path), "--budgets", "0.1,0.8", "--allocators", "dp"]
    assert cli.main(args + ["--eval-data", calib.data, "--out", str(out)]) == 2
    assert "out of reach" in capsys.readouterr().err
    assert not out.exists()


def test_cli_front_writes_csv(smol_table, tmp_path):
    table_path = tmp_path / "table.json"
    table_path.write_text(smol_table.to_json())
    out = tmp_path / "front.csv"
    assert cli.main(["front", "--table", str(table_path), "--out", str(out), "--coupled", "--lock", "0:0.0"]) == 0
    lines = out.read_text().splitlines()
    header = lines[0].split(",")
    assert header[:3] == ["budget", "removed", "predicted_loss"] and "attn_29" in header and "mlp_0" in header
    budgets = [float(line.split(",")[0]) for line in lines[1:]]
    assert len(budgets) > 100 and budgets == sorted(budgets)
    last = dict(zip(header, lines[-1].split(",")))
    assert float(last["attn_0"]) == float(last["mlp_0"]) == 0.0 and last["attn_5"] == last["mlp_5"]


def write_table(tmp_path, text) -> str:
    path = tmp_path / "table.json"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize(
    "args, table_kind, message",
    [
        (["--budget", "0.2"], "malformed", "not valid JSON"),
        (["--budget", "0.2"], "truncated", "loss table num_layers must be an integer"),
        (["--budget", "0.2"], "missing", "cannot read loss table"),
        (["--budget", "0.2"], "other-model", "fingerprint"),
        (["--budget", "0.75"], "good", "out of reach for dp"),
        (["--budget", "0.5", "--allocator", "uniform", "--max-rate", "0.3"], "good", "out of reach for uniform"),
        (["--budget", "1.5"], "good", "outside [0, 1)"),
        (["--budget", "0.2", "--lock", "0:0.0", "--lock", "0:0.5"], "good", "locked twice"),
        (["--budget", "0.2", "--lock", "0:0.3"], "good", "not on the rate grid"),
        (["--budget", "0.2", "--lock", "7"], "good", "out of range"),
        (["--budget", "0.2", "--lock", "x"], "good", "--lock expects"),
        (["--budget", "0.2", "--min-rate", "0.6", "--max-rate", "0.5"], "good", "above max_rate"),
    ],
)
def test_cli_plan_bad_input_exits_2_and_writes_nothing(tiny_saved, tmp_path, capsys, args, table_kind, message):
    lm, table, good_path = tiny_saved
    if table_kind == "malformed":
        table_path = write_table(tmp_path, '{"format_version": 1, "delta": [')
    elif table_kind == "truncated":
        table_path = write_table(tmp_path, json.dumps({"format_version": TABLE_FORMAT_VERSION, "spec": {}, "components": [[0, "attn"]]}))
    elif table_kind == "other-model":
        table_path = write_table(tmp_path, synthetic_table(lm, fingerprint="0123456789abcdef", model=table.model).to_json())
    elif table_kind == "missing":
        table_path = str(tmp_path / "nope.json")
    else:
        table_path = str(good_path)
    out = tmp_path / "plan.json"
    rc = cli.main(["plan", "--table", table_path, *args, "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2
    assert message in err and len(err.strip().splitlines()) == 1
    assert not out.exists()


def test_cli_front_bad_table_exits_2(tmp_path, capsys):
    out = tmp_path / "front.csv"
    rc = cli.main(["front", "--table", write_table(tmp_path, "[1, 2]"), "--out", str(out)])
    assert rc == 2 and "loss table" in capsys.readouterr().err
    assert not out.exists()
