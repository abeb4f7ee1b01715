"""What a slow computation over some files gave, remembered while those files stay unchanged.

A model's weights fingerprint needs the model loaded; a text's content hash needs the text
parsed. Both are what a loss table's cache key is made of, so a table already in the cache
could only be found after seconds of loading. This module keeps each such result in a small
JSON record beside the cache, with the *stamp* of every file it was computed from: its size,
modification and status-change times in nanoseconds, and its inode. A record is used only
while every one of those files still has its stamp: rewriting, replacing (a rename gives a
new inode), adding or removing a file makes it a miss, and the caller computes (and
records) the value again. A record that is unreadable, malformed or for another subject is a
miss too, never an error.

Layout::

    <cache root>/stamps/<kind>-<sha256 of the subject, 24 hex>.json
        {"format": 1, "kind": ..., "subject": ..., "files": {path: [bytes, mtime_ns, ctime_ns, inode]}, "value": {...}}

The status-change time is what makes a restored modification time (``touch -r``) a miss
too: no tool can set it back. What a stamp cannot see is a file rewritten in place twice
within one tick of the file system's clock, the second time while it was being read.
"""

from __future__ import annotations

import hashlib
import logging
import os
import stat
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from gap_engine.core.errors import CacheError, GapError
from gap_engine.core.fsutil import atomic_write_json, cache_root
from gap_engine.core.limits import LIMITS
from gap_engine.core.validate import read_json_file

log = logging.getLogger(__name__)

STAMPS_FORMAT = 1
Stamps = dict[str, list[int]]  # absolute path -> [bytes, mtime_ns, ctime_ns, inode]


def stamp_files(paths: Iterable[str | Path]) -> Stamps | None:
    """The stamp of every path (followed through links); None when one is missing or not a regular file."""
    stamps: Stamps = {}
    for path in paths:
        try:
            info = os.stat(path)
        except OSError:
            return None
        if not stat.S_ISREG(info.st_mode):
            return None
        stamps[str(Path(path).absolute())] = [int(info.st_size), int(info.st_mtime_ns), int(info.st_ctime_ns), int(info.st_ino)]
    return stamps


def record_path(kind: str, subject: str) -> Path:
    """Where the record of ``subject`` (a resolved path or a name) of ``kind`` lives."""
    digest = hashlib.sha256(f"{kind}\0{subject}".encode()).hexdigest()[:24]
    return cache_root() / "stamps" / f"{kind}-{digest}.json"


def recall(kind: str, subject: str, stamps: Stamps | None) -> dict[str, Any] | None:
    """The value recorded for ``subject`` when its files had exactly ``stamps``, else None."""
    if stamps is None:
        return None
    try:
        path = record_path(kind, subject)
        if not path.is_file():
            return None
        record = read_json_file(path, LIMITS.metadata_bytes, path.name, CacheError)
    except (GapError, OSError):
        return None
    if not isinstance(record, dict) or record.get("format") != STAMPS_FORMAT:
        return None
    if record.get("kind") != kind or record.get("subject") != subject or record.get("files") != stamps:
        return None
    value = record.get("value")
    return value if isinstance(value, dict) else None


def remember(kind: str, subject: str, stamps: Stamps | None, value: dict[str, Any]) -> None:
    """Record ``value`` for ``subject`` as computed from files with ``stamps`` (taken before reading them).

    Stamps taken before the files were read make a record that can only be too old, never
    wrong: a file changed while it was read has a new stamp, so its record is never used. A
    cache that cannot be written is logged and ignored (the next lookup computes again).
    """
    if stamps is None or recall(kind, subject, stamps) == value:
        return
    record = {"format": STAMPS_FORMAT, "kind": kind, "subject": subject, "files": stamps, "value": value}
    try:
        atomic_write_json(record_path(kind, subject), record)
    except (GapError, OSError) as exc:
        log.info("not recording the %s stamps of %s: %s", kind, subject, exc)
