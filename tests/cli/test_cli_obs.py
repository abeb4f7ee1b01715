"""``--criterion obs`` for any plan on the command line, and ``--obs-samples``: ``gap prune --plan``,
``gap prune --budget``, ``gap compare``'s ``ALLOCATOR:CRITERION``; every refusal one line, exit 2.

Tiny random two-layer Llama folders (8 query heads in 2 KV groups, MLP 128) with the real SmolLM2
tokenizer; DP plans from a fisher table on 4 x 64 calibration tokens.
"""

from __future__ import annotations

import csv
import json

import pytest
import torch
from cli_fixtures import CALIB, gap, refused, tiny  # noqa: F401

from gap_engine.cli.parser import build_parser, explicit_options
from gap_engine.cli.preflight import check_option_rules
from gap_engine.core.config import WindowSpec
from gap_engine.core.errors import OptionError
from gap_engine.data.windows import calibration_windows
from gap_engine.model.loading import load_model
from gap_engine.model.rateplan import RatePlan

RATES = ["--rates", "0,0.25,0.5,0.75", "--estimator", "fisher"]


def _dp_plan(gap, folder, tmp_path, *table_options):
    table, plan = tmp_path / "t.json", tmp_path / "dp.json"
    for argv in (
        ["table", "--model", folder, *RATES, *CALIB, *table_options, "--out", table],
        ["plan", "--table", table, "--budget", "0.3", "--compensate", "none", "--out", plan],
    ):
        code, err, _ = gap(*argv)
        assert code == 0, err
    return plan


def _logits(folder, ids):
    with torch.no_grad():
        return load_model(str(folder)).model(input_ids=ids).logits


@pytest.mark.slow
def test_prune_a_dp_plan_by_obs(gap, tiny, tmp_path):
    plan_path = _dp_plan(gap, tiny, tmp_path)
    plan = RatePlan.load(plan_path)
    assert (plan.allocator, plan.criterion) == ("dp", "obs") and any(plan.mlp_rates)  # the DP's step on a Llama model
    common = ["prune", "--model", tiny, "--plan", plan_path, "--save-dtype", "float32", *CALIB, "--json"]
    code, err, out = gap(*common, "--obs-samples", "6", "--out", tmp_path / "obs")
    assert code == 0, err
    summary = json.loads(out)
    assert (summary["criterion"], summary["obs_windows"], summary["compensation"]) == ("obs", 6, "none")
    code, err, _ = gap(*common, "--criterion", "wanda", "--out", tmp_path / "wanda")  # the plan's counted compensation: none
    assert code == 0, err

    saved = json.loads((tmp_path / "obs" / "plan.json").read_text())
    assert (saved["allocator"], saved["criterion"]) == ("dp", "obs")
    assert (saved["attention_rates"], saved["mlp_rates"]) == (plan.attention_rates, plan.mlp_rates)
    assert "| within-layer criterion | obs " in (tmp_path / "obs" / "README.md").read_text()
    kept = {name: json.loads((tmp_path / name / "kept_indices.json").read_text()) for name in ("obs", "wanda")}
    for key in ("kept_kv_heads", "kept_heads", "kept_channels"):  # the plan's counts, block by block
        assert [len(layer) for layer in kept["obs"][key]] == [len(layer) for layer in kept["wanda"][key]]
    assert kept["obs"]["kept_channels"] != kept["wanda"]["kept_channels"]  # OBS's choice, not wanda's
    assert json.loads((tmp_path / "obs" / "gap_pruned.json").read_text())["param_count"] == plan.params["pruned_total"]

    ids = calibration_windows(load_model(str(tiny)).tokenizer, WindowSpec(n_samples=2, seq_len=32))
    first, again = _logits(tmp_path / "obs", ids), _logits(tmp_path / "obs", ids)
    torch.testing.assert_close(first, again, rtol=0, atol=0)
    assert not torch.allclose(first, _logits(tmp_path / "wanda", ids))


@pytest.mark.slow
def test_prune_budget_by_obs_plans_on_a_wanda_table(gap, tiny, tmp_path):
    argv = ["prune", "--model", tiny, "--budget", "0.3", *RATES, *CALIB, "--criterion", "obs", "--out", tmp_path / "ck"]
    code, err, out = gap(*argv)
    assert code == 0, err
    # OBS reads its own default window count: 4x the table's 4
    assert "criterion: obs" in out
    assert "units: chosen and updated by obs on 16 calibration windows; the tables scored units by wanda" in out
    saved = json.loads((tmp_path / "ck" / "plan.json").read_text())
    assert saved["criterion"] == "obs" and saved["compensation"] == "none"
    assert 0.3 <= saved["params"]["removed_fraction_of_prunable"] < 0.5


@pytest.mark.slow
def test_compare_dp_at_its_step_beside_dp_pruned_by_the_tables_criterion(gap, tiny, tmp_path):
    out = tmp_path / "c.csv"
    argv = ["compare", "--model", tiny, "--budgets", "0.3", "--allocators", "dp:wanda,dp", *RATES, *CALIB, "--obs-samples", "6"]
    code, err, printed = gap(*argv, "--eval-samples", "2", "--eval-seq-len", "32", "--out", out)
    assert code == 0, err
    rows = list(csv.DictReader(out.open()))
    assert [(r["allocator"], r["criterion"], r["compensation"], r["obs_windows"]) for r in rows] == [
        ("dp", "wanda", "bias", ""),
        ("dp", "obs", "none", "6"),  # OBS's update is its compensation, and its plan is counted for none
    ]
    assert float(rows[0]["bias_params"]) > 0 and rows[1]["bias_params"] == "0"
    assert rows[0]["ppl_wiki-sample"] != rows[1]["ppl_wiki-sample"]
    assert any(line.split()[:2] == ["dp", "obs"] for line in printed.splitlines())
    assert "compensation: bias" in printed and "rows pruned by obs: compensation none" in printed  # each row's, said


