"""A plan's recorded attention shape is honoured by every path that cuts or fits units.

8 query heads in 2 KV groups: rate 0.6 keeps the size of 4 (heads + KV groups), which both
(1 group of 3) and (2 groups of 1) have; the rate rounds to (1, 3), an iterative plan may record
(2, 1). Surgery, masking, compensation and the ``obs`` path must all take (2, 1) from the plan.
"""

from __future__ import annotations

import json

import pytest
import torch

from gap_engine.cli import main
from gap_engine.core.config import WindowSpec
from gap_engine.data.windows import calibration_windows
from gap_engine.model.loading import load_model
from gap_engine.model.rateplan import make_plan
from gap_engine.prune.compensation_pass import compensate_blocks, install_biases, removed_per_block
from gap_engine.prune.compensations import CompensationSettings
from gap_engine.prune.importance import compute_importance
from gap_engine.prune.sequential import obs_prune
from gap_engine.prune.surgery import apply_plan, masked_plan

WIDE = dict(num_attention_heads=8, num_key_value_heads=2, intermediate_size=128)
CALIB = WindowSpec(n_samples=4, seq_len=64, batch_size=2)
CALIB_FLAGS = ["--samples", "4", "--seq-len", "64", "--batch-size", "2"]  # the same windows on the command line
RECORDED = [[2, 1], [2, 4]]  # block 0: the tie's other shape; block 1: whole


def _plan(lm, criterion="wanda"):
    return make_plan(lm, [0.6, 0.0], [0.25, 0.0], criterion, attention_shapes=[list(s) for s in RECORDED])


def _surgery_removed(lm, plan, scores):
    """The heads and channels surgery removes from each block of a copy of ``lm``."""
    copy = lm.copy()
    result = apply_plan(copy, plan, scores)
    geoms = [lm.adapter.geometry(layer) for layer in lm.adapter.layers(lm.model)]
    return [
        (tuple(sorted(set(range(g.n_heads)) - set(heads))), tuple(sorted(set(range(g.intermediate_size)) - set(channels))))
        for g, heads, channels in zip(geoms, result.kept_heads, result.kept_channels)
    ]


def test_the_rate_alone_rounds_to_the_other_shape(make_tiny):
    lm = make_tiny("llama", **WIDE)
    scores = compute_importance(lm, calibration_windows(lm.tokenizer, CALIB), "wanda")
    plan = _plan(lm)
    unrecorded = make_plan(lm, plan.attention_rates, plan.mlp_rates, "wanda")
    assert len(_surgery_removed(lm, unrecorded, scores)[0][0]) == 5  # (1, 3): 3 heads kept
    assert len(_surgery_removed(lm, plan, scores)[0][0]) == 6  # (2, 1): 2 heads kept


@pytest.mark.slow
def test_compensation_fits_the_units_surgery_removes(make_tiny):
    lm = make_tiny("llama", **WIDE)
    scores = compute_importance(lm, calibration_windows(lm.tokenizer, CALIB), "wanda")
    plan = _plan(lm)
    assert removed_per_block(lm, plan, scores) == _surgery_removed(lm, plan, scores)


@pytest.mark.slow
def test_masking_a_plan_zeroes_what_surgery_cuts(make_tiny):
    lm = make_tiny("llama", **WIDE)
    ids = calibration_windows(lm.tokenizer, CALIB)
    scores = compute_importance(lm, ids, "wanda")
    plan = _plan(lm)
    sliced = lm.copy()
    apply_plan(sliced, plan, scores)
    with torch.no_grad():
        want = sliced.model(input_ids=ids, use_cache=False).logits
        with masked_plan(lm, plan.attention_rates, plan.mlp_rates, scores, plan.channel_multiple, plan.attention_shapes):
            got = lm.model(input_ids=ids, use_cache=False).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_obs_prunes_to_the_recorded_shape(make_tiny):
    lm = make_tiny("llama", **WIDE)
    plan = _plan(lm, "obs")
    result = obs_prune(lm, plan, calibration_windows(lm.tokenizer, CALIB), batch_size=2)
    assert [len(kv) for kv in result.kept_kv_heads] == [2, 2]
    assert [len(heads) for heads in result.kept_heads] == [2, 8]
    assert result.params_after == plan.params["pruned_total"]


@pytest.mark.slow
def test_gap_prune_of_a_recorded_plan_compensates_what_it_cuts(make_tiny, tmp_path, capsys):
    """``gap prune --plan`` with the default ``bias``: the saved model is the dense one pruned by
    surgery and compensated for exactly the units surgery removed."""
    lm = make_tiny("llama", **WIDE)
    folder = tmp_path / "tiny"
    lm.model.save_pretrained(folder)
    lm.tokenizer.save_pretrained(folder)
    dense = load_model(str(folder))
    plan = _plan(dense)
    plan.save(tmp_path / "plan.json")
    out = tmp_path / "pruned"
    argv = ["prune", "--model", str(folder), "--plan", str(tmp_path / "plan.json"), "--out", str(out), "--save-dtype", "float32"]
    assert main([*argv, "--json", *CALIB_FLAGS]) == 0
    assert json.loads(capsys.readouterr().out)["compensation"] == "bias"

    # the reference: surgery's own removed units, compensated, then cut
    ids = calibration_windows(dense.tokenizer, CALIB)
    scores = compute_importance(dense, ids, "wanda", CALIB.batch_size)
    removed = _surgery_removed(dense, plan, scores)
    fits = compensate_blocks(dense, removed, ids, CALIB.batch_size, CompensationSettings(mode="bias"))
    apply_plan(dense, plan, scores)
    install_biases(dense, fits)

    shipped = load_model(str(out))
    assert [len(heads) for heads in json.loads((out / "kept_indices.json").read_text())["kept_heads"]] == [2, 8]
    with torch.no_grad():
        want = dense.model(input_ids=ids, use_cache=False).logits
        got = shipped.model(input_ids=ids, use_cache=False).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
