"""Bias compensation's biases are per projection: only an o_proj or down_proj that lost inputs
gets one, and a checkpoint records which (config.json ``gap_output_bias``), so its loader builds
exactly those. (Plain transformers and llama.cpp read the same record: tests/export.)"""

from __future__ import annotations

import json

import pytest
import torch

from gap_engine.core.config import WindowSpec
from gap_engine.core.errors import ModelLoadError
from gap_engine.data.windows import calibration_windows
from gap_engine.model.checkpoint import save_pruned
from gap_engine.model.loading import load_model
from gap_engine.model.rateplan import make_plan
from gap_engine.model.slicing import output_bias_layout
from gap_engine.prune.compensation_pass import prune_compensated
from gap_engine.prune.compensations import CompensationSettings
from gap_engine.prune.importance import compute_importance

pytestmark = pytest.mark.slow  # tiny models end to end: make test runs these, make test-fast does not

CALIB = WindowSpec(n_samples=4, seq_len=64, batch_size=2)


def _attention_then_mlp(make_tiny):
    """Block 0 loses heads only, block 1 MLP channels only; bias-compensated."""
    lm = make_tiny("llama", num_attention_heads=8, num_key_value_heads=2, intermediate_size=128)
    scores = compute_importance(lm, calibration_windows(lm.tokenizer, CALIB), "wanda")
    plan = make_plan(lm, [0.5, 0.0], [0.0, 0.25], "wanda", compensation="bias")
    return lm, prune_compensated(lm, plan, scores, CALIB, CompensationSettings(mode="bias"))


def test_only_a_projection_that_lost_inputs_gets_a_bias_and_the_checkpoint_keeps_which(make_tiny, tmp_path):
    lm, result = _attention_then_mlp(make_tiny)
    assert output_bias_layout(lm.adapter, lm.model) == [(True, False), (False, True)]
    assert result.compensation["bias_params"] == 2 * 64
    folder = save_pruned(lm, result.plan, result.kept_indices(), tmp_path / "ckpt", dtype="float32")
    config = json.loads((folder / "config.json").read_text())
    assert config["gap_output_bias"] == [[True, False], [False, True]]
    reloaded = load_model(str(folder))
    assert output_bias_layout(reloaded.adapter, reloaded.model) == [(True, False), (False, True)]
    assert reloaded.param_count() == lm.param_count() == result.params_after
    ids = calibration_windows(lm.tokenizer, CALIB)[:1]
    with torch.no_grad():
        torch.testing.assert_close(reloaded.model(input_ids=ids).logits, lm.model(input_ids=ids).logits, rtol=0, atol=0)


@pytest.mark.parametrize(
    "record",
    [[[True, False]], [[True, "yes"], [False, False]], [[True], [False]], "true", 1],
    ids=["one-block-short", "not-a-boolean", "not-a-pair", "a-string", "a-number"],
)
def test_a_bad_bias_record_is_one_line(make_tiny, tmp_path, record):
    lm, result = _attention_then_mlp(make_tiny)
    folder = save_pruned(lm, result.plan, result.kept_indices(), tmp_path / "ckpt", dtype="float32")
    config = json.loads((folder / "config.json").read_text())
    config["gap_output_bias"] = record
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="gap_output_bias must be true, false or one \\[o_proj, down_proj\\] pair"):
        load_model(str(folder))
