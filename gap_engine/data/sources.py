"""Which files a text source is read from, and its content hash as recorded when it was last read.

A loss table's cache key holds the content hash of its calibration text
(``parts.TextCorpus.fingerprint``: the documents after parsing and splitting). Computing it
means reading and parsing the whole source (seconds for the built-in Wikipedia sample), so
``windows.read_corpus`` records it against the stamps of the files it came from
(``core.filestamps``), and the cache's no-load lookup (``tables.lookup``) reads it back
while those files are unchanged. The reader's own source files are among them, so a change to
how text is parsed is a miss too. Hugging Face datasets have no local file to stamp: their
hash is only known once read.

Every built-in source is one row of ``BUILTIN_TEXTS``: the gensim file it is read from, how it
is read (``reader``: a name ``data.windows`` maps to its parser), its kind (calibration and
held-out text, or held-out text only) and the line that describes it. A held-out-only source is
never calibration text: ``calibration_refusal`` says so in one line wherever calibration text is
named, alone or in a list.

Calibration text may name several sources, comma-separated: their windows are divided among them
in the order named (``window_shares``), and a table's text hash is then the hash of every source's
hash in that order (``mixed_fingerprint``), so a mixed table is found without loading anything, as
a single-source one is.

torch-free, like everything the no-load lookup imports.
"""

from __future__ import annotations

import hashlib
import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from gap_engine.core.config import BUILTIN_TEXT_NAMES, HELDOUT_ONLY_TEXT_NAMES
from gap_engine.core.errors import DataError, InvariantError
from gap_engine.core.filestamps import Stamps, recall, remember, stamp_files

CALIBRATION_KIND = "calibration"  # divided into calibration, selection and report parts
HELDOUT_KIND = "held-out"  # selection and report parts only: never calibration text


@dataclass(frozen=True)
class BuiltinText:
    """One built-in text source: a file in gensim's shipped test data, and how it is read."""

    file: str  # the file's name in gensim/test/test_data
    reader: str  # how its documents are read and cleaned (a key of data.windows' readers)
    kind: str  # CALIBRATION_KIND or HELDOUT_KIND
    description: str  # one line for help texts and selectors


BUILTIN_TEXTS: dict[str, BuiltinText] = {
    "wiki-sample": BuiltinText(
        "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2",
        "wiki-prose",
        CALIBRATION_KIND,
        "104 English Wikipedia articles as plain prose: the 206-page dump shipped with gensim, "
        "less its 100 redirects and 2 pages too short to use.",
    ),
    "news-sample": BuiltinText(
        "lee_background.cor",
        "lines",
        CALIBRATION_KIND,
        "300 Australian news articles (the Lee corpus), shipped with gensim; out-of-domain.",
    ),
    "newsgroups": BuiltinText(
        "mini_newsgroup",
        "newsgroup-posts",
        HELDOUT_KIND,
        "192 Usenet posts from alt.atheism and sci.space (1993), without headers, quoted replies or signatures; held-out text only.",
    ),
    "wiki-tables": BuiltinText(
        "enwiki-table-markup.xml.bz2",
        "wiki-sections-with-tables",
        HELDOUT_KIND,
        "The sections of 5 English Wikipedia articles with their tables, one row a line (film awards, "
        "companies, votes); held-out text only.",
    ),
}
BUILTIN_FILES = {name: text.file for name, text in BUILTIN_TEXTS.items()}  # source -> its gensim file
_KIND = "text"
# The code that parses a source (windows.py, wiki.py, newsgroups.py) and divides it (parts.py): its changes change the hash.
_READERS = tuple(Path(__file__).with_name(module) for module in ("windows.py", "wiki.py", "newsgroups.py", "parts.py"))


def _names_of(kind: str) -> tuple[str, ...]:
    return tuple(name for name, text in BUILTIN_TEXTS.items() if text.kind == kind)


if (_names_of(CALIBRATION_KIND), _names_of(HELDOUT_KIND)) != (BUILTIN_TEXT_NAMES, HELDOUT_ONLY_TEXT_NAMES):
    raise InvariantError(
        "data.sources.BUILTIN_TEXTS and core.config's BUILTIN_TEXT_NAMES and HELDOUT_ONLY_TEXT_NAMES name different built-in sources"
    )


def calibration_refusal(spec: str) -> str | None:
    """The one line that refuses ``spec`` as calibration text (a loss table's, importance
    scores', compensation's or recovery training's), or None where it may calibrate.

    Only a held-out-only built-in is refused, alone or anywhere in a comma-separated list: its
    text is kept for measuring whether a plan holds on text that chose nothing, so no table,
    score or fit may read it.
    """
    text = spec if isinstance(spec, str) else ""
    names = [part.strip() for part in text.split(",")]
    name = next((n for n in names if n in BUILTIN_TEXTS and BUILTIN_TEXTS[n].kind == HELDOUT_KIND), None)
    if name is None:
        return None
    return (
        f"text source {name!r} is held-out text only and is never read for calibration or training: use "
        f"{' or '.join(BUILTIN_TEXT_NAMES)}, a .txt/.jsonl file or an HF spec, and measure on {name} "
        "with gap eval --data or gap compare --eval-data"
    )


