"""Collect calibration windows: the data stage of the pipeline.

A *text source* (a built-in sample, a local ``.txt``/``.jsonl`` file, or a Hugging Face
dataset) is loaded into a :class:`TextCorpus` whose documents are split, by document,
into a calibration part and a held-out part that never overlap, and the held-out part again,
by document, into a *selection* part and a *report* part. :func:`calibration_windows`
then turns a list of documents into ``n_samples`` token windows of ``seq_len`` tokens,
the fixed-length calibration batches that GAP (EMNLP 2025), like SparseGPT and
EvoPress before it, feeds through the model to score components and build the loss
table. The held-out part gives evaluation windows from text the calibration never saw:
every choice (a compensation, a default, "the best of" anything) is made on the selection
windows, every result is reported on the report windows (:func:`heldout_windows`, whose
default is ``report``), so no reported number ever chose anything.
Every window starts the way the model was trained to read: with its BOS token when its
tokenizer prepends one (``bos``), which no loss, KL or statistic ever counts.

Built-in sources ship inside the installed ``gensim`` package (its test data), so they
work offline (one table of them, with their files and kinds: ``data.sources.BUILTIN_TEXTS``):

* ``wiki-sample``: real English Wikipedia articles from a shortened 2016 dump, markup
  stripped to plain prose (``data.wiki``).
* ``news-sample``: the Lee news corpus (Australian news articles), an out-of-domain set.
* ``newsgroups`` (held-out text only): Usenet posts, their headers, quoted replies and
  signatures dropped (``data.newsgroups``).
* ``wiki-tables`` (held-out text only): the sections of five other Wikipedia articles, cleaned
  as ``wiki-sample`` but with every table kept as text, one row a line, its cells separated by
  " | " (``data.wiki``).

How a source's documents are divided into calibration, selection and report parts, and the
content hash a loss table is keyed by: ``data.parts``.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from gap_engine.core import hub as hub_access
from gap_engine.core.config import DEFAULT_HELDOUT_SPLIT, HELDOUT_SPLITS, StoredWindowSpec, WindowSpec
from gap_engine.core.errors import DataError, first_line
from gap_engine.core.limits import LIMITS, check_file_size
from gap_engine.core.validate import decode_text, parse_json, read_bounded
from gap_engine.data.bos import Tokenizer, with_bos
from gap_engine.data.newsgroups import read_newsgroup_posts
from gap_engine.data.parts import TextCorpus, cut_corpus, heldout_corpus, make_corpus
from gap_engine.data.sources import (
    BUILTIN_TEXTS,
    CALIBRATION_KIND,
    gensim_test_file,
    mix_refusal,
    mixed_fingerprint,
    record_fingerprint,
    text_stamps,
    window_shares,
)
from gap_engine.data.tokens import TokenStream, split_long_text, tokenize_stream
from gap_engine.data.wiki import read_wiki_articles, read_wiki_sections

logger = logging.getLogger(__name__)


# The built-in sources a table can calibrate on (their held-out text measures too) -> description.
BUILTIN_SOURCES: dict[str, str] = {name: text.description for name, text in BUILTIN_TEXTS.items() if text.kind == CALIBRATION_KIND}
# Every built-in source of held-out text, the held-out-only ones included -> description.
HELDOUT_SOURCES: dict[str, str] = {name: text.description for name, text in BUILTIN_TEXTS.items()}


# A wikitext article starts at a top-level heading row such as " = Valkyria Chronicles III = ".
_WIKITEXT_ARTICLE_HEADING = re.compile(r"^ = [^=].* = $")

_ACCEPTED_FORMS = (
    "a built-in name ({names}), a path ending .txt (documents separated by blank lines) "
    'or .jsonl (one {{"text": ...}} object per line), or a Hugging Face dataset '
    "'name:config:split' (e.g. wikitext:wikitext-2-raw-v1:test)"
)


# --------------------------------------------------------------------------- loading


def load_corpus(spec: str, hub: bool = True) -> TextCorpus:
    """``read_corpus``, and the "loaded" line the first time this process reads that text."""
    corpus = read_corpus(spec, hub)
    key = (os.getpid(), corpus.name, corpus.fingerprint)  # the pid: a forked worker reads (and says) it anew
    if key not in _ANNOUNCED:
        _ANNOUNCED.add(key)
        logger.info("loaded %s: %d calibration and %d held-out documents", corpus.name, len(corpus.calibration), len(corpus.heldout))
    return corpus


_ANNOUNCED: set[tuple[int, str, str]] = set()


def read_corpus(spec: str, hub: bool = True) -> TextCorpus:
    """Load a text source and split it into calibration and held-out documents (printing nothing).

    Args:
        spec: a built-in name (see ``BUILTIN_SOURCES``), a local ``.txt`` or ``.jsonl``
            path, or a Hugging Face dataset ``"name:config:split"`` (config may be empty).
        hub: whether a dataset may be fetched from the hub. False for a name read from a file
            (``may_fetch``): such a dataset loads from the local datasets cache or not at all.

    Returns:
        The corpus; built-in and Hugging Face sources are parsed once per process.

    Raises:
        DataError: unknown spec, missing/unreadable/empty/malformed file, or a dataset
            that cannot be loaded.
    """
    spec = spec.strip() if isinstance(spec, str) else ""
    if spec in BUILTIN_TEXTS:
        return _load_builtin(spec)
    if spec.lower().endswith((".txt", ".jsonl")):
        return _load_local_file(spec)
    hf_parts = spec.split(":")
    if len(hf_parts) == 3 and hf_parts[0] and hf_parts[2]:
        return _load_hf_dataset(spec, hub)
    names = ", ".join(BUILTIN_TEXTS)
    raise DataError(f"unknown text source {spec!r}: expected " + _ACCEPTED_FORMS.format(names=names))


@functools.cache
def _load_builtin(name: str) -> TextCorpus:
    stamped = text_stamps(name)  # before reading: a record can be too old, never wrong
    builtin = BUILTIN_TEXTS[name]
    keyed = _BUILTIN_READERS[builtin.reader](gensim_test_file(builtin.file))
    corpus = make_corpus(name, keyed) if builtin.kind == CALIBRATION_KIND else heldout_corpus(name, keyed)
    record_fingerprint(stamped, corpus.fingerprint)
    return corpus


def _read_lines(path: Path) -> list[tuple[str, str]]:
    """(document, document) of every non-blank line of a one-document-a-line file, spaces collapsed."""
    docs = [" ".join(line.split()) for line in _read_text_file(path).splitlines()]
    return [(doc, doc) for doc in docs if doc]


def _read_text_file(path: Path) -> str:
    """The file's text through the validation layer: a regular file, bounded, UTF-8, no NUL bytes."""
    return decode_text(read_bounded(path, LIMITS.text_bytes, f"text file {path}", DataError), f"text file {path}", DataError)


