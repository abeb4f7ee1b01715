"""Content-addressed on-disk cache of loss tables.

The folder layout is the schema::

    <cache root>/tables/<key>/table.json     the LossTable (tables.LossTable.to_json)
                              meta.json      key, sha256 of table.json, format version,
                                             created, model, spec summary, build and stage
                                             seconds; written last
                              partial.json   measured cells of a build in progress, each with a
                                             hash of the units it removed, and their own
                                             sha256 (checked before a resume)
    <cache root>/tables/<key>.lock           inter-process lock of that entry

``<key>`` is ``tables.artefact.table_key``: a readable prefix (model, objective, mode, estimator) and a
hash of everything that changes the numbers. An entry counts only once its meta.json
exists and the checksum in it matches table.json, so a build killed half-way never looks
finished; an entry that fails those checks is logged, removed and rebuilt, never used.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import logging
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout

from gap_engine.core.cachepaths import META_FILE, PARTIAL_FILE, TABLE_FILE, entry_dir, tables_root
from gap_engine.core.errors import CacheError, TableError, first_line
from gap_engine.core.fsutil import atomic_write_json, atomic_write_text, lock_for, lock_path
from gap_engine.core.jsontext import json_text
from gap_engine.core.limits import LIMITS
from gap_engine.core.validate import check_cache_meta, check_int, check_keys, check_number, check_text, read_bounded, read_json_file
from gap_engine.tables.artefact import TABLE_FORMAT_VERSION, LossTable

log = logging.getLogger(__name__)


def lock(key: str, timeout: float = -1) -> FileLock:
    """The inter-process lock of one entry (held while the table is built or removed)."""
    return lock_for(entry_dir(key), timeout=timeout)


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _cells_sha256(cells: list[list[Any]]) -> str:
    """Checksum of partial cells ([component, rate index, value, units key] rows) in their JSON form."""
    return _sha256(json_text(cells, "partial cells", separators=(",", ":")).encode("utf-8"))


def _saved_cell(cell: object) -> tuple[tuple[int, int], tuple[float, str]]:
    """((component, rate index), (value, units key)) of one saved row."""
    if not isinstance(cell, list) or len(cell) != 4:
        raise CacheError("a cell must be [component, rate index, value, units key]")
    index = check_int(cell[0], "a cell component", CacheError, 0), check_int(cell[1], "a cell rate index", CacheError, 0)
    return index, (
        check_number(cell[2], "a cell value", CacheError),
        str(check_text(cell[3], "a cell's units key", CacheError, max_len=64)),
    )


def _discard(folder: Path, reason: str) -> None:
    log.warning("loss-table cache entry %s is corrupt (%s); removing it", folder.name, reason)
    for name in (META_FILE, TABLE_FILE):
        (folder / name).unlink(missing_ok=True)


def get_table(key: str, verify: Callable[[LossTable], None] | None = None) -> LossTable | None:
    """The cached table for ``key``, or None when absent, unfinished or corrupt.

    Args:
        verify: raises TableError when the table is not the one asked for (another model's
            table under this key, its checksum updated to match): the entry is then removed
            like a corrupt one, and rebuilt by the caller. The checksum only proves the entry
            is whole, not whose it is.
    """
    folder = entry_dir(key)
    meta_path, table_path = folder / META_FILE, folder / TABLE_FILE
    if not meta_path.is_file():
        return None  # never finished (meta.json is written last)
    try:
        meta = check_cache_meta(read_json_file(meta_path, LIMITS.metadata_bytes, "meta.json", CacheError), key)
    except CacheError as exc:
        _discard(folder, f"unreadable meta.json: {exc}")
        return None
    if meta.get("format_version") != TABLE_FORMAT_VERSION or meta.get("key") != key:
        _discard(folder, f"meta.json is for format {meta.get('format_version')!r}, key {meta.get('key')!r}")
        return None
    try:
        data = read_bounded(table_path, LIMITS.table_bytes, "table.json", CacheError)
    except CacheError as exc:
        _discard(folder, str(exc))
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
    if verify is not None:
        try:
            verify(table)
        except TableError as exc:
            _discard(folder, f"it is not the table asked for: {first_line(exc)}")
            return None
    return table


def put_table(table: LossTable, stage_seconds: dict[str, float] | None = None) -> Path:
    """Store a finished table (table.json, then meta.json) and drop its partial cells.

    Args:
        stage_seconds: wall seconds of the build's stages (``progress.StageTimer``), kept in
            meta.json: what this machine's next builds are expected to take.
    """
    if not table.key:
        raise CacheError("a loss table without a key cannot be cached")
    folder = entry_dir(table.key)
    text = table.to_json()
    atomic_write_text(folder / TABLE_FILE, text)
    meta = {
        "key": table.key,
        "format_version": TABLE_FORMAT_VERSION,
        "table_sha256": _sha256(text.encode("utf-8")),
        # Microseconds: "the newest table" must tell apart two builds finished in the same second.
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="microseconds"),
        "model": table.model,
        "model_fingerprint": table.model_fingerprint,
        "num_layers": table.num_layers,
        "spec": table.spec.summary(),
        "shape": list(table.delta.shape),
        "build_seconds": round(table.build_seconds, 3),
        "stage_seconds": stage_seconds or {},
    }
    atomic_write_json(folder / META_FILE, meta)
    (folder / PARTIAL_FILE).unlink(missing_ok=True)
    return folder


def list_tables() -> list[dict[str, Any]]:
    """Finished entries: key, model, spec summary, created, size (bytes), build seconds, stage seconds."""
    root = tables_root()
    rows: list[dict[str, Any]] = []
    if not root.is_dir():
        return rows
    for folder in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
        meta_path = folder / META_FILE
        if not meta_path.is_file():
            continue
        try:
            meta = check_cache_meta(read_json_file(meta_path, LIMITS.metadata_bytes, "meta.json", CacheError), folder.name)
            size = (folder / TABLE_FILE).stat().st_size
        except (OSError, CacheError):
            continue  # reported as corrupt, and removed, when someone asks for it
        if not isinstance(meta, dict) or meta.get("format_version") != TABLE_FORMAT_VERSION:
            continue  # an older format is never offered (it is rebuilt under a new key)
        rows.append(
            {
                "key": folder.name,
                "model": meta.get("model"),
                "spec": meta.get("spec", {}),
                "created": meta.get("created"),
                "size": size,
                "build_seconds": meta.get("build_seconds"),
                "stage_seconds": meta.get("stage_seconds") or {},
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
            # The lock goes with its entry; a later build of the key makes a new one.
            lock_path(folder).unlink(missing_ok=True)
    except Timeout:
        raise CacheError(f"loss table '{key}' is being built by another process; try again later") from None


class PartialCells:
    """Measured cells of an unfinished build: ``partial.json`` in the entry's folder."""

    def __init__(self, key: str):
        self.key = key
        self.path = entry_dir(key) / PARTIAL_FILE

    def load(self) -> dict[tuple[int, int], tuple[float, str]]:
        """The saved cells, cell -> (value, key of the units it removed; ``cells.Cut.units_key``),
        or {} (and the file removed) when absent, corrupt, changed since saved or written before
        cells carried their units."""
        if not self.path.is_file():
            return {}
        try:
            data = read_json_file(self.path, LIMITS.partial_bytes, "partial.json", CacheError)
            check_keys(data, "partial.json", CacheError)
            if data.get("key") != self.key or data.get("format_version") != TABLE_FORMAT_VERSION:
                raise CacheError("it belongs to another key or format")
            cells = data.get("cells")
            if not isinstance(cells, list) or _cells_sha256(cells) != data.get("cells_sha256"):
                raise CacheError("its cells do not match their checksum")
            return dict(_saved_cell(cell) for cell in cells)
        except (CacheError, TypeError, IndexError) as exc:
            log.warning("ignoring unreadable partial cells %s (%s)", self.path, first_line(exc))
            self.path.unlink(missing_ok=True)
            return {}

    def save(self, cells: dict[tuple[int, int], tuple[float, str]]) -> None:
        """Write cell -> (value, units key) in place of what was saved."""
        rows = [[c, r, value, units] for (c, r), (value, units) in sorted(cells.items())]
        data = {
            "key": self.key,
            "format_version": TABLE_FORMAT_VERSION,
            "updated": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "cells_sha256": _cells_sha256(rows),  # checked on load, like a finished table's
            "cells": rows,
        }
        atomic_write_text(self.path, json_text(data, str(self.path)) + "\n")

    def clear(self) -> None:
        self.path.unlink(missing_ok=True)
