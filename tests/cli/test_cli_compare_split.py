"""``gap compare --split``: perplexity on the report part (the default) or on both parts, the report
number the same whichever way it is asked for; tiny model folder, real text."""

from __future__ import annotations

import csv

import pytest

from gap_engine.cli import main

pytestmark = pytest.mark.slow  # tiny models end to end: make test runs these, make test-fast does not

CALIB = ["--samples", "4", "--seq-len", "64", "--batch-size", "2", "--rates", "0,0.25,0.5"]
EVAL = ["--eval-data", "wiki-sample", "--eval-samples", "2", "--eval-seq-len", "32"]


def _compare(folder, out, capsys, *split: str) -> tuple[dict, str]:
    argv = ["compare", "--model", str(folder), "--budgets", "0.25", "--allocators", "uniform", "--compensate", "none"]
    assert main([*argv, *CALIB, *EVAL, *split, "--out", str(out)]) == 0
    (row,) = list(csv.DictReader(out.open()))
    return row, capsys.readouterr().out


def test_compare_measures_report_by_default_and_both_parts_on_request(make_tiny, tmp_path, capsys):
    lm = make_tiny("llama", num_attention_heads=8, num_key_value_heads=2, intermediate_size=128)
    folder = tmp_path / "tiny"
    lm.model.save_pretrained(folder)
    lm.tokenizer.save_pretrained(folder)
    plain, said = _compare(folder, tmp_path / "plain.csv", capsys)
    assert "held-out windows: report (held-out text reported on)" in said
    both, said = _compare(folder, tmp_path / "both.csv", capsys, "--split", "both")
    assert "selection (held-out text choices are made on) and report" in said
    assert both["ppl_wiki-sample/report"] == plain["ppl_wiki-sample"] != both["ppl_wiki-sample/selection"]
    assert "ppl_wiki-sample" not in both
