"""The dense model's held-out numbers are measured once per (model, text, windows) and reused
(``evaluate/dense_numbers.py``): every page that shows dense perplexity shows the same value."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gap_engine.core.config import WindowSpec
from gap_engine.evaluate.dense_numbers import dense_key
from gap_engine.evaluate.metrics import EvalSettings, evaluate

SETTINGS = EvalSettings(windows=WindowSpec(n_samples=2, seq_len=16, batch_size=2), throughput=False, generations=0)


@pytest.mark.slow
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


# ---- the dense log-probabilities a KL to dense is measured against ---------------------------------
def _heldout(tokenizer, **changes):
    from gap_engine.data.windows import heldout_windows

    spec = WindowSpec(**({"data": "wiki-sample", "n_samples": 2, "seq_len": 16, "seed": 0} | changes))
    return heldout_windows(tokenizer, spec)


def test_dense_logprobs_are_keyed_by_the_windows_text_seed_and_bos_rule(smol_tokenizer):
    from gap_engine.evaluate.dense_numbers import dense_logprobs_path

    base = _heldout(smol_tokenizer)
    bos = smol_tokenizer.bos_token_id  # SmolLM2's windows start with text; the same count and length with BOS in front:
    with_bos = torch.cat([torch.full((base.shape[0], 1), bos, dtype=base.dtype), base[:, :-1]], dim=1)
    variants = {
        "base": base,
        "another seed": _heldout(smol_tokenizer, seed=1),
        "another text": _heldout(smol_tokenizer, data="news-sample"),
        "a BOS token in front": with_bos,
    }
    assert len({tuple(w.shape) for w in variants.values()}) == 1  # same count x length: only the content differs
    paths = {name: dense_logprobs_path("fp", windows, "float32") for name, windows in variants.items()}
    assert len(set(paths.values())) == len(paths), paths
    assert dense_logprobs_path("fp", base.clone(), "float32") == paths["base"]
    assert dense_logprobs_path("fp", base, "bfloat16") != paths["base"]  # another dtype, another measurement
    assert dense_logprobs_path("fq", base, "float32") != paths["base"]  # other weights


@pytest.mark.slow
def test_dense_logprobs_are_measured_once_per_window_set(make_tiny, tmp_path, monkeypatch):
    import torch.nn.functional as F

    from gap_engine.evaluate.dense_numbers import dense_logprobs

    monkeypatch.setenv("GAP_CACHE_DIR", str(tmp_path))
    lm = make_tiny("llama", initializer_range=0.2)
    windows = _heldout(lm.tokenizer)
    first = dense_logprobs(lm, windows, batch_size=1)
    with torch.no_grad():
        expected = F.log_softmax(lm.model(input_ids=windows).logits.float(), -1)[:, :-1]  # SmolLM2 windows: no BOS
    torch.testing.assert_close(torch.from_numpy(np.array(first)), expected, rtol=1e-5, atol=1e-5)
    with torch.no_grad():  # a cached entry is read back, not recomputed, for the same weights and windows
        lm.model.lm_head.weight.mul_(2.0)
    again = dense_logprobs(lm, windows.clone(), batch_size=2)
    assert np.array_equal(np.array(again), np.array(first))
    other = dense_logprobs(lm, _heldout(lm.tokenizer, seed=1), batch_size=2)
    assert not np.array_equal(np.array(other), np.array(first))
    assert len(list((tmp_path / "dense" / "logprobs").glob("*.npy"))) == 2
    assert not list((tmp_path / "dense" / "logprobs").glob("*.partial*"))
