"""The held-out-only built-in sources (newsgroups, wiki-tables): real gensim files, cleaned,
divided into selection and report parts, never calibration text; the SmolLM2 tokenizer (and
Gemma 3's where an earlier load converted it). No model runs here."""

from __future__ import annotations

import pytest

from gap_engine.core.config import BUILTIN_TEXT_NAMES, HELDOUT_ONLY_TEXT_NAMES, HELDOUT_TEXT_NAMES, WindowSpec
from gap_engine.core.errors import DataError, TableError
from gap_engine.data import windows as data
from gap_engine.data.sources import BUILTIN_TEXTS, HELDOUT_KIND, calibration_refusal, recorded_fingerprint, source_files
from gap_engine.data.windows import BUILTIN_SOURCES, HELDOUT_SOURCES, calibration_windows, heldout_windows, load_corpus

NEW_SOURCES = ("newsgroups", "wiki-tables")


def _tokenizers(smol_tokenizer):
    from gap_engine.model.loading import load_tokenizer

    gemma = load_tokenizer("gemma3-270m")  # converted by an earlier load; else only SmolLM2's is checked
    return [smol_tokenizer] + ([gemma] if gemma is not None else [])


def test_one_table_lists_every_builtin_with_its_kind():
    assert HELDOUT_ONLY_TEXT_NAMES == NEW_SOURCES
    assert HELDOUT_TEXT_NAMES == ("wiki-sample", "news-sample", "newsgroups", "wiki-tables")
    assert tuple(BUILTIN_TEXTS) == HELDOUT_TEXT_NAMES == tuple(HELDOUT_SOURCES)
    assert tuple(BUILTIN_SOURCES) == BUILTIN_TEXT_NAMES  # the sources a table can calibrate on
    assert [name for name, text in BUILTIN_TEXTS.items() if text.kind == HELDOUT_KIND] == list(NEW_SOURCES)
    assert all("\n" not in text for text in HELDOUT_SOURCES.values())


@pytest.mark.parametrize("source", NEW_SOURCES)
@pytest.mark.slow
def test_source_loads_whole_as_heldout_text_recorded_against_its_file(source, tmp_path, monkeypatch):
    monkeypatch.setenv("GAP_CACHE_DIR", str(tmp_path / "cache"))
    data._load_builtin.cache_clear()  # read (and record) it under this cache
    subject, files = source_files(source)
    assert subject == f"builtin:{source}" and files[0].name == BUILTIN_TEXTS[source].file
    corpus = load_corpus(source)
    assert corpus.calibration == () and corpus.heldout_only and len(corpus.heldout) > 50
    assert recorded_fingerprint(source) == corpus.fingerprint  # the no-load table lookup reads it back
    assert len(corpus.fingerprint) == 64


def test_newsgroup_posts_lose_headers_quotes_and_signatures():
    corpus = load_corpus("newsgroups")
    assert len(corpus.heldout) == 192
    posts = dict(data.read_newsgroup_posts(source_files("newsgroups")[1][0]))
    # Header block, "prudenti@... wrote:" and the ":"-quoted lines it introduced are gone.
    assert posts["<C4w09I.JMx@darkside.osrhe.uoknor.edu>"] == (
        "Dave,\n\nCan you explain the purpose of your post, I can't imagine what you must have thougt it meant.\n\nBill"
    )
    # ">>#" quotes and the signature after "--" are gone.
    assert posts["<30186@ursa.bear.com>"] == "It accurately described what we can _say_ about how the universe works."
    text = "\n\n".join(corpus.heldout)
    for header in ("Path:", "Lines:", "Nntp-Posting-Host:", "In article <", "Xref:"):
        assert header not in text
    assert not [p for doc in corpus.heldout for p in doc.split("\n\n") if p[:1] in (">", "|", ":")]
    assert "space station" in text and "atheists" in text  # both groups are there


