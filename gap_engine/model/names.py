"""How a model is named in what gap records: a table's and a plan's ``model``, a checkpoint's
``base_model``, the run history.

A record outlives the folder it was made in: a checkpoint made with ``--model tiny`` and read
from another working folder must still find its dense model (for distillation, KL to dense, a
table's allocators that load it). So a local folder or ``.gguf`` file is recorded as an absolute
path; a built-in name and a hub id are recorded as they are. Records written before that may
hold a relative path: ``resolve_recorded`` reads it against the record's own folder.

torch-free, like everything the table cache's no-load lookup imports.
"""

from __future__ import annotations

import os
from pathlib import Path

from gap_engine.model.identity import BUILTIN_MODEL_NAMES


def _local(path: Path) -> bool:
    try:
        return path.exists()
    except (OSError, ValueError):  # a name no file system call takes: not a local model
        return False


def recorded_name(name_or_path: str | Path) -> str:
    """The name a model loaded from ``name_or_path`` is recorded under: a built-in name or a hub
    id as given, a local folder or file (one that exists here) as an absolute path, with ``~``
    expanded and ``..`` folded, symbolic links kept as the user named them."""
    name = str(name_or_path)
    if name in BUILTIN_MODEL_NAMES:
        return name
    path = Path(name).expanduser()
    if not _local(path):
        return name  # a hub id, or nothing here: the loader says which
    return os.path.abspath(path)


def resolve_recorded(name: str | None, record_folder: str | Path) -> str | None:
    """A model name read from a record in ``record_folder``: a relative path (written before
    paths were recorded absolute) that names a model beside the record is that model's absolute
    path; anything else (absolute, a built-in, a hub id, a relative path with nothing there)
    as it is."""
    if not name or name in BUILTIN_MODEL_NAMES or os.path.isabs(os.path.expanduser(name)):
        return name
    beside = Path(record_folder).expanduser() / name
    return os.path.abspath(beside) if _local(beside) else name
