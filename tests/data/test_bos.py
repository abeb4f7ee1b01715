"""The window convention: every window starts the way the model was trained to read.

A model whose tokenizer prepends its BOS token (Gemma, Llama 3) gets it at the start of
every calibration and held-out window, and that position is never counted: not as a loss
target, not as the sole context of a prediction, not in activation statistics. Tiny
models use a copy of the real SmolLM2 tokenizer told to prepend ``<|im_start|>`` the way
Llama 3's tokenizer prepends ``<|begin_of_text|>``; the built-in models are checked
against their own tokenizers.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from reference import naive_build_table
from tokenizers import processors

from gap_engine.core.config import WindowSpec
from gap_engine.data.bos import bos_token_id, text_start, window_start
from gap_engine.data.windows import calibration_windows, heldout_windows, load_corpus
from gap_engine.evaluate.metrics import compare_logits, mean_nll
from gap_engine.pipeline.stages import loss_table
from gap_engine.prune.importance import input_statistics
from gap_engine.tables import cache
from gap_engine.tables.artefact import TableSpec, table_key
from gap_engine.tables.build import measure_table

SPEC = WindowSpec("wiki-sample", n_samples=3, seq_len=24, batch_size=2)
GRID4 = (0.0, 0.25, 0.5, 0.75)


@pytest.fixture(scope="module")
def bos_tokenizer(smol_tokenizer):
    """The real SmolLM2 tokenizer, set to prepend <|im_start|> to every encoded text."""
    tokenizer = copy.deepcopy(smol_tokenizer)
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<|im_start|> $A", pair="<|im_start|> $A $B", special_tokens=[("<|im_start|>", 1)]
    )
    return tokenizer


@pytest.fixture
def bos_lm(make_tiny, bos_tokenizer):
    return dataclasses.replace(make_tiny("llama", initializer_range=0.2), tokenizer=bos_tokenizer)


@pytest.mark.slow
def test_windows_start_with_bos_exactly_when_the_tokenizer_adds_it(smol_tokenizer, bos_tokenizer):
    assert bos_token_id(smol_tokenizer) is None and window_start(smol_tokenizer) == "text"
    assert bos_token_id(bos_tokenizer) == 1 and window_start(bos_tokenizer) == "bos"
    plain = calibration_windows(smol_tokenizer, SPEC)
    with_bos = calibration_windows(bos_tokenizer, SPEC)
    assert plain.shape == (3, 24) and with_bos.shape == (3, 25)
    assert bool((with_bos[:, 0] == 1).all()) and torch.equal(with_bos[:, 1:], plain)  # the same text tokens
    assert text_start(smol_tokenizer, plain) == 0 and text_start(bos_tokenizer, with_bos) == 1
    assert text_start(bos_tokenizer, plain) == 0  # windows without BOS have nothing to skip
    held = heldout_windows(bos_tokenizer, SPEC)
    assert held.shape == (3, 25) and bool((held[:, 0] == 1).all())


@pytest.mark.slow
def test_evaluation_never_counts_the_bos_position(bos_lm, make_tiny):
    windows = heldout_windows(bos_lm.tokenizer, SPEC)  # (3, 25)
    with torch.inference_mode():
        logits = bos_lm.model(input_ids=windows).logits  # (3, 25, V)
    by_hand = F.cross_entropy(logits[:, 1:-1].reshape(-1, logits.shape[-1]), windows[:, 2:].reshape(-1))
    assert mean_nll(bos_lm, windows) == pytest.approx(float(by_hand), rel=1e-5)
    other = dataclasses.replace(make_tiny("llama", seed=3, initializer_range=0.2), tokenizer=bos_lm.tokenizer)
    nll_m, nll_d, kl, _ = compare_logits(other, bos_lm, windows)
    assert nll_d == pytest.approx(float(by_hand), rel=1e-5)
    with torch.inference_mode():
        logp_m = F.log_softmax(other.model(input_ids=windows).logits[:, 1:-1], -1)
    logp_d = F.log_softmax(logits[:, 1:-1], -1)
    assert kl == pytest.approx(float((logp_d.exp() * (logp_d - logp_m)).sum(-1).mean()), rel=1e-4)


@pytest.mark.slow
def test_activation_statistics_skip_the_bos_position(bos_lm):
    windows = calibration_windows(bos_lm.tokenizer, SPEC)
    down = bos_lm.adapter.mlp_projections(bos_lm.adapter.layers(bos_lm.model)[0])[2]
    stats = input_statistics(bos_lm, windows, {"down": down})["down"]
    assert stats.count == 3 * 24  # the text positions only
    captured = []
    handle = down.register_forward_pre_hook(lambda module, args: captured.append(args[0][:, 1:].reshape(-1, args[0].shape[-1])))
    with torch.inference_mode():
        bos_lm.model(input_ids=windows)
    handle.remove()
    expected = torch.cat(captured).double().pow(2).sum(0).sqrt()
    torch.testing.assert_close(stats.l2(), expected, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("objective", ["nll", "kl"])
@pytest.mark.slow
def test_exact_table_on_bos_windows_equals_the_naive_build(bos_lm, objective):
    spec = TableSpec(windows=SPEC, rate_grid=GRID4, objective=objective, estimator="exact")
    windows = calibration_windows(bos_lm.tokenizer, SPEC)
    table = measure_table(bos_lm, spec, windows)
    naive = naive_build_table(bos_lm, spec, windows=windows)
    np.testing.assert_allclose(table.cell_objective, naive.cell_objective, rtol=1e-5, atol=1e-6)
    assert table.window_start == "bos"
    counted = 3 * 23 if objective == "nll" else 3 * 24
    assert (table.cell_tokens == counted).all()


@pytest.mark.slow
def test_fisher_estimate_on_bos_windows_counts_text_positions(bos_lm):
    spec = TableSpec(windows=SPEC, rate_grid=GRID4, objective="nll", estimator="fisher")
    windows = calibration_windows(bos_lm.tokenizer, SPEC)
    table = measure_table(bos_lm, spec, windows)
    assert table.dense_objective == pytest.approx(mean_nll(bos_lm, windows), rel=1e-5)
    assert not table.measured[table.removed > 0].any() and (table.cell_tokens == 3 * 23).all()


def test_the_convention_is_part_of_the_table_key(bos_lm, smol_tokenizer):
    plain_lm = dataclasses.replace(bos_lm, tokenizer=smol_tokenizer)
    spec = TableSpec(windows=SPEC, rate_grid=GRID4)
    assert table_key(plain_lm, spec, "data") != table_key(bos_lm, spec, "data")


@pytest.mark.slow
def test_a_table_of_the_old_format_is_never_reused(bos_lm, tmp_path, monkeypatch):
    monkeypatch.setenv("GAP_CACHE_DIR", str(tmp_path / "cache"))
    spec = TableSpec(windows=SPEC, rate_grid=GRID4, estimator="fisher")
    table = loss_table(bos_lm, spec)
    folder = cache.entry_dir(table.key)
    meta = json.loads((folder / cache.META_FILE).read_text())
    old = folder.parent / "old-format-entry"
    old.mkdir()
    (old / cache.TABLE_FILE).write_text((folder / cache.TABLE_FILE).read_text())
    (old / cache.META_FILE).write_text(json.dumps(meta | {"format_version": 1, "key": old.name}))
    assert [row["key"] for row in cache.list_tables()] == [table.key]
    assert cache.get_table(old.name) is None
    assert table_key(bos_lm, spec, load_corpus("wiki-sample").fingerprint) == table.key


# Gemma is heavy (in `make test-all`): its first load converts the GGUF (about 100 s on 2 cores,
# the slowest test of `make test`); the BOS path itself is covered in `make test` by the tiny
# models above with a real tokenizer told to prepend its BOS token.
@pytest.mark.slow
@pytest.mark.parametrize("name, expected", [("smollm2-135m", "text"), pytest.param("gemma3-270m", "bos", marks=pytest.mark.heavy)])
def test_builtin_windows_start_like_the_tokenizers_own_encoding(name, expected, smol):
    from gap_engine.model.loading import load_model

    lm = smol if name == "smollm2-135m" else load_model(name)
    text = "Photosynthesis is the process by which plants make sugar."
    encoded = lm.tokenizer(text)["input_ids"]
    plain = lm.tokenizer(text, add_special_tokens=False)["input_ids"]
    windows = heldout_windows(lm.tokenizer, WindowSpec("wiki-sample", n_samples=2, seq_len=64))
    assert window_start(lm.tokenizer) == expected
    if expected == "bos":
        assert encoded[1:] == plain and windows.shape == (2, 65)
        assert windows[:, 0].tolist() == [encoded[0]] * 2
        # The model reads far better as trained: perplexity on the same text tokens.
        ppl_bos = math.exp(mean_nll(lm, windows))
        ppl_text = math.exp(mean_nll(lm, windows[:, 1:]))
        assert ppl_bos < 0.5 * ppl_text, (ppl_bos, ppl_text)
    else:
        assert encoded == plain and windows.shape == (2, 64)
        assert encoded[0] == plain[0] and windows[:, 0].tolist() != [lm.tokenizer.bos_token_id] * 2


@pytest.mark.slow
def test_gap_eval_prints_the_window_convention(smol_tokenizer, bos_tokenizer, make_tiny, tmp_path, capsys):
    from gap_engine.cli import main
    from gap_engine.cli.model_commands import window_convention_text

    assert window_convention_text(bos_tokenizer) == "start with <|im_start|> (the model's BOS token: context only, not scored)"
    assert window_convention_text(smol_tokenizer) == "start with text (this model's tokenizer adds no BOS token)"
    tiny = make_tiny("llama")
    folder = tmp_path / "tiny-model"
    tiny.model.save_pretrained(folder)
    tiny.tokenizer.save_pretrained(folder)
    argv = ["eval", "--model", str(folder), "--samples", "2", "--seq-len", "16", "--generations", "0", "--no-throughput"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "windows: start with text (this model's tokenizer adds no BOS token)" in out.splitlines()
    assert main([*argv, "--json"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["window_start"] == "text"
