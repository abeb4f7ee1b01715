"""Tests for gap_engine.data: real gensim sample files and the real SmolLM2 tokenizer."""

import hashlib
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from reference import make_windows

from gap_engine.core.config import BUILTIN_TEXT_NAMES, WindowSpec
from gap_engine.core.errors import DataError
from gap_engine.data import parts
from gap_engine.data import windows as data
from gap_engine.data.windows import (
    BUILTIN_SOURCES,
    TextCorpus,
    calibration_windows,
    heldout_windows,
    load_corpus,
)

NEWS_LIKE_DOCS = [
    "The council voted on Tuesday to extend the opening hours of the public library, "
    "after residents collected more than two thousand signatures in a month.",
    "Heavy rain flooded several roads in the north of the city overnight, and the "
    "weather bureau warned that more storms are expected before the weekend.",
    "A local bakery won the regional prize for its sourdough bread, beating forty other "
    "entries in a contest judged by chefs from three neighbouring towns.",
    "The football club announced a new coach, a former player who led the youth team "
    "to two championships and promised a faster, more attacking style of play.",
    "Scientists at the university published a study showing that the river's fish "
    "population has recovered since the factory upstream stopped its discharges.",
]


def _assert_disjoint_and_nonempty(corpus: TextCorpus) -> None:
    assert corpus.calibration and corpus.heldout
    assert not set(corpus.calibration) & set(corpus.heldout)


# ----------------------------------------------------------------------- sources


def test_builtin_source_names():
    assert tuple(BUILTIN_SOURCES) == BUILTIN_TEXT_NAMES == ("wiki-sample", "news-sample")
    assert all(isinstance(text, str) and "\n" not in text for text in BUILTIN_SOURCES.values())


def test_wiki_sample_is_plain_prose_articles():
    corpus = load_corpus("wiki-sample")
    documents = corpus.calibration + corpus.heldout
    assert len(documents) > 100
    for document in documents:
        for markup in ("[[", "]]", "{{", "}}", "<ref", "{|", "|}"):
            assert markup not in document
        assert len(document) >= 200
    all_text = "\n".join(documents)
    assert "Anarchism is a political philosophy" in all_text
    words = all_text.split()
    assert len(words) > 300_000
    assert words.count("the") > 0.03 * len(words)  # English prose, not residue
    assert len(corpus.fingerprint) == 64 and int(corpus.fingerprint, 16) >= 0


@pytest.mark.slow
def test_wiki_sample_split_is_disjoint_and_deterministic():
    corpus = load_corpus("wiki-sample")
    _assert_disjoint_and_nonempty(corpus)
    heldout_share = len(corpus.heldout) / (len(corpus.calibration) + len(corpus.heldout))
    assert 0.1 < heldout_share < 0.35
    data._load_builtin.cache_clear()  # parse the dump again from scratch
    reparsed = load_corpus("wiki-sample")
    assert reparsed is not corpus
    assert reparsed == corpus


def test_news_sample_loads_and_splits():
    corpus = load_corpus("news-sample")
    _assert_disjoint_and_nonempty(corpus)
    assert len(corpus.calibration) + len(corpus.heldout) > 250
    assert any("bushfire" in document for document in corpus.calibration + corpus.heldout)
    assert corpus.fingerprint != load_corpus("wiki-sample").fingerprint


def test_split_rule_does_not_depend_on_document_order():
    corpus = load_corpus("news-sample")
    documents = list(corpus.calibration + corpus.heldout)
    reversed_split = parts.make_corpus("x", [(doc, doc) for doc in reversed(documents)])
    assert set(reversed_split.calibration) == set(corpus.calibration)
    assert set(reversed_split.heldout) == set(corpus.heldout)


