"""Per-window NLL, KL to dense and top-1 agreement (``evaluate/window_metrics.py``) equal the direct
formula on full distributions, with the dense side measured once and read back from disk."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gap_engine.core.config import WindowSpec
from gap_engine.core.errors import InvariantError
from gap_engine.data.bos import text_start
from gap_engine.data.windows import heldout_windows
from gap_engine.evaluate import window_metrics
from gap_engine.evaluate.window_metrics import dense_windows, head_weight, window_numbers
from gap_engine.model.storage import round_to_storage


def _direct(lm, dense, windows):
    """Per-window (NLL, KL(dense || lm), top-1) from both models' full log-probabilities in float64."""
    start = text_start(lm.tokenizer, windows)
    with torch.no_grad():
        logp = F.log_softmax(lm.model(input_ids=windows).logits[:, start:-1].double(), -1)
        logp_d = F.log_softmax(dense.model(input_ids=windows).logits[:, start:-1].double(), -1)
    targets = windows[:, start + 1 :]
    nll = -logp.gather(-1, targets[..., None])[..., 0].mean(-1)
    kl = (logp_d.exp() * (logp_d - logp)).sum(-1).mean(-1)
    top1 = (logp.argmax(-1) == logp_d.argmax(-1)).double().mean(-1)
    return nll.tolist(), kl.tolist(), top1.tolist()


def _pruned_like(dense):
    """A copy with half of one MLP's channels cut and every weight rounded to bfloat16, as a stored pruned model."""
    pruned = dense.copy()
    layer = pruned.adapter.layers(pruned.model)[0]
    with torch.no_grad():
        down = pruned.adapter.mlp_projections(layer)[2].weight  # (d, I)
        down[:, : down.shape[1] // 2] = 0.0
    round_to_storage(pruned.model, "bfloat16")
    return pruned


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
@pytest.mark.slow
def test_window_numbers_equal_the_direct_formula(family, make_tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("GAP_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(window_metrics, "_MEMO", {})
    dense = make_tiny(family, initializer_range=0.2)
    pruned = _pruned_like(dense)
    assert not torch.equal(head_weight(pruned), head_weight(dense))  # the head the KL is computed with is the pruned model's
    windows = heldout_windows(dense.tokenizer, WindowSpec("news-sample", n_samples=3, seq_len=24))
    measured = window_numbers(pruned, dense, {"news": windows}, batch_size=2)["news"]
    nll, kl, top1 = _direct(pruned, dense, windows)
    assert measured.nll == pytest.approx(nll, abs=1e-5)
    assert measured.kl == pytest.approx(kl, abs=1e-5)
    assert min(kl) > 0.01  # a real difference, not two zeros
    assert measured.top1 == pytest.approx(top1, abs=1e-12)
    itself = window_numbers(dense, dense, {"news": windows})["news"]
    assert itself.kl == pytest.approx([0.0] * 3, abs=1e-5) and itself.top1 == [1.0] * 3


@pytest.mark.slow
def test_dense_side_is_measured_once_then_read_from_disk(make_tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("GAP_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(window_metrics, "_MEMO", {})
    dense = make_tiny("llama", initializer_range=0.2)
    pruned = _pruned_like(dense)
    windows = heldout_windows(dense.tokenizer, WindowSpec("news-sample", n_samples=2, seq_len=16))
    first = window_numbers(pruned, dense, {"news": windows})
    assert len(list((tmp_path / "dense_windows").iterdir())) == 2  # the dense numbers and the expected unembedding
    monkeypatch.setattr(window_metrics, "_MEMO", {})
    calls = []
    monkeypatch.setattr(window_metrics, "_measure_dense", lambda *a: calls.append(a))
    assert window_numbers(pruned, dense, {"news": windows}) == first
    assert calls == []  # read back, not measured
    other = heldout_windows(dense.tokenizer, WindowSpec("news-sample", n_samples=2, seq_len=16, seed=1))
    with pytest.raises(AttributeError):  # other windows: another key, measured (here: the stub returns nothing)
        dense_windows(dense, other, head_weight(pruned))
    assert len(calls) == 1


def test_soft_capped_logits_are_refused(make_tiny):
    lm = make_tiny("gemma3_text", final_logit_softcapping=30.0)
    with pytest.raises(InvariantError, match="soft-capped"):
        head_weight(lm)


@pytest.mark.slow
def test_logits_changed_after_the_head_are_refused(make_tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("GAP_CACHE_DIR", str(tmp_path))
    dense = make_tiny("llama")
    scaled = dense.copy()

    def double_logits(module, args, output):
        output.logits = output.logits * 2.0
        return output

    scaled.model.register_forward_hook(double_logits)
    windows = heldout_windows(dense.tokenizer, WindowSpec("news-sample", n_samples=1, seq_len=16))
    with pytest.raises(InvariantError, match="not its LM head's output"):
        window_numbers(scaled, dense, {"news": windows})


@pytest.mark.slow
def test_the_evaluation_keeps_each_windows_numbers_and_its_means_are_theirs(make_tiny, tmp_path, monkeypatch):
    """``evaluate`` keeps per window what a paired bootstrap between two runs resamples; each equals
    the direct formula, and the report's perplexity and KL are their means."""
    import math

    from gap_engine.evaluate.metrics import EvalSettings, evaluate

    monkeypatch.setenv("GAP_CACHE_DIR", str(tmp_path))
    dense = make_tiny("llama", initializer_range=0.2)
    pruned = _pruned_like(dense)
    spec = WindowSpec("news-sample", n_samples=3, seq_len=24, batch_size=2)
    report = evaluate(pruned, dense, EvalSettings(windows=spec, throughput=False, generations=0))
    kept = report.per_window["news-sample"]
    nll, kl, top1 = _direct(pruned, dense, heldout_windows(dense.tokenizer, spec))
    assert kept["nll"] == pytest.approx(nll, abs=1e-5) and kept["kl"] == pytest.approx(kl, abs=1e-5)
    assert kept["top1"] == pytest.approx(top1, abs=1e-12) and len(kept["dense_nll"]) == 3
    assert report.perplexity["news-sample"] == pytest.approx(math.exp(sum(nll) / 3), rel=1e-5)
    assert report.kl_to_dense["news-sample"] == pytest.approx(sum(kl) / 3, abs=1e-6)