def test_wiki_tables_keep_tables_as_rows_without_markup():
    corpus = load_corpus("wiki-tables")
    text = "\n\n".join(corpus.heldout)
    lines = text.splitlines()
    assert "Ericsson Eesti | 1,213.4" in lines  # Economy of Estonia, largest companies by revenue
    assert "Cedric Gibbons | The Bridge of San Luis Rey" in lines  # the award's 1928/29 row
    assert "27 April 1972 | Rainer Barzel (CDU) | Willy Brandt (SPD) | 247 | 10 | 3 | 236 | no" in lines
    for markup in ("{|", "|}", "|-", "||", "[[", "]]", "{{", "}}", "wikitable", "style=", "rowspan", "<ref", "'''"):
        assert markup not in text, markup
    # Both parts hold table rows, not only prose: sections, not articles, are its documents.
    for part in (corpus.selection, corpus.report):
        assert sum(" | " in line for doc in part for line in doc.splitlines()) > 100


@pytest.mark.parametrize("source", NEW_SOURCES)
@pytest.mark.slow
def test_parts_are_disjoint_whole_and_deterministic(source):
    corpus = load_corpus(source)
    assert corpus.selection and corpus.report
    assert not set(corpus.selection) & set(corpus.report)
    assert sorted(corpus.selection + corpus.report) == sorted(corpus.heldout)
    share = sum(map(len, corpus.selection)) / sum(map(len, corpus.heldout))
    assert 0.375 <= share < 0.5
    data._load_builtin.cache_clear()  # parse the file again from scratch
    reread = load_corpus(source)
    assert reread is not corpus and reread == corpus


@pytest.mark.parametrize("source", NEW_SOURCES)
def test_each_part_holds_enough_windows_for_both_tokenizers(source, smol_tokenizer):
    corpus = load_corpus(source)
    for tokenizer in _tokenizers(smol_tokenizer):
        assert len(data.tokenize_stream(tokenizer, corpus.selection)) // 256 >= 16  # choices: 16 windows of 256 tokens
        assert len(data.tokenize_stream(tokenizer, corpus.report)) // 256 >= 24  # results: the paired bootstrap's 24


@pytest.mark.parametrize("source", NEW_SOURCES)
def test_heldout_windows_come_from_the_part_asked_for(source, smol_tokenizer):
    corpus = load_corpus(source)
    spec = WindowSpec(source, n_samples=4, seq_len=256, seed=1)
    for split in ("selection", "report"):
        other = "report" if split == "selection" else "selection"
        for window in heldout_windows(smol_tokenizer, spec, split):
            # The longest stretch between document separators, less its edges (a window may cut a
            # character): long enough to be found in one part only.
            piece = max(smol_tokenizer.decode(window.tolist()).split(smol_tokenizer.eos_token), key=len)[10:-10]
            assert len(piece) > 100
            assert piece in "\n".join(corpus.part(split)) and piece not in "\n".join(corpus.part(other))


@pytest.mark.parametrize("source", NEW_SOURCES)
def test_refused_as_calibration_text_everywhere_in_one_line(source, smol_tokenizer):
    from gap_engine.recover.settings import RecoverySettings
    from gap_engine.tables.artefact import TableSpec

    refusal = calibration_refusal(source)
    assert refusal is not None and "\n" not in refusal and f"'{source}' is held-out text only" in refusal
    with pytest.raises(DataError, match="held-out text only") as info:
        load_corpus(source).part("calibration")
    assert str(info.value) == refusal
    with pytest.raises(DataError, match="held-out text only"):
        calibration_windows(smol_tokenizer, WindowSpec(source, n_samples=2, seq_len=32))
    with pytest.raises(DataError, match="held-out text only"):
        data.check_enough_tokens(smol_tokenizer, WindowSpec(source, seq_len=32), "calibration")
    with pytest.raises(TableError, match="held-out text only"):
        TableSpec(windows=WindowSpec(source)).validate()
    with pytest.raises(DataError, match="held-out text only"):
        RecoverySettings(tasks=("news-sample", source)).validate()
    RecoverySettings(tasks=("news-sample",), eval_texts=(source,)).validate()  # measuring on it is what it is for


@pytest.mark.parametrize("source", BUILTIN_TEXT_NAMES)
@pytest.mark.slow
def test_calibration_sources_are_not_refused(source):
    assert calibration_refusal(source) is None and load_corpus(source).part("calibration")
