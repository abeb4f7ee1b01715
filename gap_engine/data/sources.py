"""Which files a text source is read from, and its content hash as recorded when it was last read.

A loss table's cache key holds the content hash of its calibration text
(``parts.TextCorpus.fingerprint``: the documents after parsing and splitting). Computing it
means reading and parsing the whole source (seconds for the built-in Wikipedia sample), so
``windows.read_corpus`` records it against the stamps of the files it came from
(``core.filestamps``), and the cache's no-load lookup (``tables.lookup``) reads it back
while those files are unchanged. The reader's own source files are among them, so a change to
how text is parsed is a miss too. Hugging Face datasets have no local file to stamp: their
hash is only known once read.

torch-free, like everything the no-load lookup imports.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from gap_engine.core.errors import DataError
from gap_engine.core.filestamps import Stamps, recall, remember, stamp_files

BUILTIN_FILES = {  # built-in source -> the file in gensim's shipped test data it is read from
    "wiki-sample": "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2",
    "news-sample": "lee_background.cor",
}
_KIND = "text"
# The code that parses a source (windows.py) and divides it (parts.py): its changes change the hash.
_READERS = (Path(__file__).with_name("windows.py"), Path(__file__).with_name("parts.py"))


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
    """The content hash recorded when ``spec`` was last read, if its files are unchanged since."""
    stamped = text_stamps(spec)
    if stamped is None:
        return None
    value = recall(_KIND, *stamped)
    fingerprint = None if value is None else value.get("fingerprint")
    return fingerprint if isinstance(fingerprint, str) else None


def record_fingerprint(stamped: tuple[str, Stamps | None] | None, fingerprint: str) -> None:
    """Record a source's content hash under the stamps `text_stamps` took before it was read."""
    if stamped is not None:
        remember(_KIND, stamped[0], stamped[1], {"fingerprint": fingerprint})