def test_local_txt_documents(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("\n\n".join(NEWS_LIKE_DOCS * 2) + "\n", encoding="utf-8")
    corpus = load_corpus(str(path))
    _assert_disjoint_and_nonempty(corpus)
    assert set(corpus.calibration) | set(corpus.heldout) == set(NEWS_LIKE_DOCS)
    assert load_corpus(str(path)) == corpus


def test_local_txt_single_block_is_split_into_paragraphs(tmp_path):
    path = tmp_path / "one_block.txt"
    path.write_text("\n".join(NEWS_LIKE_DOCS), encoding="utf-8")
    corpus = load_corpus(str(path))
    _assert_disjoint_and_nonempty(corpus)
    assert set(corpus.calibration) | set(corpus.heldout) == set(NEWS_LIKE_DOCS)


def test_local_txt_single_paragraph_is_cut_80_20_at_a_sentence(tmp_path):
    text = " ".join(NEWS_LIKE_DOCS)
    path = tmp_path / "one_line.txt"
    path.write_text(text, encoding="utf-8")
    corpus = load_corpus(str(path))
    (calibration,), (heldout,) = corpus.calibration, corpus.heldout
    assert calibration.endswith(".") and heldout[0].isupper()
    assert f"{calibration} {heldout}" == text
    assert 0.6 < len(calibration) / len(text) < 0.9


def test_local_jsonl(tmp_path, smol_tokenizer):
    path = tmp_path / "docs.jsonl"
    lines = [json.dumps({"text": doc, "id": index}) for index, doc in enumerate(NEWS_LIKE_DOCS)]
    path.write_text("\n".join(lines[:2] + [""] + lines[2:]) + "\n", encoding="utf-8")
    corpus = load_corpus(str(path))
    _assert_disjoint_and_nonempty(corpus)
    assert set(corpus.calibration) | set(corpus.heldout) == set(NEWS_LIKE_DOCS)
    windows = calibration_windows(smol_tokenizer, WindowSpec(str(path), n_samples=2, seq_len=16))
    assert windows.shape == (2, 16)


# ----------------------------------------------------------------------- errors


def test_unknown_source_lists_the_accepted_forms():
    with pytest.raises(DataError, match="wiki-sample") as caught:
        load_corpus("wikipedia-please")
    assert ".jsonl" in str(caught.value) and "\n" not in str(caught.value)


def test_missing_file(tmp_path):
    with pytest.raises(DataError, match="not found"):
        load_corpus(str(tmp_path / "absent.txt"))


@pytest.mark.parametrize("filename, content", [("blank.txt", " \n\n \n"), ("blank.jsonl", "\n\n")])
def test_empty_file(tmp_path, filename, content):
    path = tmp_path / filename
    path.write_text(content, encoding="utf-8")
    with pytest.raises(DataError, match="empty"):
        load_corpus(str(path))


@pytest.mark.parametrize("bad_line", ['{"text": "unterminated', '["not", "an", "object"]', '{"body": "x"}'])
def test_malformed_jsonl_line_is_named(tmp_path, bad_line):
    path = tmp_path / "bad.jsonl"
    good_lines = [json.dumps({"text": doc}) for doc in NEWS_LIKE_DOCS[:2]]
    path.write_text("\n".join(good_lines + [bad_line]) + "\n", encoding="utf-8")
    with pytest.raises(DataError, match="line 3"):
        load_corpus(str(path))


def test_text_too_short_for_one_window(smol_tokenizer):
    n_tokens = len(smol_tokenizer("A very short text.", add_special_tokens=False)["input_ids"])
    with pytest.raises(DataError, match=f"has {n_tokens} tokens.*seq_len=512"):
        make_windows(smol_tokenizer, ["A very short text."], n_samples=1, seq_len=512)


@pytest.mark.parametrize("n_samples, seq_len", [(0, 16), (4, 1), (-1, 16)])
def test_bad_window_sizes(smol_tokenizer, n_samples, seq_len):
    with pytest.raises(DataError):
        make_windows(smol_tokenizer, NEWS_LIKE_DOCS, n_samples=n_samples, seq_len=seq_len)


def test_unreachable_hf_dataset_fails_fast_offline(monkeypatch):
    import datasets.config
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    # Both libraries read the variables at import time, so patch their constants too.
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    # Fast means: no connection is even tried (a timed assertion would only measure the machine).
    import socket

    attempts = []
    real_connect = socket.socket.connect
    monkeypatch.setattr(socket.socket, "connect", lambda self, address: attempts.append(address) or real_connect(self, address))
    with pytest.raises(DataError, match="could not be loaded") as caught:
        load_corpus("gap-engine-no-such-dataset:none:test")
    assert attempts == []
    assert "\n" not in str(caught.value)


def test_wikitext_rows_are_grouped_into_articles():
    rows = [
        "",
        " = Alpha = \n",
        "",
        " Alpha is first . \n",
        " = = History = = \n",
        " It began . \n",
        " = Beta = \n",
        " Beta is second . \n",
    ]
    assert data._group_wikitext_rows(rows) == [
        "= Alpha =\n\nAlpha is first .\n\n= = History = =\n\nIt began .",
        "= Beta =\n\nBeta is second .",
    ]


# ----------------------------------------------------------------------- windows


def test_calibration_windows_shape_and_seed(smol_tokenizer):
    windows = calibration_windows(smol_tokenizer, WindowSpec("wiki-sample", n_samples=8, seq_len=128, seed=0))
    assert windows.shape == (8, 128) and windows.dtype == torch.int64
    assert int(windows.min()) >= 0 and int(windows.max()) < len(smol_tokenizer)
    again = calibration_windows(smol_tokenizer, WindowSpec("wiki-sample", n_samples=8, seq_len=128, seed=0))
    assert torch.equal(windows, again)
    other = calibration_windows(smol_tokenizer, WindowSpec("wiki-sample", n_samples=8, seq_len=128, seed=1))
    assert not torch.equal(windows, other)
    assert len({tuple(row.tolist()) for row in windows}) == 8


def _longest_plain_piece(tokenizer, window: torch.Tensor) -> str:
    """The longest stretch of a decoded window between document separators, minus its
    edges (a window may start or end inside a multi-byte character)."""
    text = tokenizer.decode(window.tolist())
    piece = max(text.split(tokenizer.eos_token), key=len)
    return piece[10:-10]


@pytest.mark.slow
def test_windows_decode_to_text_of_their_part(smol_tokenizer):
    corpus = load_corpus("wiki-sample")
    calibration_text = "\n".join(corpus.calibration)
    heldout_text = "\n".join(corpus.heldout)
    for window in calibration_windows(smol_tokenizer, WindowSpec("wiki-sample", n_samples=4, seq_len=256, seed=3)):
        piece = _longest_plain_piece(smol_tokenizer, window)
        assert len(piece) > 200 and piece in calibration_text and piece not in heldout_text
        assert " the " in piece or " of " in piece
    for window in heldout_windows(smol_tokenizer, WindowSpec("wiki-sample", n_samples=4, seq_len=256, seed=3)):
        piece = _longest_plain_piece(smol_tokenizer, window)
        assert len(piece) > 200 and piece in heldout_text and piece not in calibration_text


def test_token_stream_is_memoised_per_tokenizer(smol_tokenizer):
    corpus = load_corpus("news-sample")
    heldout_windows(smol_tokenizer, WindowSpec("news-sample", n_samples=2, seq_len=64))
    stream = data._token_cache[smol_tokenizer][(corpus.fingerprint, "report")]
    expected = make_windows(smol_tokenizer, corpus.report, n_samples=2, seq_len=64)
    assert torch.equal(heldout_windows(smol_tokenizer, WindowSpec("news-sample", n_samples=2, seq_len=64)), expected)
    assert data._token_cache[smol_tokenizer][(corpus.fingerprint, "report")] is stream


def test_make_windows_tokenizes_without_special_tokens(smol_tokenizer):
    ids = smol_tokenizer(NEWS_LIKE_DOCS[0], add_special_tokens=False)["input_ids"]
    windows = make_windows(smol_tokenizer, [NEWS_LIKE_DOCS[0]], n_samples=1, seq_len=len(ids))
    assert windows[0].tolist() == ids
    second_ids = smol_tokenizer(NEWS_LIKE_DOCS[1], add_special_tokens=False)["input_ids"]
    n_tokens = len(ids) + 1 + len(second_ids)  # exactly one window fits: no random offset
    pair = make_windows(smol_tokenizer, NEWS_LIKE_DOCS[:2], n_samples=1, seq_len=n_tokens)
    assert pair[0].tolist() == ids + [smol_tokenizer.eos_token_id] + second_ids


def test_windows_are_non_overlapping_grid_slots_when_text_allows():
    stream = np.arange(1000, dtype=np.int64)  # token value == its position
    for seed in range(5):
        windows = data.cut_windows(stream, n_samples=9, seq_len=100, seed=seed)
        starts = windows[:, 0].numpy()
        assert torch.equal(windows - windows[:, :1], torch.arange(100).expand(9, 100))
        assert len(set(starts % 100)) == 1  # one common offset: a grid
        assert np.all(np.diff(np.sort(starts)) >= 100)


def test_short_text_gives_overlapping_windows_with_warning(smol_tokenizer, caplog):
    n_tokens = sum(len(smol_tokenizer(doc, add_special_tokens=False)["input_ids"]) for doc in NEWS_LIKE_DOCS)
    n_tokens += len(NEWS_LIKE_DOCS) - 1  # one separator between documents
    seq_len = n_tokens // 2  # room for 2 disjoint windows, not 4
    with caplog.at_level(logging.WARNING, logger="gap_engine.data.windows"):
        windows = make_windows(smol_tokenizer, NEWS_LIKE_DOCS, n_samples=4, seq_len=seq_len)
    assert windows.shape == (4, seq_len)
    assert len({tuple(row.tolist()) for row in windows}) == 4
    assert "overlap" in caplog.text


@pytest.mark.slow
def test_news_split_is_the_same_in_a_fresh_process_without_gensim_or_streamlit():
    code = (
        "import sys; from gap_engine.data.windows import load_corpus; corpus = load_corpus('news-sample'); "
        "assert 'gensim' not in sys.modules and 'streamlit' not in sys.modules, 'imported'; "
        "print(corpus.fingerprint)"
    )
    repo_root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(repo_root), "PYTHONHASHSEED": "12345"}
    result = subprocess.run(
        [sys.executable, "-c", code],
        check=True,
        timeout=60,
        cwd=repo_root,
        env=env,
        capture_output=True,
        text=True,
    )
    assert result.stdout.strip() == load_corpus("news-sample").fingerprint


