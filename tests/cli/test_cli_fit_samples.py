"""``--fit-samples``: the compensation after the cut fitted on more calibration windows than the table's, on
``gap prune`` and ``gap compare``; the units stay those the table's windows chose; ``--fit-weighting``: its tokens
counted through the norms after the output projections (Gemma 3); every refusal one line, exit 2.

Tiny random two-layer Llama folders (8 query heads in 2 KV groups, MLP 128) with the real SmolLM2 tokenizer;
4 x 64 calibration tokens (a refit of the widest projection needs 128).
"""

from __future__ import annotations

import csv
import json
from dataclasses import replace

import pytest
import torch
from cli_fixtures import CALIB, gap, refused, tiny  # noqa: F401
from safetensors.torch import load_file

from gap_engine.core.errors import CompensationError
from gap_engine.prune.compensations import (
    NO_COMPENSATION,
    CompensationSettings,
    default_for,
    family_weighting,
    fit_window_count,
    with_family_fit,
)


def test_the_windows_are_part_of_the_settings_and_recorded_only_when_asked():
    """A compensation that does not size its windows records what it did before (table and cache keys unchanged)."""
    assert CompensationSettings(mode="bias").to_dict() == {"mode": "bias", "damping": 0.01, "target": "pruned"}
    assert CompensationSettings(mode="refit", samples=64).to_dict()["samples"] == 64
    for bad in (0, -3, 2.5, True):
        with pytest.raises(CompensationError, match="whole number of windows"):
            CompensationSettings(mode="bias", samples=bad).validate()  # type: ignore[arg-type]
    with pytest.raises(CompensationError, match="none fits nothing"):
        CompensationSettings(mode="none", samples=8).validate()


def test_a_family_sets_the_fewest_windows_a_fit_reads_when_none_are_asked():
    """Gemma 3 fits on at least 64 windows (its evidence: bench/results/refit_windows_gemma.md), every other family on
    the calibration's own; a count asked for is taken as it is."""
    assert [fit_window_count("gemma3_text", n) for n in (4, 16, 64, 128)] == [64, 64, 64, 128]
    assert [fit_window_count(t, 16) for t in ("llama", "qwen2", "qwen3", None, "unknown-type")] == [16] * 5
    assert fit_window_count("gemma3_text", 16, 8) == 8
    # spelled out on the settings only where the floor reads more; nothing fitted or a count asked stays as it is
    fitted = CompensationSettings(mode="bias+refit")
    assert with_family_fit(fitted, "gemma3_text", 16).samples == 64
    assert with_family_fit(fitted, "gemma3_text", 128).samples is None
    assert with_family_fit(fitted, "llama", 16).samples is None
    assert with_family_fit(CompensationSettings(mode="bias", samples=8), "gemma3_text", 16).samples == 8
    assert with_family_fit(CompensationSettings(mode="none"), "gemma3_text", 16).samples is None


def test_a_family_sets_how_a_fit_counts_its_tokens_when_none_is_asked():
    """Gemma 3 fits through its post-norms (its evidence: bench/results/quality_gemma_norm.md, selection part), every
    other family counts tokens alike; a weighting asked for is taken as it is, and nothing fitted weighs nothing."""
    assert [family_weighting(t) for t in ("gemma3_text", "llama", "qwen2", "qwen3", None)] == ["output-norm"] + ["tokens"] * 4
    unsettled = CompensationSettings(mode="bias+refit")
    assert unsettled.weighting is None and not unsettled.weighted and "weighting" not in unsettled.to_dict()
    assert with_family_fit(unsettled, "gemma3_text", 64).weighting == "output-norm"
    assert with_family_fit(unsettled, "gemma3_text", 64).weighted
    assert with_family_fit(unsettled, "llama", 64).weighting == "tokens"
    assert with_family_fit(replace(unsettled, weighting="tokens"), "gemma3_text", 64).weighting == "tokens"
    assert with_family_fit(NO_COMPENSATION, "gemma3_text", 64) == NO_COMPENSATION
    assert default_for("wanda", "gemma3_text") == CompensationSettings(mode="bias+refit", weighting="output-norm")
    assert default_for("wanda", "llama").weighting == "tokens" and default_for("obs", "gemma3_text") == NO_COMPENSATION


@pytest.mark.slow
def test_a_gemma_prune_fits_on_its_family_windows_and_says_so(gap, make_tiny, tmp_path):
    """Nothing asked: the family's compensation (bias+refit) is fitted through its output norms on 64 windows, not the
    table's 4, and the summary and the checkpoint's record say so, as if --fit-samples 64 had been given (the same weights)."""
    folder = tmp_path / "tiny-gemma"
    lm = make_tiny("gemma3_text", num_attention_heads=8, num_key_value_heads=2, intermediate_size=128)
    lm.model.save_pretrained(folder)
    lm.tokenizer.save_pretrained(folder)
    common = ["prune", "--model", folder, "--uniform", "0.25", "--criterion", "wanda", "--save-dtype", "float32", *CALIB, "--json"]
    code, err, out = gap(*common, "--out", tmp_path / "default")
    assert code == 0, err
    summary = json.loads(out)
    assert (summary["compensation"], summary["fit_windows"], summary["fit_weighting"]) == ("bias+refit", 64, "output-norm")
    marker = json.loads((tmp_path / "default" / "gap_pruned.json").read_text())
    assert marker["compensation"]["samples"] == 64 and marker["compensation"]["windows"]["n_samples"] == 64
    assert marker["compensation"]["weighting"] == "output-norm"
    code, err, out = gap(*common, "--fit-samples", "64", "--out", tmp_path / "asked")
    assert code == 0, err
    default, asked = (load_file(tmp_path / name / "model.safetensors") for name in ("default", "asked"))
    assert default.keys() == asked.keys() and all(torch.equal(default[name], asked[name]) for name in default)


