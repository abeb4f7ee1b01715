"""Calibration text mixed across sources: the windows of ``wiki-sample,news-sample`` are each
source's own windows at its share, in the order named; a list that cannot mix is refused in one
line. The real SmolLM2 tokenizer on the real built-in text; no model runs here."""

from __future__ import annotations

import pytest
import torch

from gap_engine.core.config import WindowSpec
from gap_engine.core.errors import DataError, TableError
from gap_engine.data.sources import mixed_fingerprint, window_shares
from gap_engine.data.windows import calibration_fingerprint, calibration_windows, load_corpus
from gap_engine.tables.artefact import TableSpec


def test_shares_are_as_even_as_possible_the_first_sources_taking_the_remainder():
    assert window_shares(7, 3) == [3, 2, 2]
    assert window_shares(16, 2) == [8, 8]
    assert window_shares(5, 2) == [3, 2]
    assert window_shares(2, 2) == [1, 1]


def test_mixed_windows_are_each_sources_own_windows_in_the_order_named(smol_tokenizer):
    mixed = calibration_windows(smol_tokenizer, WindowSpec(data="wiki-sample,news-sample", n_samples=5, seq_len=32, seed=3))
    wiki = calibration_windows(smol_tokenizer, WindowSpec(data="wiki-sample", n_samples=3, seq_len=32, seed=3))
    news = calibration_windows(smol_tokenizer, WindowSpec(data="news-sample", n_samples=2, seq_len=32, seed=3))
    assert mixed.shape == (5, 32) and mixed.dtype == torch.int64
    assert torch.equal(mixed, torch.cat([wiki, news]))
    again = calibration_windows(smol_tokenizer, WindowSpec(data=" wiki-sample , news-sample ", n_samples=5, seq_len=32, seed=3))
    assert torch.equal(again, mixed)  # deterministic, spaces around the names ignored
    reversed_order = calibration_windows(smol_tokenizer, WindowSpec(data="news-sample,wiki-sample", n_samples=5, seq_len=32, seed=3))
    news_first = calibration_windows(smol_tokenizer, WindowSpec(data="news-sample", n_samples=3, seq_len=32, seed=3))
    wiki_second = calibration_windows(smol_tokenizer, WindowSpec(data="wiki-sample", n_samples=2, seq_len=32, seed=3))
    assert torch.equal(reversed_order, torch.cat([news_first, wiki_second]))


def test_the_text_hash_of_a_mix_holds_every_source_in_order():
    wiki, news = (load_corpus(s).fingerprint for s in ("wiki-sample", "news-sample"))
    single = calibration_fingerprint(WindowSpec(data="wiki-sample", n_samples=2))
    mixed = calibration_fingerprint(WindowSpec(data="wiki-sample,news-sample", n_samples=2))
    assert single == wiki  # a single source's hash is what it always was
    assert mixed == mixed_fingerprint([wiki, news]) and mixed not in (wiki, news)
    assert calibration_fingerprint(WindowSpec(data="news-sample,wiki-sample", n_samples=2)) != mixed


@pytest.mark.parametrize(
    ("data", "n_samples", "message"),
    [
        ("wiki-sample,newsgroups", 4, "text source 'newsgroups' is held-out text only"),
        ("wiki-tables,news-sample", 4, "text source 'wiki-tables' is held-out text only"),
        ("wiki-sample,news-sample,wiki-sample", 4, "calibration text names 'wiki-sample' twice"),
        ("wiki-sample,news-sample", 1, "calibration text names 2 sources but reads only 1 window:"),
    ],
)
def test_a_list_that_cannot_mix_is_refused_in_one_line_by_the_windows_and_the_table(data, n_samples, message, smol_tokenizer):
    windows = WindowSpec(data=data, n_samples=n_samples, seq_len=32)
    with pytest.raises(DataError) as info:
        calibration_windows(smol_tokenizer, windows)
    assert message in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(TableError) as info:
        TableSpec(windows=windows, estimator="fisher", objective="kl", rate_grid=(0.0, 0.5)).validate()
    assert message in str(info.value) and "\n" not in str(info.value)