# ----------------------------------------------------------------------- selection and report

# The content hashes and calibration windows of the built-in sources as the code before the
# held-out text was divided computed them (commit 4d60461): the division must leave the
# calibration text, and so every loss table's cache key, exactly as it was.
FINGERPRINTS_BEFORE_THE_SPLIT = {
    "wiki-sample": "ab4a1891ee1660841cd3ec5804d7d743e8d380785d49076dca715029bea0f19c",
    "news-sample": "ae1745645e74a1168d374f49bb29493536347386ede8452415428c4cd62a61b1",
}
CALIBRATION_WINDOWS_BEFORE_THE_SPLIT = {  # sha256 of the int64 bytes of the default 16 x 256 windows, SmolLM2 tokenizer
    "wiki-sample": "daadd7e09da829b1",
    "news-sample": "b730462beea7cfec",
}


@pytest.mark.parametrize("source", BUILTIN_TEXT_NAMES)
def test_calibration_text_and_fingerprint_are_what_they_were(source, smol_tokenizer):
    corpus = load_corpus(source)
    assert corpus.fingerprint == FINGERPRINTS_BEFORE_THE_SPLIT[source]
    windows = calibration_windows(smol_tokenizer, WindowSpec(source))
    assert hashlib.sha256(windows.numpy().tobytes()).hexdigest()[:16] == CALIBRATION_WINDOWS_BEFORE_THE_SPLIT[source]