def _load_local_file(spec: str) -> TextCorpus:
    path = Path(spec).expanduser()
    stamped = text_stamps(spec)  # before reading: a record can be too old, never wrong
    if not path.exists():
        raise DataError(f"text file not found: {path}")
    if not path.is_file():
        raise DataError(f"text source is not a file: {path}")
    check_file_size(path.stat().st_size, LIMITS.text_bytes, f"text file {path}", DataError)
    content = _read_text_file(path)
    if path.suffix.lower() == ".jsonl":
        docs = _jsonl_documents(content, path)
    else:
        docs = _txt_documents(content)
    if not docs:
        raise DataError(f"text file is empty: {path}")
    if len(docs) == 1:
        corpus = cut_corpus(spec, docs[0])
    else:
        corpus = make_corpus(spec, [(doc, doc) for doc in docs])
    record_fingerprint(stamped, corpus.fingerprint)
    return corpus


def _txt_documents(content: str) -> list[str]:
    """Documents are separated by blank lines; a single document is split into its lines."""
    docs = [block.strip() for block in re.split(r"\n[ \t]*\n", content.replace("\r\n", "\n"))]
    docs = [doc for doc in docs if doc]
    if len(docs) == 1:
        lines = [line.strip() for line in docs[0].splitlines()]
        docs = [line for line in lines if line]
    return docs


