"""Tests of gap_engine.data.sources: a text's hash is recorded when it is read, and forgotten when it changes."""

from gap_engine.data.sources import recorded_fingerprint, source_files
from gap_engine.data.windows import load_corpus


def test_reading_a_text_file_records_its_hash_until_it_is_edited(tmp_path, monkeypatch):
    monkeypatch.setenv("GAP_CACHE_DIR", str(tmp_path / "cache"))
    text = tmp_path / "notes.txt"
    text.write_text("First paragraph of words.\n\nSecond paragraph of other words.\n\nA third one.\n")
    assert recorded_fingerprint(str(text)) is None
    corpus = load_corpus(str(text))
    assert recorded_fingerprint(str(text)) == corpus.fingerprint
    text.write_text(text.read_text() + "\nA fourth.\n")
    assert recorded_fingerprint(str(text)) is None
    edited = load_corpus(str(text)).fingerprint  # read again: recorded again
    assert edited != corpus.fingerprint and recorded_fingerprint(str(text)) == edited


def test_which_sources_have_files():
    subject, files = source_files("news-sample")
    assert subject == "builtin:news-sample" and files[0].name == "lee_background.cor" and files[0].is_file()
    assert source_files("wikitext:wikitext-2-raw-v1:test") is None  # a Hugging Face dataset: known once read
    assert source_files("/no/such/file.txt") is None