# sha256 of the NUL-joined documents of each part, as the code before the held-out-only
# sources (commit c8158d5) divided them: adding sources leaves every existing part as it was.
PARTS_BEFORE = {
    ("wiki-sample", "selection"): "b82b52a5870b20ef",
    ("wiki-sample", "report"): "4d3f78ea40968216",
    ("news-sample", "selection"): "d77a537821583bc4",
    ("news-sample", "report"): "f2f25fb8937f087c",
}


@pytest.mark.parametrize("source, part", PARTS_BEFORE)
def test_selection_and_report_of_the_calibration_sources_are_what_they_were(source, part):
    documents = load_corpus(source).part(part)
    assert hashlib.sha256("\0".join(documents).encode()).hexdigest()[:16] == PARTS_BEFORE[(source, part)]


@pytest.mark.parametrize("source", BUILTIN_TEXT_NAMES)
def test_heldout_text_is_divided_by_document_into_selection_and_report(source):
    corpus = load_corpus(source)
    assert corpus.selection and corpus.report
    assert not set(corpus.selection) & set(corpus.report)
    assert set(corpus.selection) | set(corpus.report) == set(corpus.heldout)
    assert len(corpus.selection) + len(corpus.report) == len(corpus.heldout)
    assert not (set(corpus.selection) | set(corpus.report)) & set(corpus.calibration)
    share = sum(map(len, corpus.selection)) / sum(map(len, corpus.heldout))
    assert 0.375 <= share < 0.5  # whole documents until 3/8 of the characters, one document past at most
    order = {doc: i for i, doc in enumerate(corpus.heldout)}  # each part keeps source order
    assert [order[d] for d in corpus.selection] == sorted(order[d] for d in corpus.selection)
    assert corpus.part("report") == corpus.report and corpus.part("selection") == corpus.selection


