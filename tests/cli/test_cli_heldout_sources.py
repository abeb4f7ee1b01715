"""The held-out-only built-in sources on the command line: measured by ``gap eval --data`` and
``gap compare --eval-data``, refused in one line (exit 2, before anything loads) wherever --data
is calibration or training text. Tiny model folder, real text."""

from __future__ import annotations

import csv
import json
import math

import pytest

from gap_engine.cli import main

SOURCES = "newsgroups,wiki-tables"


@pytest.fixture
def tiny_folder(make_tiny, tmp_path):
    lm = make_tiny("llama", num_attention_heads=8, num_key_value_heads=2, intermediate_size=128)
    folder = tmp_path / "tiny"
    lm.model.save_pretrained(folder)
    lm.tokenizer.save_pretrained(folder)
    return folder


@pytest.mark.slow
def test_eval_measures_each_heldout_only_source(tiny_folder, capsys):
    argv = ["eval", "--model", str(tiny_folder), "--data", SOURCES, "--samples", "2", "--seq-len", "32", "--no-throughput", "--json"]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report["perplexity"]) == {"newsgroups", "wiki-tables"}
    assert all(math.isfinite(ppl) and ppl > 1 for ppl in report["perplexity"].values())


@pytest.mark.slow
def test_compare_measures_both_parts_of_each_heldout_only_source(tiny_folder, tmp_path, capsys):
    out = tmp_path / "compare.csv"
    argv = ["compare", "--model", str(tiny_folder), "--budgets", "0.25", "--allocators", "uniform", "--compensate", "none"]
    calibration = ["--samples", "4", "--seq-len", "64", "--batch-size", "2", "--rates", "0,0.25,0.5"]
    heldout = ["--eval-data", SOURCES, "--eval-samples", "2", "--eval-seq-len", "32", "--split", "both"]
    assert main([*argv, *calibration, *heldout, "--out", str(out)]) == 0
    (row,) = list(csv.DictReader(out.open()))
    for source in SOURCES.split(","):
        assert float(row[f"ppl_{source}/selection"]) != float(row[f"ppl_{source}/report"]) > 1


@pytest.mark.slow
def test_compare_calibrates_every_allocator_on_mixed_text(tiny_folder, tmp_path):
    out = tmp_path / "compare.csv"
    argv = ["compare", "--model", str(tiny_folder), "--budgets", "0.25", "--allocators", "dp,flap,slimgpt", "--compensate", "bias"]
    calibration = ["--data", "wiki-sample,news-sample", "--samples", "3", "--seq-len", "32", "--rates", "0,0.25,0.5"]
    heldout = ["--eval-data", "news-sample", "--eval-samples", "2", "--eval-seq-len", "32"]
    assert main([*argv, *calibration, *heldout, "--out", str(out)]) == 0
    rows = list(csv.DictReader(out.open()))
    assert [row["allocator"] for row in rows] == ["dp", "flap", "slimgpt"]
    assert all(math.isfinite(float(row["ppl_news-sample"])) for row in rows)


@pytest.mark.parametrize(
    "argv",
    [
        ["table", "--model", "smollm2-135m", "--data", "newsgroups", "--out", "{out}.json"],
        ["table", "--model", "smollm2-135m", "--data", "wiki-sample,newsgroups", "--out", "{out}.json"],
        ["compare", "--model", "smollm2-135m", "--data", "wiki-tables,news-sample", "--out", "{out}.csv"],
        ["table", "--model", "smollm2-135m", "--data", "wiki-tables", "--dry-run"],
        ["compare", "--model", "smollm2-135m", "--data", "wiki-tables", "--out", "{out}.csv"],
        ["prune", "--model", "smollm2-135m", "--uniform", "0.2", "--data", "newsgroups", "--out", "{out}"],
        ["recover", "--model", "smollm2-135m", "--method", "lora", "--steps", "1", "--data", "news-sample,wiki-tables", "--out", "{out}"],
    ],
)
def test_heldout_only_source_is_refused_as_calibration_text_in_one_line(argv, tmp_path, capsys):
    out = tmp_path / "out"
    assert main([part.format(out=out) for part in argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("gap: error: --data: text source '")
    assert "is held-out text only and is never read for calibration or training" in err[0]
    assert list(tmp_path.iterdir()) == []  # nothing written, nothing half-written


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["table", "--data", "wiki-sample,news-sample", "--samples", "1", "--out", "{out}.json"],
            "names 2 sources but reads only 1 window:",
        ),
        (["compare", "--data", "news-sample,wiki-sample,news-sample", "--out", "{out}.csv"], "names 'news-sample' twice"),
        (
            ["compare", "--data", "wiki-sample,news-sample", "--allocators", "dp:obs", "--obs-samples", "1", "--out", "{out}.csv"],
            "(--obs-samples 1)",
        ),
        (["prune", "--uniform", "0.2", "--data", "wiki-sample,news-sample", "--samples", "1", "--out", "{out}"], "reads only 1 window"),
    ],
)
def test_calibration_text_that_cannot_mix_is_refused_in_one_line(argv, message, tmp_path, capsys):
    out = tmp_path / "out"
    assert main([argv[0], "--model", "smollm2-135m", *(part.format(out=out) for part in argv[1:])]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("gap: error: --data: calibration text ") and message in err[0]
    assert list(tmp_path.iterdir()) == []
