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
from gap_engine.core.config import DEFAULT_COMPENSATION
from gap_engine.model.loading import load_model

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
def test_prune_with_compensation_records_it_in_the_checkpoint(make_tiny, tmp_path, capsys, family):
    folder = _folder(make_tiny, tmp_path, family)
    out = tmp_path / "pruned"
    assert main(["prune", "--model", str(folder), "--uniform", "0.3", "--compensate", "bias", "--out", str(out), "--json", *CALIB]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["compensation"] == "bias"
    marker = json.loads((out / "gap_pruned.json").read_text())
    assert marker["compensation"]["mode"] == "bias" and marker["compensation"]["windows"]["n_samples"] == 4
    assert json.loads((out / "config.json").read_text())["gap_output_bias"] is True
    assert marker["param_count"] == summary["params_after"] == load_model(str(out)).param_count()


def test_prune_without_compensate_adds_the_default_bias(make_tiny, tmp_path, capsys):
    folder = _folder(make_tiny, tmp_path, "llama")
    out = tmp_path / "pruned"
    assert main(["prune", "--model", str(folder), "--uniform", "0.3", "--out", str(out), "--json", *CALIB]) == 0
    assert json.loads(capsys.readouterr().out)["compensation"] == DEFAULT_COMPENSATION == "bias"
    assert json.loads((out / "config.json").read_text())["gap_output_bias"] is True


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


def test_compare_prunes_every_plan_with_the_compensation(make_tiny, tmp_path, capsys):
    folder = _folder(make_tiny, tmp_path, "llama")
    out = tmp_path / "compare.csv"
    argv = ["compare", "--model", str(folder), "--budgets", "0.2", "--allocators", "dp,uniform", "--compensate", "refit"]
    argv += ["--rates", "0,0.25,0.5", "--eval-samples", "2", "--eval-seq-len", "32", "--out", str(out), *CALIB]
    assert main(argv) == 0
    assert "compensation: refit; the fisher table estimates the uncompensated model" in capsys.readouterr().out
    rows = list(csv.DictReader(out.open()))
    assert [row["compensation"] for row in rows] == ["refit", "refit"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--uniform", "0.3", "--compensate", "refit", "--samples", "1", "--seq-len", "16"], "give at least 128"),
        (["--budget", "0.2", "--rounds", "2", "--compensate", "refit", *CALIB], "use --rounds 1"),
        (["--uniform", "0.3", "--compensate", "stretch", *CALIB], "invalid choice: 'stretch'"),
    ],
)
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


def test_a_singular_system_is_one_line_and_writes_nothing(make_tiny, tmp_path, capsys):
    folder = _folder(make_tiny, tmp_path, "llama", dead_attention=True)
    out = tmp_path / "never"
    line = _one_line(capsys, ["prune", "--model", str(folder), "--uniform", "0.3", "--compensate", "refit", "--out", str(out), *CALIB])
    assert "block 0 o_proj" in line and "singular" in line
    assert not out.exists()


def test_a_table_estimate_cannot_include_compensation(make_tiny, tmp_path, capsys):
    folder = _folder(make_tiny, tmp_path, "llama")
    line = _one_line(capsys, ["table", "--model", str(folder), "--compensate", "refit", "--out", str(tmp_path / "t.json"), *CALIB])
    assert "the fisher estimate measures no cell" in line and not (tmp_path / "t.json").exists()
