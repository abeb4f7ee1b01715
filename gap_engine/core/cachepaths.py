"""Where the on-disk cache keeps loss tables: the folder layout is the schema.

Kept in the foundation layer because two stages read it: ``tables.cache`` stores and checks
entries, and ``model.model_card`` describes the table behind a checkpoint's plan when that
table is still cached. See ``tables.cache`` for what each file holds.
"""

from __future__ import annotations

import re
from pathlib import Path

from gap_engine.core.errors import CacheError
from gap_engine.core.fsutil import cache_root

TABLE_FILE = "table.json"
META_FILE = "meta.json"
PARTIAL_FILE = "partial.json"
# A key is one plain folder name: a readable prefix and a hash (tables.artefact.table_key).
KEY_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")


def tables_root() -> Path:
    return cache_root() / "tables"


def entry_dir(key: str) -> Path:
    """The folder of one entry; CacheError for a key that is not a plain folder name."""
    if not isinstance(key, str) or not KEY_PATTERN.match(key) or ".." in key:
        raise CacheError(f"'{key}' is not a valid loss-table cache key")
    return tables_root() / key