def test_selection_rule_is_the_documented_hash_order():
    corpus = load_corpus("news-sample")
    by_order = sorted(corpus.heldout, key=lambda doc: int(hashlib.sha256(doc.encode()).hexdigest()[8:16], 16))
    total, filled, expected = sum(map(len, corpus.heldout)), 0, set()
    for doc in by_order:
        if filled >= 0.375 * total:
            break
        expected.add(doc)
        filled += len(doc)
    assert set(corpus.selection) == expected


def test_selection_and_report_do_not_depend_on_document_order():
    corpus = load_corpus("news-sample")
    documents = list(corpus.calibration + corpus.heldout)
    reversed_split = parts.make_corpus("x", [(doc, doc) for doc in reversed(documents)])
    assert set(reversed_split.selection) == set(corpus.selection)
    assert set(reversed_split.report) == set(corpus.report)
    assert reversed_split.fingerprint != corpus.fingerprint  # the order is content; the split is not


def test_copies_of_one_heldout_document_stay_in_one_part():
    docs = [(f"key {i}", f"document {i} " * (5 + i)) for i in range(6)]
    docs.append(docs[0])  # the same key twice: both copies in one part
    selection, report = parts.split_heldout(docs)
    assert (docs[0][1] in selection) != (docs[0][1] in report)
    assert selection.count(docs[0][1]) + report.count(docs[0][1]) == 2


def test_report_is_never_empty_with_two_documents():
    selection, report = parts.split_heldout([("a", "tiny"), ("b", "long " * 1000)])
    assert len(selection) == 1 and len(report) == 1


def test_one_heldout_document_is_cut_three_eighths_five_eighths(tmp_path):
    text = " ".join(NEWS_LIKE_DOCS * 4)
    path = tmp_path / "one_line.txt"
    path.write_text(text, encoding="utf-8")
    corpus = load_corpus(str(path))
    ((heldout,),) = (corpus.heldout,)
    (selection,), (report,) = corpus.selection, corpus.report
    assert f"{selection} {report}" == heldout and selection.endswith(".")
    assert 0.25 < len(selection) / len(heldout) < 0.5
    assert corpus.calibration == (text[: len(text) - len(heldout)].strip(),)


def _slots(tokenizer, texts, seq_len=256) -> int:
    return len(data.tokenize_stream(tokenizer, texts)) // seq_len


def _tokenizers(smol_tokenizer):
    from gap_engine.model.loading import load_tokenizer

    gemma = load_tokenizer("gemma3-270m")  # converted by an earlier load; else only SmolLM2's is checked
    return [smol_tokenizer] + ([gemma] if gemma is not None else [])


@pytest.mark.parametrize("source", BUILTIN_TEXT_NAMES)
@pytest.mark.slow
def test_each_part_holds_enough_disjoint_windows(source, smol_tokenizer):
    corpus = load_corpus(source)
    for tokenizer in _tokenizers(smol_tokenizer):
        assert _slots(tokenizer, corpus.selection) >= 16  # choices: 16 windows of 256 tokens
        assert _slots(tokenizer, corpus.report) >= 24  # results: the paired bootstrap's 24 windows


@pytest.mark.slow
def test_heldout_windows_read_report_by_default_and_selection_on_request(smol_tokenizer):
    corpus = load_corpus("wiki-sample")
    parts = {name: "\n".join(corpus.part(name)) for name in ("calibration", "selection", "report")}
    spec = WindowSpec("wiki-sample", n_samples=3, seq_len=256, seed=2)
    assert torch.equal(heldout_windows(smol_tokenizer, spec), heldout_windows(smol_tokenizer, spec, "report"))
    for split in ("selection", "report"):
        for window in heldout_windows(smol_tokenizer, spec, split):
            piece = _longest_plain_piece(smol_tokenizer, window)
            assert len(piece) > 200 and piece in parts[split]
            assert all(piece not in text for name, text in parts.items() if name != split)
    with pytest.raises(DataError, match="selection, report"):
        heldout_windows(smol_tokenizer, spec, "heldout")


def test_too_few_tokens_names_the_part(smol_tokenizer):
    with pytest.raises(DataError, match=r"news-sample \(selection\) has \d+ tokens"):
        data.check_enough_tokens(smol_tokenizer, WindowSpec("news-sample", seq_len=6000), "selection")
    data.check_enough_tokens(smol_tokenizer, WindowSpec("news-sample", seq_len=5000), "report")
    with pytest.raises(DataError, match=r"news-sample \(report\)"):
        data.check_enough_tokens(smol_tokenizer, WindowSpec("news-sample", seq_len=8000), "heldout")
