"""``--compensate`` on ``gap prune``, ``gap compare`` and ``gap table``: tiny model folders of two
families, and every refusal as one line, exit 2, nothing written."""

from __future__ import annotations

import csv
import json

import pytest
import torch

from gap_engine.cli import main
from gap_engine.cli.arguments import compensation_from
from gap_engine.cli.parser import build_parser
from gap_engine.cli.plan_commands import budget_for_kept_params, read_table
from gap_engine.core.config import DEFAULT_COMPENSATION
from gap_engine.model.loading import load_model
from gap_engine.model.rateplan import RatePlan
from gap_engine.model.units import block_geometries
from gap_engine.plan.allocators import plan_from_table

TINY = dict(num_attention_heads=8, num_key_value_heads=2, intermediate_size=128)
CALIB = ["--samples", "4", "--seq-len", "64", "--batch-size", "2"]  # 256 tokens: more than any projection's inputs


def _folder(make_tiny, tmp_path, family, dead_attention=False):
    lm = make_tiny(family, **TINY)
    if dead_attention:  # block 0's heads all output zeros: o_proj's least-squares system is singular
        with torch.no_grad():
            lm.adapter.attention_projections(lm.adapter.layers(lm.model)[0])[2].weight.zero_()
    folder = tmp_path / f"tiny-{family}"
    lm.model.save_pretrained(folder)
    lm.tokenizer.save_pretrained(folder)
    return folder