def _jsonl_documents(content: str, path: Path) -> list[str]:
    docs = []
    for line_number, line in enumerate(content.splitlines(), start=1):
        if not line.strip():
            continue
        record = parse_json(line, f"{path} line {line_number}", DataError)  # nesting bounded
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise DataError(f"{path} line {line_number}: expected an object with a string 'text' field")
        try:
            record["text"].encode("utf-8")
        except UnicodeEncodeError:  # a JSON escape of half a surrogate pair
            raise DataError(
                f"{path} line {line_number}: the text holds a lone surrogate (\\ud800-\\udfff escape), not Unicode text"
            ) from None
        if record["text"].strip():
            docs.append(record["text"].strip())
    return docs


def may_fetch(windows: WindowSpec) -> bool:
    """Whether the text sources of ``windows`` may reach the network: only those a user typed,
    never those named inside a file (a loss table's spec is a ``StoredWindowSpec``)."""
    return not isinstance(windows, StoredWindowSpec)


@functools.lru_cache(maxsize=8)
def _load_hf_dataset(spec: str, hub: bool = True) -> TextCorpus:
    name, config, split = spec.split(":")
    if not hub and not hub_access.dataset_cached(name):
        raise DataError(
            f"Hugging Face dataset {spec!r} (named in a file) is not in the local datasets cache; "
            "names read from files never reach the network: load it once by naming it on the command line"
        )
    try:
        import datasets  # imported here: slow, and only this source needs it

        with hub_access.offline(not hub):
            dataset = datasets.load_dataset(name, config or None, split=split)
    except Exception as exc:
        raise DataError(f"Hugging Face dataset {spec!r} could not be loaded (no network or not cached): {first_line(exc)}") from exc
    column = "text" if "text" in dataset.column_names else None
    if column is None:
        string_columns = [c for c, f in dataset.features.items() if getattr(f, "dtype", None) == "string"]
        if not string_columns:
            raise DataError(f"Hugging Face dataset {spec!r} has no text column")
        column = string_columns[0]
    rows = list(dataset[column])
    docs = _group_wikitext_rows(rows) if name.split("/")[-1].startswith("wikitext") else rows
    docs = [doc.strip() for doc in docs if doc and doc.strip()]
    if not docs:
        raise DataError(f"Hugging Face dataset {spec!r} has no text in column {column!r}")
    if len(docs) == 1:
        return cut_corpus(spec, docs[0])
    return make_corpus(spec, [(doc, doc) for doc in docs])


def _group_wikitext_rows(rows: Sequence[str]) -> list[str]:
    """Join wikitext's one-paragraph-per-row layout back into articles, so that the split
    by document keeps each article whole on one side."""
    articles: list[list[str]] = []
    for row in rows:
        line = row.rstrip("\n")
        if _WIKITEXT_ARTICLE_HEADING.match(line) or not articles:
            articles.append([])
        if line.strip():
            articles[-1].append(line.strip())
    return ["\n\n".join(lines) for lines in articles if lines]


# How each built-in source's documents are read and cleaned: data.sources.BUILTIN_TEXTS names
# one of these per source; each returns (key, document) pairs, the key the split hashes.
_BUILTIN_READERS: dict[str, Callable[[Path], list[tuple[str, str]]]] = {
    "wiki-prose": read_wiki_articles,
    "wiki-sections-with-tables": read_wiki_sections,
    "lines": _read_lines,
    "newsgroup-posts": read_newsgroup_posts,
}


# --------------------------------------------------------------------------- windows


