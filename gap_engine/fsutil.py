"""Atomic file output and the cache root.

Nothing the engine writes may be left half-written when a process is killed or an input
turns out bad: files and folders are written under a temporary name beside their target
and renamed into place only once complete (a rename within one filesystem is atomic).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

from filelock import FileLock

CACHE_ENV = "GAP_CACHE_DIR"


def cache_root() -> Path:
    """The on-disk cache root: $GAP_CACHE_DIR, else ``cache/`` beside the package."""
    root = os.environ.get(CACHE_ENV)
    path = Path(root) if root else Path(__file__).resolve().parent.parent / "cache"
    path.mkdir(parents=True, exist_ok=True)
    return path


def atomic_write_bytes(path: str | Path, data: bytes) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return path


def atomic_write_text(path: str | Path, text: str) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | Path, obj) -> Path:
    return atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


@contextlib.contextmanager
def atomic_directory(target: str | Path, overwrite: bool = True) -> Iterator[Path]:
    """Yield a fresh temporary folder beside ``target``; on success it replaces ``target``.

    On any exception the temporary folder is removed and ``target`` is untouched.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    try:
        yield tmp
        if target.exists():
            if not overwrite:
                raise FileExistsError(f"{target} already exists")
            old = target.with_name(f".{target.name}.old-{os.getpid()}")
            os.replace(target, old)
            os.replace(tmp, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def lock_for(path: str | Path, timeout: float = -1) -> FileLock:
    """An inter-process lock guarding ``path`` (a sibling ``.lock`` file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return FileLock(str(path.with_name(path.name + ".lock")), timeout=timeout)
