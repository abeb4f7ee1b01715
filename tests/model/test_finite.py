"""A non-finite measurement is an error, never a printed number: a model that can only
give NaN is refused as it loads, and a measurement that still comes out non-finite names its cause.
Tiny two-layer Llamas with the real tokenizer; no built-in model weights are loaded."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import tiny_config

from gap_engine.core.config import WindowSpec
from gap_engine.core.errors import GapError, ModelLoadError, TableError
from gap_engine.evaluate.metrics import EvalSettings, evaluate
from gap_engine.model.loaded import LoadedModel
from gap_engine.tables.artefact import TableSpec
from gap_engine.tables.build import measure_table

WINDOWS = WindowSpec("news-sample", n_samples=2, seq_len=16, batch_size=2)


def tiny_model(**overrides):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config("llama", **overrides), dtype=torch.float32)


def test_a_nan_weight_is_refused_as_the_model_loads(smol_tokenizer):
    model = tiny_model()
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[3, 4] = math.nan
        model.model.layers[0].self_attn.q_proj.weight[0, 0] = math.inf
    with pytest.raises(ModelLoadError, match=r"2 non-finite values, first in model.layers.0.self_attn.q_proj.weight"):
        LoadedModel.from_transformers(model, smol_tokenizer, "tiny", "config")


def test_a_negative_norm_epsilon_is_refused_as_the_model_loads(smol_tokenizer):
    model = tiny_model()
    model.config.rms_norm_eps = -1.0  # sqrt(variance - 1): NaN for every small variance
    with pytest.raises(ModelLoadError, match="rms_norm_eps is -1.0, not a small positive number"):
        LoadedModel.from_transformers(model, smol_tokenizer, "tiny", "config")


@pytest.fixture
def broken_after_load(smol_tokenizer):
    """A tiny model that loaded fine and holds a NaN since (weights changed in place)."""
    lm = LoadedModel.from_transformers(tiny_model(), smol_tokenizer, "tiny", "config")
    with torch.no_grad():
        lm.model.model.layers[0].mlp.down_proj.weight[0, 0] = math.nan
    return lm


def test_a_nan_perplexity_is_an_error_naming_the_weight(broken_after_load):
    settings = EvalSettings(windows=WindowSpec("news-sample", n_samples=1, seq_len=16), throughput=False, generations=0)
    with pytest.raises(GapError, match=r"mean NLL of tiny on news-sample is nan, not a number: .*model.layers.0.mlp.down_proj.weight"):
        evaluate(broken_after_load, None, settings)


@pytest.mark.parametrize("estimator", ["fisher", "exact"])
@pytest.mark.slow
def test_a_nan_table_cell_is_an_error_not_a_table(broken_after_load, estimator):
    from gap_engine.data.windows import calibration_windows

    spec = TableSpec(windows=WINDOWS, estimator=estimator, objective="kl", rate_grid=(0.0, 0.5))
    windows = calibration_windows(broken_after_load.tokenizer, WINDOWS)
    with pytest.raises(TableError, match="not .*finite.*model.layers.0.mlp.down_proj.weight"):
        measure_table(broken_after_load, spec, windows)