def mix_refusal(sources: Sequence[str], n_samples: int) -> str | None:
    """The one line that refuses calibration windows from ``sources`` (in order), or None: a
    held-out-only source, a source named twice (its windows would be drawn twice, the same ones),
    or more sources than windows (a source with no window would be named and never read)."""
    for source in sources:
        refusal = calibration_refusal(source)
        if refusal is not None:
            return refusal
    twice = next((s for i, s in enumerate(sources) if s in sources[:i]), None)
    if twice is not None:
        return f"calibration text names {twice!r} twice; name each source once"
    if len(sources) > n_samples:
        return (
            f"calibration text names {len(sources)} sources but reads only {n_samples} window{'s' if n_samples != 1 else ''}: "
            f"every source needs at least one (more samples, or fewer sources)"
        )
    return None


def window_shares(n_samples: int, n_sources: int) -> list[int]:
    """How many of ``n_samples`` calibration windows each of ``n_sources`` sources gives, in the
    order named: as even as possible, the first sources taking the remainder (7 over 3: 3, 2, 2)."""
    base, extra = divmod(n_samples, n_sources)
    return [base + (1 if index < extra else 0) for index in range(n_sources)]


def mixed_fingerprint(fingerprints: Sequence[str]) -> str:
    """The text hash of calibration windows read from sources of these content hashes, in order:
    one source's own hash (so single-source keys are what they always were), else a hash of every
    source's hash in the order named (the order decides which windows come first)."""
    if len(fingerprints) == 1:
        return fingerprints[0]
    return hashlib.sha256(("mixed:" + ",".join(fingerprints)).encode()).hexdigest()


def refuse_as_calibration(spec: str) -> None:
    """DataError (``calibration_refusal``'s line) for a source that may not be calibration text."""
    refusal = calibration_refusal(spec)
    if refusal is not None:
        raise DataError(refusal)


def gensim_test_file(filename: str) -> Path:
    """Path of a file in gensim's shipped test data, found without importing gensim (slow)."""
    spec = importlib.util.find_spec("gensim")
    if spec is None or not spec.submodule_search_locations:
        raise DataError("built-in text samples need the 'gensim' package, which is not installed")
    path = Path(spec.submodule_search_locations[0]) / "test" / "test_data" / filename
    if not path.is_file():
        raise DataError(f"built-in sample file is missing from the gensim install: {path}")
    return path


def source_files(spec: str) -> tuple[str, list[Path]] | None:
    """(subject, files) a text source is read from: a built-in's gensim file or a local file;
    None for a Hugging Face dataset, or a source that does not exist here."""
    spec = spec.strip() if isinstance(spec, str) else ""
    try:
        if spec in BUILTIN_FILES:
            return f"builtin:{spec}", [gensim_test_file(BUILTIN_FILES[spec])]
        if spec.lower().endswith((".txt", ".jsonl")):
            path = Path(spec).expanduser().resolve()
            return (str(path), [path]) if path.is_file() else None
    except (DataError, OSError, RuntimeError):  # no gensim; a link loop
        return None
    return None


def text_stamps(spec: str) -> tuple[str, Stamps | None] | None:
    """(subject, stamps of its files and of the reader) of a text source; None when it has no files."""
    found = source_files(spec)
    if found is None:
        return None
    subject, files = found
    return subject, stamp_files([*files, *_READERS])


def recorded_fingerprint(spec: str) -> str | None:
    """The content hash recorded when ``spec`` was last read, if its files are unchanged since;
    for several comma-separated sources, their ``mixed_fingerprint`` when every one is recorded."""
    fingerprints = []
    for source in (part.strip() for part in str(spec).split(",") if part.strip()):
        stamped = text_stamps(source)
        value = None if stamped is None else recall(_KIND, *stamped)
        fingerprint = None if value is None else value.get("fingerprint")
        if not isinstance(fingerprint, str):
            return None
        fingerprints.append(fingerprint)
    return mixed_fingerprint(fingerprints) if fingerprints else None


def record_fingerprint(stamped: tuple[str, Stamps | None] | None, fingerprint: str) -> None:
    """Record a source's content hash under the stamps `text_stamps` took before it was read."""
    if stamped is not None:
        remember(_KIND, stamped[0], stamped[1], {"fingerprint": fingerprint})