@pytest.mark.slow
def test_prune_fits_the_refit_on_the_windows_asked_and_keeps_the_same_units(gap, tiny, tmp_path):
    common = ["prune", "--model", tiny, "--uniform", "0.25", "--criterion", "wanda", "--compensate", "bias+refit"]
    common += ["--save-dtype", "float32", *CALIB, "--json"]
    code, err, out = gap(*common, "--fit-samples", "12", "--out", tmp_path / "wide")
    assert code == 0, err
    summary = json.loads(out)
    assert (summary["compensation"], summary["fit_windows"]) == ("bias+refit", 12)
    code, err, out = gap(*common, "--out", tmp_path / "own")
    assert code == 0, err
    assert json.loads(out)["fit_windows"] == 4  # the table's own windows

    marker = json.loads((tmp_path / "wide" / "gap_pruned.json").read_text())
    assert marker["compensation"]["samples"] == 12 and marker["compensation"]["windows"]["n_samples"] == 12
    kept = {name: json.loads((tmp_path / name / "kept_indices.json").read_text()) for name in ("wide", "own")}
    assert kept["wide"] == kept["own"]  # the units are chosen on the table's 4 windows either way
    wide, own = (load_file(tmp_path / name / "model.safetensors") for name in ("wide", "own"))
    assert wide.keys() == own.keys() and any(name.endswith("down_proj.bias") for name in wide)
    assert all(wide[name].shape == own[name].shape for name in wide)
    assert not all(torch.equal(wide[name], own[name]) for name in wide if name.endswith(("down_proj.weight", "down_proj.bias")))


@pytest.mark.slow
def test_compare_fits_every_compensated_row_on_the_windows_asked_and_obs_on_its_own(gap, tiny, tmp_path):
    out = tmp_path / "c.csv"
    argv = ["compare", "--model", tiny, "--budgets", "0.3", "--allocators", "uniform,slimgpt", "--rates", "0,0.25,0.5,0.75"]
    argv += ["--estimator", "fisher", *CALIB, "--fit-samples", "8", "--eval-samples", "2", "--eval-seq-len", "32", "--out", out]
    code, err, _ = gap(*argv)
    assert code == 0, err
    rows = list(csv.DictReader(out.open()))
    assert [(r["allocator"], r["compensation"], r["fit_windows"], r["obs_windows"]) for r in rows] == [
        ("uniform", "bias", "8", ""),
        ("slimgpt", "none", "", "16"),  # OBS's update is its compensation, on its own default windows
    ]


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--criterion", "obs", "--fit-samples", "8"], "--fit-samples cannot apply: the units are chosen and updated by obs"),
        (["--compensate", "none", "--fit-samples", "8"], "--fit-samples cannot apply: nothing is compensated"),
        (["--fit-samples", "0"], "--fit-samples must be at least 1"),
        (["--compensate", "none", "--fit-weighting", "tokens"], "--fit-weighting cannot apply: nothing is compensated"),
        (["--compensate", "bias", "--fit-weighting", "output-norm"], "--fit-weighting output-norm fits through the norms"),
    ],
)
@pytest.mark.slow
def test_a_fit_window_count_that_cannot_apply_is_one_line(gap, tiny, tmp_path, extra, message):
    argv = ["prune", "--model", tiny, "--uniform", "0.25", *CALIB, *extra, "--out", tmp_path / "ck"]
    refused(gap(*argv), message)
    assert not (tmp_path / "ck").exists()


@pytest.mark.slow
def test_a_gemma_prune_fitted_through_the_output_norms_says_so_everywhere(gap, make_tiny, tmp_path):
    """Gemma 3 fits through its output norms unless told otherwise: nothing asked gives the weights
    --fit-weighting output-norm gives, and the summary, the checkpoint's record and its card say how the fit counted
    tokens; --fit-weighting tokens counts them alike, on the same units, into other weights."""
    folder = tmp_path / "tiny-gemma"
    lm = make_tiny("gemma3_text", num_attention_heads=8, num_key_value_heads=2, intermediate_size=128)
    lm.model.save_pretrained(folder)
    lm.tokenizer.save_pretrained(folder)
    common = ["prune", "--model", folder, "--uniform", "0.25", "--criterion", "wanda", "--compensate", "bias"]
    common += ["--save-dtype", "float32", *CALIB, "--fit-samples", "4", "--json"]
    for name, extra in (("norm", ["--fit-weighting", "output-norm"]), ("default", [])):
        code, err, out = gap(*common, *extra, "--out", tmp_path / name)
        assert code == 0, err
        assert json.loads(out)["fit_weighting"] == "output-norm"
        marker = json.loads((tmp_path / name / "gap_pruned.json").read_text())
        assert marker["compensation"]["weighting"] == "output-norm"
        assert "weighted through the norms after o_proj and down_proj" in (tmp_path / name / "README.md").read_text()
    code, err, out = gap(*common, "--fit-weighting", "tokens", "--out", tmp_path / "tokens")
    assert code == 0, err
    assert "fit_weighting" not in json.loads(out)
    assert "weighting" not in json.loads((tmp_path / "tokens" / "gap_pruned.json").read_text())["compensation"]
    kept = {name: json.loads((tmp_path / name / "kept_indices.json").read_text()) for name in ("norm", "default", "tokens")}
    assert kept["norm"] == kept["default"] == kept["tokens"]
    norm, default, tokens = (load_file(tmp_path / name / "model.safetensors") for name in ("norm", "default", "tokens"))
    assert norm.keys() == default.keys() and all(torch.equal(norm[name], default[name]) for name in norm)
    assert not all(torch.equal(norm[name], tokens[name]) for name in norm if name.endswith("down_proj.bias"))
