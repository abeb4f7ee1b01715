"""One plan, one set of numbers: the explorer's run, ``gap compare`` and ``gap prune`` + ``gap eval``
measure the same pruned model (``stages.pruned_as_saved``: what a checkpoint stores).

Real SmolLM2-135M (its float32 weights are not bfloat16 numbers, so a surface that measured
the float32 copy would report other numbers than the checkpoint), a synthetic table with its
real geometry, two windows of 32 tokens of real news text.
"""

from __future__ import annotations

import json

import pytest
from app_fixtures import fresh_cache  # noqa: F401 - a fixture: an empty cache with the built-in model linked in
from synthetic_tables import SMOL_GRID, synthetic_table

from gap_engine import cli
from gap_engine.cli import plan_commands
from gap_engine.core.config import WindowSpec
from gap_engine.evaluate.metrics import EvalSettings
from gap_engine.model.loading import load_model
from gap_engine.model.rateplan import RatePlan
from gap_engine.pipeline.runs import prune_and_evaluate
from gap_engine.plan.step import plan_criterion
from gap_engine.prune.compensations import CompensationSettings, default_for

TEXT = "news-sample"
WINDOW_ARGS = ["--samples", "2", "--seq-len", "32", "--batch-size", "2", "--seed", "0"]


def test_smol_run_compare_and_prune_eval_agree_on_one_plan(smol, fresh_cache, tmp_path, capsys, monkeypatch):
    table = synthetic_table(smol, grid=SMOL_GRID, seed=1, model="smollm2-135m", data=TEXT)
    table_path = tmp_path / "table.json"
    table_path.write_text(table.to_json())
    heldout = WindowSpec(data=TEXT, n_samples=2, seq_len=32, seed=0, batch_size=2)

    # The explorer's run (what its background job calls, with the page's default compensation: none after the
    # DP's step on SmolLM2, OBS), saving its checkpoint.
    page_default = default_for(plan_criterion("dp", table)).mode
    assert page_default == "none"
    settings = EvalSettings(windows=heldout, throughput=False, generations=0)
    run = prune_and_evaluate(
        smol,
        settings,
        table=table,
        budget=0.2,
        allocator="dp",
        checkpoint_dir=tmp_path / "run",
        history_path=tmp_path / "runs.db",
        compensation=CompensationSettings(mode=page_default),
    )

    # gap compare, the same table and budget (its outcomes kept at full precision: the CSV has 6 digits).
    outcomes = []
    engine_compare = plan_commands.compare
    monkeypatch.setattr(plan_commands, "compare", lambda *args, **kw: outcomes.extend(engine_compare(*args, **kw)) or outcomes)
    compare_csv = tmp_path / "compare.csv"
    args = ["compare", "--model", "smollm2-135m", "--table", str(table_path), "--budgets", "0.2", "--allocators", "dp"]
    args += ["--eval-data", TEXT, "--eval-samples", "2", "--eval-seq-len", "32", "--seed", "0", "--out", str(compare_csv)]
    assert cli.main(args) == 0
    (outcome,) = outcomes

    # gap plan -> gap prune -> gap eval.
    plan_path, out = tmp_path / "plan.json", tmp_path / "pruned"
    assert cli.main(["plan", "--table", str(table_path), "--budget", "0.2", "--out", str(plan_path)]) == 0
    assert RatePlan.load(plan_path).content_hash() == run.plan_hash
    assert cli.main(["prune", "--model", "smollm2-135m", "--plan", str(plan_path), "--data", TEXT, *WINDOW_ARGS, "--out", str(out)]) == 0
    capsys.readouterr()
    assert cli.main(["eval", "--model", str(out), "--data", TEXT, *WINDOW_ARGS, "--no-throughput", "--generations", "0", "--json"]) == 0
    evaluated = json.loads(capsys.readouterr().out)

    # The same weights: the run's checkpoint and gap prune's hold one fingerprint.
    markers = [json.loads((folder / "gap_pruned.json").read_text()) for folder in (tmp_path / "run", out)]
    assert markers[0]["fingerprint"] == markers[1]["fingerprint"]
    modes = [(marker["compensation"] or {"mode": "none"})["mode"] for marker in markers]  # none is recorded as no compensation
    assert modes == [outcome.compensation, page_default] == [page_default, page_default]
    assert [json.loads((folder / "plan.json").read_text())["criterion"] for folder in (tmp_path / "run", out)] == ["obs", "obs"]
    assert load_model(str(out)).fingerprint == markers[1]["fingerprint"]

    # The same numbers on every surface, to 1e-6.
    perplexities = {"run": run.report["perplexity"][TEXT], "compare": outcome.perplexity[TEXT], "eval": evaluated["perplexity"][TEXT]}
    for surface, value in perplexities.items():
        assert value == pytest.approx(perplexities["run"], rel=1e-6, abs=1e-6), (surface, perplexities)
    assert run.params_after == outcome.params_after == evaluated["params"]
    assert outcome.calib_loss_increase == pytest.approx(run.actual_loss, rel=1e-6, abs=1e-6)
    assert run.report["kl_to_dense"][TEXT] == pytest.approx(evaluated["kl_to_dense"][TEXT], rel=1e-6, abs=1e-6)
