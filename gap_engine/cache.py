"""Content-addressed on-disk cache of loss tables.

The folder layout is the schema::

    <cache root>/tables/<key>/table.json     the LossTable (tables.LossTable.to_json)
                              meta.json      key, sha256 of table.json, format version,
                                             created, model, spec summary; written last
                              partial.json   measured cells of a build in progress
    <cache root>/tables/<key>.lock           inter-process lock of that entry

``<key>`` is ``tables.table_key``: a readable prefix (model, objective, mode, estimator) and a
hash of everything that changes the numbers. An entry counts only once its meta.json
exists and the checksum in it matches table.json, so a build killed half-way never looks
finished; an entry that fails those checks is logged, removed and rebuilt, never used.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import logging
import re
import shutil
from pathlib import Path

from filelock import FileLock, Timeout

from .errors import CacheError, TableError, first_line
from .fsutil import atomic_write_json, atomic_write_text, cache_root, lock_for
from .tables.artefact import TABLE_FORMAT_VERSION, LossTable

log = logging.getLogger(__name__)

TABLE_FILE = "table.json"
META_FILE = "meta.json"
PARTIAL_FILE = "partial.json"
_KEY_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")


def tables_root() -> Path:
    return cache_root() / "tables"


def entry_dir(key: str) -> Path:
    """The folder of one entry; CacheError for a key that is not a plain folder name."""
    if not isinstance(key, str) or not _KEY_PATTERN.match(key) or ".." in key:
        raise CacheError(f"'{key}' is not a valid loss-table cache key")
    return tables_root() / key


def lock(key: str, timeout: float = -1) -> FileLock:
    """The inter-process lock of one entry (held while the table is built or removed)."""
    return lock_for(entry_dir(key), timeout=timeout)


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _discard(folder: Path, reason: str) -> None:
    log.warning("loss-table cache entry %s is corrupt (%s); removing it", folder.name, reason)
    for name in (META_FILE, TABLE_FILE):
        (folder / name).unlink(missing_ok=True)


def get_table(key: str) -> LossTable | None:
    """The cached table for ``key``, or None when absent, unfinished or corrupt."""
    folder = entry_dir(key)
    meta_path, table_path = folder / META_FILE, folder / TABLE_FILE
    if not meta_path.is_file():
        return None  # never finished (meta.json is written last)
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        if not isinstance(meta, dict):
            raise ValueError("meta.json is not an object")
    except (OSError, ValueError) as exc:
        _discard(folder, f"unreadable meta.json: {first_line(exc)}")
        return None
    if meta.get("format_version") != TABLE_FORMAT_VERSION or meta.get("key") != key:
        _discard(folder, f"meta.json is for format {meta.get('format_version')!r}, key {meta.get('key')!r}")
        return None
    try:
        data = table_path.read_bytes()
    except OSError as exc:
        _discard(folder, f"table.json unreadable: {exc.strerror}")
        return None
    if _sha256(data) != meta.get("table_sha256"):
        _discard(folder, "table.json does not match its checksum")
        return None
    try:
        table = LossTable.from_json(data.decode("utf-8"))
    except (TableError, UnicodeDecodeError) as exc:
        _discard(folder, str(exc))
        return None
    if table.key != key:
        _discard(folder, f"table.json holds key {table.key}")
        return None
    return table


def put_table(table: LossTable) -> Path:
    """Store a finished table (table.json, then meta.json) and drop its partial cells."""
    if not table.key:
        raise CacheError("a loss table without a key cannot be cached")
    folder = entry_dir(table.key)
    text = table.to_json()
    atomic_write_text(folder / TABLE_FILE, text)
    meta = {
        "key": table.key,
        "format_version": TABLE_FORMAT_VERSION,
        "table_sha256": _sha256(text.encode("utf-8")),
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "model": table.model,
        "model_fingerprint": table.model_fingerprint,
        "num_layers": table.num_layers,
        "spec": table.spec.summary(),
        "shape": list(table.delta.shape),
        "build_seconds": round(table.build_seconds, 3),
    }
    atomic_write_json(folder / META_FILE, meta)
    (folder / PARTIAL_FILE).unlink(missing_ok=True)
    return folder


def list_tables() -> list[dict]:
    """Finished entries: key, model, spec summary, created, size (bytes), build seconds."""
    root = tables_root()
    rows = []
    if not root.is_dir():
        return rows
    for folder in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
        meta_path = folder / META_FILE
        if not meta_path.is_file():
            continue
        try:
            meta = json.loads(meta_path.read_text(encoding="utf-8"))
            size = (folder / TABLE_FILE).stat().st_size
        except (OSError, ValueError):
            continue  # reported as corrupt, and removed, when someone asks for it
        rows.append(
            {
                "key": folder.name,
                "model": meta.get("model"),
                "spec": meta.get("spec", {}),
                "created": meta.get("created"),
                "size": size,
                "build_seconds": meta.get("build_seconds"),
            }
        )
    return rows


def remove_table(key: str) -> None:
    """Delete one entry (finished or partial); CacheError when there is none or it is in use."""
    folder = entry_dir(key)
    if not folder.is_dir():
        raise CacheError(f"no cached loss table with key '{key}' (see `gap cache ls`)")
    try:
        with lock(key, timeout=5):
            shutil.rmtree(folder)
    except Timeout:
        raise CacheError(f"loss table '{key}' is being built by another process; try again later") from None


class PartialCells:
    """Measured cells of an unfinished build: ``partial.json`` in the entry's folder."""

    def __init__(self, key: str):
        self.key = key
        self.path = entry_dir(key) / PARTIAL_FILE

    def load(self) -> dict[tuple[int, int], float]:
        if not self.path.is_file():
            return {}
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
            if data.get("key") != self.key or data.get("format_version") != TABLE_FORMAT_VERSION:
                raise ValueError("it belongs to another key or format")
            return {(int(c), int(r)): float(v) for c, r, v in data["cells"]}
        except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
            log.warning("ignoring unreadable partial cells %s (%s)", self.path, first_line(exc))
            self.path.unlink(missing_ok=True)
            return {}

    def save(self, cells: dict[tuple[int, int], float]) -> None:
        data = {
            "key": self.key,
            "format_version": TABLE_FORMAT_VERSION,
            "updated": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "cells": [[c, r, v] for (c, r), v in sorted(cells.items())],
        }
        atomic_write_text(self.path, json.dumps(data) + "\n")

    def clear(self) -> None:
        self.path.unlink(missing_ok=True)
