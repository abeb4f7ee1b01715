"""The dense model's held-out numbers are measured once per (model, text, windows) and reused
(``evaluate/dense_numbers.py``): every page that shows dense perplexity shows the same value."""

from __future__ import annotations

import torch

from gap_engine.core.config import WindowSpec
from gap_engine.evaluate.dense_numbers import dense_key
from gap_engine.evaluate.metrics import EvalSettings, evaluate

SETTINGS = EvalSettings(windows=WindowSpec(n_samples=2, seq_len=16, batch_size=2), throughput=False, generations=0)


def test_dense_perplexity_is_measured_once_and_reused_whatever_path_measures_it_again(make_tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("GAP_CACHE_DIR", str(tmp_path))
    dense = make_tiny("llama", initializer_range=0.2)
    pruned = dense.copy()
    with torch.no_grad():
        pruned.model.model.layers[0].mlp.down_proj.weight.mul_(0.5)
    first = evaluate(pruned, dense, SETTINGS)
    assert first.settings["heldout_split"] == "report"  # an evaluation reads, and says it read, the report part
    # The same dense model measured along another path (another page's dtype or batch changes the
    # last digits; here its weights are nudged so the difference cannot hide in rounding).
    other_path = dense.copy()
    with torch.no_grad():
        other_path.model.model.layers[1].mlp.up_proj.weight.mul_(1.01)
    assert other_path.fingerprint == dense.fingerprint  # copies keep the fingerprint of the weights they were loaded with
    again = evaluate(pruned, other_path, SETTINGS)
    source = SETTINGS.windows.data
    assert again.dense["perplexity"][source] == first.dense["perplexity"][source]
    assert again.kl_to_dense[source] != first.kl_to_dense[source]  # the comparison itself is measured anew
    assert len(list((tmp_path / "dense").glob("*.json"))) == 1
    longer = evaluate(
        pruned, dense, EvalSettings(windows=WindowSpec(n_samples=2, seq_len=24, batch_size=2), throughput=False, generations=0)
    )
    assert longer.dense["perplexity"][source] != first.dense["perplexity"][source]  # other windows: another entry
    assert len(list((tmp_path / "dense").glob("*.json"))) == 2


def test_the_key_is_the_fingerprint_and_the_exact_tokens():
    windows = torch.arange(32).reshape(2, 16)
    assert dense_key("abc", windows) == dense_key("abc", windows.clone())
    assert dense_key("abc", windows) != dense_key("abd", windows)
    assert dense_key("abc", windows) != dense_key("abc", windows.reshape(4, 8))
    assert dense_key("abc", windows, "float32") != dense_key("abc", windows, "bfloat16")  # two measurements
    shifted = windows.clone()
    shifted[1, 3] += 1
    assert dense_key("abc", windows) != dense_key("abc", shifted)