def calibration_windows(tokenizer: Tokenizer, windows: WindowSpec) -> torch.Tensor:
    """Windows from the calibration part of ``windows.data`` (see :func:`cut_windows` and :func:`with_bos`).

    Several comma-separated sources mix: the ``n_samples`` windows are divided among them in the
    order named (``sources.window_shares``), each source's share drawn from its own calibration
    part with the window seed, and concatenated in that order, so a mixed calibration is the
    windows each source would give alone at its share.

    Returns:
        Token ids, shape (n_samples, text_start + seq_len), dtype int64.
    Raises:
        DataError: an unusable source, a held-out-only or repeated one, or more sources than windows.
    """
    sources = calibration_sources(windows)
    if len(sources) == 1:
        return _corpus_windows(tokenizer, windows, "calibration")
    shares = window_shares(windows.n_samples, len(sources))
    parts = [
        _corpus_windows(tokenizer, replace(windows, data=source, n_samples=share), "calibration") for source, share in zip(sources, shares)
    ]
    return torch.cat(parts, dim=0)  # (n_samples, text_start + seq_len)


def calibration_sources(windows: WindowSpec) -> tuple[str, ...]:
    """The sources ``windows`` calibrates on, in order; DataError (one line) where they cannot mix."""
    sources = windows.sources()
    refusal = mix_refusal(sources, windows.n_samples)
    if refusal is not None:
        raise DataError(refusal)
    return sources


def calibration_fingerprint(windows: WindowSpec) -> str:
    """The content hash of the calibration text of ``windows`` (each source read, and its hash
    recorded for the no-load lookup): one source's own, or the mix of every source's in order
    (``sources.mixed_fingerprint``)."""
    return mixed_fingerprint([load_corpus(source, may_fetch(windows)).fingerprint for source in calibration_sources(windows)])


def heldout_windows(tokenizer: Tokenizer, windows: WindowSpec, split: str = DEFAULT_HELDOUT_SPLIT) -> torch.Tensor:
    """Windows from one part of the held-out text of ``windows.data`` (see :func:`cut_windows`
    and :func:`with_bos`).

    Args:
        tokenizer: the model's tokenizer.
        windows: which source and how many windows of how many tokens, drawn with which seed.
        split: ``report`` (the default: what a reported number is measured on) or ``selection``
            (what a choice is made on); the two never share a document.

    Returns:
        Token ids, shape (n_samples, text_start + seq_len), dtype int64.
    """
    if split not in HELDOUT_SPLITS:
        raise DataError(f"unknown held-out split {split!r}: choose one of {', '.join(HELDOUT_SPLITS)}")
    return _corpus_windows(tokenizer, windows, split)


def batches(windows: torch.Tensor, batch_size: int) -> list[torch.Tensor]:
    """Consecutive slices of at most ``batch_size`` windows: [(B, T), ...]."""
    return [windows[start : start + batch_size] for start in range(0, windows.shape[0], batch_size)]


# Per-tokenizer-object memo of token streams, keyed by (corpus fingerprint, part). Keyed
# on the object itself (weakly) rather than on name_or_path, which two different
# tokenizers can share (e.g. several GGUF files in one folder).
_token_cache: weakref.WeakKeyDictionary[object, dict[tuple[str, str], TokenStream]] = weakref.WeakKeyDictionary()
_token_cache_lock = threading.Lock()
_MAX_STREAMS_PER_TOKENIZER = 8


def _corpus_windows(tokenizer: Tokenizer, windows: WindowSpec, part: str) -> torch.Tensor:
    spec, n_samples, seq_len, seed = windows.data, windows.n_samples, windows.seq_len, windows.seed
    check_window_sizes(n_samples, seq_len)
    corpus = load_corpus(spec, may_fetch(windows))
    texts = corpus.part(part)
    if not texts:
        raise DataError(f"text source {spec!r} has no {part} text (it is too small to split)")
    key = (corpus.fingerprint, part)
    with _token_cache_lock:
        stream = _cached_stream(tokenizer, key)
    if stream is None:
        stream = tokenize_stream(tokenizer, texts)
        with _token_cache_lock:
            _store_stream(tokenizer, key, stream)
    return with_bos(tokenizer, cut_windows(stream, n_samples, seq_len, seed, label=f"{spec} ({part})"))