def _one_line(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("gap: error: ")
    return err[-1]


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
@pytest.mark.slow
def test_prune_with_compensation_records_it_in_the_checkpoint(make_tiny, tmp_path, capsys, family):
    folder = _folder(make_tiny, tmp_path, family)
    out = tmp_path / "pruned"
    assert main(["prune", "--model", str(folder), "--uniform", "0.3", "--compensate", "bias", "--out", str(out), "--json", *CALIB]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["compensation"] == "bias"
    marker = json.loads((out / "gap_pruned.json").read_text())
    fitted = 64 if family == "gemma3_text" else 4  # Gemma 3 fits on at least 64 windows when none are asked
    assert marker["compensation"]["mode"] == "bias" and marker["compensation"]["windows"]["n_samples"] == fitted
    assert json.loads((out / "config.json").read_text())["gap_output_bias"] is True
    assert marker["param_count"] == summary["params_after"] == load_model(str(out)).param_count()


@pytest.mark.slow
def test_prune_without_compensate_adds_the_default_bias(make_tiny, tmp_path, capsys):
    folder = _folder(make_tiny, tmp_path, "llama")
    out = tmp_path / "pruned"
    assert main(["prune", "--model", str(folder), "--uniform", "0.3", "--out", str(out), "--json", *CALIB]) == 0
    assert json.loads(capsys.readouterr().out)["compensation"] == DEFAULT_COMPENSATION == "bias"
    assert json.loads((out / "config.json").read_text())["gap_output_bias"] is True


@pytest.mark.slow
def test_prune_budget_with_bias_counts_no_bias_as_pruned_or_kept(make_tiny, tmp_path, capsys):
    # The added biases are not prunable parameters: an untouched block's rate stays 0 (not below) and
    # the share removed is the plan's.
    folder = _folder(make_tiny, tmp_path, "llama")
    out = tmp_path / "pruned"
    argv = [
        "prune",
        "--model",
        str(folder),
        "--budget",
        "0.2",
        "--rates",
        "0,0.25,0.5",
        "--compensate",
        "bias",
        "--out",
        str(out),
        "--json",
    ]
    assert main([*argv, *CALIB]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    plan = json.loads((out / "plan.json").read_text())
    assert summary["compensation"] == "bias" and min(plan["attention_rates"] + plan["mlp_rates"]) >= 0
    assert 0.2 <= summary["removed_fraction_of_prunable"] <= 0.5
    assert summary["params_after"] == load_model(str(out)).param_count() > plan["params"]["pruned_total"]


@pytest.mark.parametrize(
    "argv, criterion, mode",
    [
        ([], "wanda", "bias"),
        ([], "magnitude", "bias"),
        ([], "obs", "none"),
        (["--compensate", "refit"], "obs", "refit"),
        (["--compensate", "none"], "wanda", "none"),
    ],
)
def test_the_default_compensation_is_none_only_for_a_criterion_that_updates_itself(argv, criterion, mode):
    # obs (SlimGPT) takes no second compensation: by default it gets none, asked for one it is refused later
    assert (
        compensation_from(build_parser().parse_args(["prune", "--model", "m", "--out", "o", "--uniform", "0.2", *argv]), criterion).mode
        == mode
    )


@pytest.mark.parametrize(
    "model_type, argv, criterion, mode",
    [
        ("gemma3_text", [], "wanda", "bias+refit"),  # Gemma 3's measured default
        ("gemma3_text", [], None, "bias+refit"),  # gap compare: each row its own, the family's where no OBS
        ("gemma3_text", [], "obs", "none"),
        ("gemma3_text", ["--compensate", "bias"], "wanda", "bias"),
        ("llama", [], "wanda", "bias"),
        (None, [], "wanda", "bias"),  # a family not known here
    ],
)
def test_the_default_compensation_is_the_model_familys(model_type, argv, criterion, mode):
    args = build_parser().parse_args(["prune", "--model", "m", "--out", "o", "--uniform", "0.2", *argv])
    assert compensation_from(args, criterion, model_type=model_type).mode == mode


@pytest.mark.slow
def test_compare_prunes_every_plan_with_the_compensation(make_tiny, tmp_path, capsys):
    folder = _folder(make_tiny, tmp_path, "llama")
    out = tmp_path / "compare.csv"
    argv = ["compare", "--model", str(folder), "--budgets", "0.2", "--allocators", "dp,uniform", "--compensate", "refit"]
    argv += ["--rates", "0,0.25,0.5", "--eval-samples", "2", "--eval-seq-len", "32", "--out", str(out), *CALIB]
    assert main(argv) == 0
    assert "compensation: refit; the fisher table estimates the uncompensated model" in capsys.readouterr().out
    rows = list(csv.DictReader(out.open()))
    assert [row["compensation"] for row in rows] == ["refit", "refit"]
    assert [row["bias_params"] for row in rows] == ["0", "0"]  # a refit adds no bias


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--uniform", "0.3", "--compensate", "refit", "--samples", "1", "--seq-len", "16"], "give at least 128"),
        (["--budget", "0.2", "--rounds", "2", "--compensate", "refit", *CALIB], "use --rounds 1"),
        (["--uniform", "0.3", "--compensate", "stretch", *CALIB], "invalid choice: 'stretch'"),
    ],
)
@pytest.mark.slow
def test_what_compensation_cannot_do_is_one_line(make_tiny, tmp_path, capsys, argv, message):
    folder = _folder(make_tiny, tmp_path, "llama")
    out = tmp_path / "never"
    if "stretch" in argv:
        with pytest.raises(SystemExit) as info:
            main(["prune", "--model", str(folder), "--out", str(out), *argv])
        assert info.value.code == 2 and message in capsys.readouterr().err
    else:
        assert message in _one_line(capsys, ["prune", "--model", str(folder), "--out", str(out), *argv])
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["tiny-llama"]


@pytest.mark.slow
def test_a_singular_system_is_one_line_and_writes_nothing(make_tiny, tmp_path, capsys):
    folder = _folder(make_tiny, tmp_path, "llama", dead_attention=True)
    out = tmp_path / "never"
    line = _one_line(capsys, ["prune", "--model", str(folder), "--uniform", "0.3", "--compensate", "refit", "--out", str(out), *CALIB])
    assert "block 0 o_proj" in line and "singular" in line
    assert not out.exists()


@pytest.mark.slow
def test_a_table_estimate_cannot_include_compensation(make_tiny, tmp_path, capsys):
    folder = _folder(make_tiny, tmp_path, "llama")
    line = _one_line(capsys, ["table", "--model", str(folder), "--compensate", "refit", "--out", str(tmp_path / "t.json"), *CALIB])
    assert "the fisher estimate measures no cell" in line and not (tmp_path / "t.json").exists()


# ---- the budget pays for the biases ------------------------------------------------------------
RATES = ["--rates", "0,0.25,0.5,0.75"]


def _table(folder, tmp_path) -> str:
    path = tmp_path / "table.json"
    assert main(["table", "--model", str(folder), *RATES, "--no-cache", "--out", str(path), *CALIB]) == 0
    return str(path)


def _biases_of(lm, plan) -> int:
    """The biases bias compensation gives a plan's model, counted by hand: one hidden-wide bias per
    o_proj / down_proj whose component the plan cuts."""
    geoms = block_geometries(lm)
    cut = [
        g.removed_at(part, rate) > 0
        for g, a, m in zip(geoms, plan.attention_rates, plan.mlp_rates)
        for part, rate in (("attn", a), ("mlp", m))
    ]
    return sum(cut) * geoms[0].hidden


@pytest.mark.slow
def test_keep_params_leaves_room_for_the_biases_prune_adds(make_tiny, tmp_path, capsys):
    """``gap plan --keep-params N`` then ``gap prune`` (the default bias compensation): at most N
    parameters, biases included. N is one where a plan that ignored the biases ends above it.
    Qwen3: a family whose DP step is the table's criterion, so the default is bias (Llama's is OBS)."""
    folder = _folder(make_tiny, tmp_path, "qwen3")
    table_path = _table(folder, tmp_path)
    lm, table = load_model(str(folder)), read_table(table_path)
    keep = None
    for budget in (0.2, 0.25, 0.3, 0.35, 0.4, 0.45):
        removed = plan_from_table(lm, table, budget).params["removed"]
        candidate = lm.param_count() - removed
        unpaid = plan_from_table(lm, table, budget_for_kept_params(lm.param_count(), table.dense_prunable, candidate))
        if unpaid.params["pruned_total"] + _biases_of(lm, unpaid) > candidate:
            keep = candidate
            break
    assert keep is not None, "no N where biases the plan left out would push the model past it"
    capsys.readouterr()
    plan_path, out = tmp_path / "plan.json", tmp_path / "pruned"
    assert main(["plan", "--table", table_path, "--keep-params", str(keep), "--out", str(plan_path), "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)
    assert main(["prune", "--model", str(folder), "--plan", str(plan_path), "--out", str(out), "--json", *CALIB]) == 0
    pruned = json.loads(capsys.readouterr().out)
    assert pruned["params_after"] <= keep
    assert pruned["params_after"] == load_model(str(out)).param_count() == planned["params_after"]
    assert pruned["compensation"] == planned["compensation"] == "bias" and pruned["bias_params"] == planned["bias_params"] > 0
    assert pruned["net_removed"] == pruned["params_before"] - pruned["params_after"] == pruned["removed"] - pruned["bias_params"]
    assert pruned["net_removed_fraction_of_prunable"] == pytest.approx(pruned["net_removed"] / table.dense_prunable)


@pytest.mark.parametrize("mode", ["refit", "none"])
@pytest.mark.slow
def test_prune_of_a_plan_applies_the_compensation_it_was_counted_for(make_tiny, tmp_path, capsys, mode):
    folder = _folder(make_tiny, tmp_path, "llama")
    table_path = _table(folder, tmp_path)
    plan_path, out = tmp_path / "plan.json", tmp_path / "pruned"
    assert main(["plan", "--table", table_path, "--budget", "0.3", "--compensate", mode, "--out", str(plan_path)]) == 0
    assert RatePlan.load(plan_path).compensation == mode
    capsys.readouterr()
    assert main(["prune", "--model", str(folder), "--plan", str(plan_path), "--out", str(out), "--json", *CALIB]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["compensation"] == mode and summary["bias_params"] == 0
    assert "gap_output_bias" not in json.loads((out / "config.json").read_text())


@pytest.mark.slow
def test_prune_says_when_a_plan_did_not_count_the_biases(make_tiny, tmp_path, capsys):
    folder = _folder(make_tiny, tmp_path, "llama")
    table_path = _table(folder, tmp_path)
    plan_path, out = tmp_path / "plan.json", tmp_path / "pruned"
    assert main(["plan", "--table", table_path, "--budget", "0.3", "--compensate", "none", "--out", str(plan_path)]) == 0
    capsys.readouterr()
    argv = ["prune", "--model", str(folder), "--plan", str(plan_path), "--compensate", "bias", "--out", str(out), "--json", *CALIB]
    assert main(argv) == 0
    captured = capsys.readouterr()
    added = json.loads(captured.out)["bias_params"]
    assert added > 0 and f"the plan was counted without the {added:,} parameters the bias compensation's biases add" in captured.err


@pytest.mark.slow
def test_a_slimgpt_plan_takes_a_bias_but_no_refit(make_tiny, tmp_path, capsys):
    """OBS's update is a refit of the kept columns: a second refit is refused, a bias on top is
    counted in the plan (its biases charged), and none stays the default."""
    folder = _folder(make_tiny, tmp_path, "llama")
    table_path = _table(folder, tmp_path)
    argv = ["plan", "--table", table_path, "--budget", "0.3", "--allocator", "slimgpt", "--out", str(tmp_path / "p.json")]
    line = _one_line(capsys, [*argv, "--compensate", "refit"])
    assert "updates the kept columns itself" in line and not (tmp_path / "p.json").exists()
    assert main(argv) == 0 and RatePlan.load(tmp_path / "p.json").compensation == "none"
    assert main([*argv, "--compensate", "bias"]) == 0
    biased = RatePlan.load(tmp_path / "p.json")
    assert biased.compensation == "bias" and biased.params["bias_params"] > 0