@pytest.mark.slow
def test_an_unknown_criterion_in_an_allocator_spec_is_one_line(gap, tiny, tmp_path):
    argv = ["compare", "--model", tiny, "--budgets", "0.3", "--allocators", "dp:best", *RATES, *CALIB, "--out", tmp_path / "c.csv"]
    refused(gap(*argv), "unknown criterion 'best' in 'dp:best'")
    assert not (tmp_path / "c.csv").exists()


def _rules(*argv):
    args = build_parser().parse_args(list(argv))
    args.given_options = explicit_options(list(argv))
    check_option_rules(args)


@pytest.mark.parametrize(
    "argv",
    [
        ["prune", "--model", "m", "--out", "o", "--plan", "p.json", "--criterion", "obs"],  # replaces the plan's criterion
        [
            "prune",
            "--model",
            "m",
            "--out",
            "o",
            "--plan",
            "p.json",
            "--criterion",
            "wanda",
            "--obs-samples",
            "8",
        ],  # the handler reads the plan
        ["prune", "--model", "m", "--out", "o", "--uniform", "0.2", "--criterion", "obs", "--obs-samples", "8"],
        ["prune", "--model", "m", "--out", "o", "--budget", "0.2", "--criterion", "obs", "--obs-samples", "8"],
        ["compare", "--model", "m", "--out", "o", "--allocators", "dp,dp:obs", "--obs-samples", "8"],
        ["prune", "--model", "m", "--out", "o", "--budget", "0.2", "--obs-samples", "8"],  # the handler knows the family's step
        ["compare", "--model", "m", "--out", "o", "--allocators", "dp,uniform", "--obs-samples", "8"],
        ["compare", "--model", "m", "--out", "o", "--allocators", "dp,slimgpt", "--obs-samples", "8", "--table", "t.json"],
    ],
)
def test_options_that_apply_to_obs_pass_the_option_rules(argv):
    _rules(*argv)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["prune", "--uniform", "0.2", "--obs-samples", "8"], "--obs-samples cannot apply unless a plan is pruned by the obs criterion"),
        (["compare", "--allocators", "uniform,flap", "--obs-samples", "8"], "--obs-samples cannot apply unless"),
        (["prune", "--plan", "p.json", "--channel-multiple", "16"], "--channel-multiple cannot apply with --plan"),
    ],
)
def test_what_is_still_moot_isrefused(argv, message):
    with pytest.raises(OptionError, match=message):
        _rules(*argv, "--model", "m", "--out", "o")


@pytest.mark.slow
def test_obs_samples_beside_a_plan_another_criterion_prunes_is_one_line(gap, tiny, tmp_path):
    plan = _dp_plan(gap, tiny, tmp_path, "--criterion", "magnitude")  # a table's own criterion is its DP plan's
    argv = ["prune", "--model", tiny, "--plan", plan, "--obs-samples", "8", *CALIB, "--out", tmp_path / "ck"]
    refused(gap(*argv), "--obs-samples cannot apply: this plan is pruned by criterion magnitude, not obs")
    refused(gap(*argv[:-2], "--criterion", "obs", "--compensate", "refit", "--out", tmp_path / "ck"), "takes --compensate none or bias")
    assert not (tmp_path / "ck").exists()


@pytest.mark.slow
def test_budget_prunes_by_the_family_step_and_refuses_obs_options_where_it_is_not_obs(gap, tiny, make_tiny, tmp_path):
    argv = ["prune", "--budget", "0.3", *RATES, *CALIB, "--json"]
    code, err, out = gap(*argv, "--model", tiny, "--obs-samples", "3", "--out", tmp_path / "ck")
    assert code == 0, err
    summary = json.loads(out)
    assert (summary["criterion"], summary["compensation"], summary["obs_windows"], summary["bias_params"]) == ("obs", "none", 3, 0)
    gemma = make_tiny("gemma3_text", num_attention_heads=4, num_key_value_heads=1, intermediate_size=128)
    folder = tmp_path / "gemma"
    gemma.model.save_pretrained(folder)
    gemma.tokenizer.save_pretrained(folder)
    refused(gap(*argv, "--model", folder, "--obs-samples", "3", "--out", tmp_path / "g"), "this plan is pruned by criterion wanda, not obs")
    assert not (tmp_path / "g").exists()


@pytest.mark.parametrize(
    "value, message",
    [
        ("0", "--obs-samples must be at least 1, got 0"),
        ("-3", "--obs-samples must be at least 1"),
        ("many", "argument --obs-samples: invalid int value: 'many'"),
        ("100000000", "--obs-samples 100,000,000 (windows)"),
    ],
)
@pytest.mark.slow
def test_a_bad_obs_window_count_is_one_line(gap, tiny, tmp_path, value, message):
    argv = ["prune", "--model", tiny, "--uniform", "0.2", "--criterion", "obs", "--obs-samples", value, "--out", tmp_path / "ck"]
    refused(gap(*argv), message)
    assert not (tmp_path / "ck").exists()