def _cached_stream(tokenizer: Tokenizer, key: tuple[str, str]) -> TokenStream | None:
    try:
        return _token_cache.get(tokenizer, {}).get(key)
    except TypeError:  # tokenizer is not weak-referenceable or hashable: no memo
        return None


def _store_stream(tokenizer: Tokenizer, key: tuple[str, str], stream: TokenStream) -> None:
    try:
        streams = _token_cache.setdefault(tokenizer, {})
    except TypeError:
        return
    if len(streams) >= _MAX_STREAMS_PER_TOKENIZER:
        streams.pop(next(iter(streams)))
    streams[key] = stream


def check_window_sizes(n_samples: int, seq_len: int) -> None:
    if not isinstance(n_samples, int) or n_samples < 1:
        raise DataError(f"n_samples must be an integer >= 1, got {n_samples!r}")
    if not isinstance(seq_len, int) or seq_len < 2:
        raise DataError(f"seq_len must be an integer >= 2, got {seq_len!r}")


def check_enough_tokens(tokenizer: Tokenizer, windows: WindowSpec, part: str) -> None:
    """DataError now, before any model loads, when a source of ``windows.data`` has no ``part``
    text or fewer tokens in it than one window of ``windows.seq_len`` needs (the errors the
    windows would raise later). Tokenizes only until there are enough: a valid text costs
    its first document or so. Prints nothing (``read_corpus``).

    ``part``: calibration, selection or report; heldout is the part :func:`heldout_windows`
    reads by default (report).
    """
    part = DEFAULT_HELDOUT_SPLIT if part == "heldout" else part
    for source in windows.sources():
        texts = read_corpus(source, may_fetch(windows)).part(part)
        if not texts:
            raise DataError(f"text source {source!r} has no {part} text (it is too small to split)")
        separator = 1 if tokenizer.eos_token_id is not None else len(tokenizer("\n\n", add_special_tokens=False)["input_ids"])
        count = 0
        for index, doc in enumerate(text for text in texts if text and text.strip()):
            count += separator if index else 0
            for piece in split_long_text(doc):
                count += len(tokenizer(piece, add_special_tokens=False, verbose=False)["input_ids"])
                if count >= windows.seq_len:
                    break
            if count >= windows.seq_len:
                break
        else:
            raise DataError(
                f"{source} ({part}) has {count} tokens, but one window of seq_len={windows.seq_len} needs at least {windows.seq_len}"
            )


def cut_windows(stream: TokenStream, n_samples: int, seq_len: int, seed: int, label: str = "the text") -> torch.Tensor:
    n_tokens = len(stream)
    if n_tokens < seq_len:
        raise DataError(f"{label} has {n_tokens} tokens, but one window of seq_len={seq_len} needs at least {seq_len}")
    rng = np.random.default_rng(seed)
    n_slots = n_tokens // seq_len
    if n_slots >= n_samples:
        offset = int(rng.integers(0, n_tokens - n_slots * seq_len + 1))
        starts = offset + seq_len * rng.choice(n_slots, size=n_samples, replace=False)
    else:
        n_starts = n_tokens - seq_len + 1
        logger.warning(
            "%s has %d tokens, fewer than n_samples*seq_len=%d: windows will overlap",
            label,
            n_tokens,
            n_samples * seq_len,
        )
        starts = rng.choice(n_starts, size=n_samples, replace=n_starts < n_samples)
    index = np.asarray(starts)[:, None] + np.arange(seq_len)[None, :]  # (n_samples, seq_len)
    return torch.from_numpy(stream[index].astype(np.int64))  # (n_samples, seq_len)
