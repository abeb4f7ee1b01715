"""Atomic file output, output checks and the cache root.

Nothing the engine writes may be left half-written when a process is killed or an input
turns out bad: files and folders are written under a temporary name beside their target
and renamed into place only once complete (a rename within one filesystem is atomic).

Temporary names carry the writer's process id (``.<name>.<pid>-<random>.tmp``), so the
leftovers of a killed writer are recognised and removed by the next write of the same
target, and by ``check_output`` when a command starts. Outputs get the permissions the
user's umask asks for (temporary files are created private, then opened up on completion).
A path that cannot be written is found before the work starts (``check_output``) and,
should the disk fill up half-way, reported in one line (``OutputError``), never as a
traceback.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import re
import shutil
import stat
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from filelock import FileLock

from gap_engine.core.errors import CacheError, GapError, OutputError
from gap_engine.core.jsontext import json_text

log = logging.getLogger(__name__)

CACHE_ENV = "GAP_CACHE_DIR"
# Errors that mean "this place cannot be written", reported as OutputError.
_WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG, errno.ENOTDIR, errno.EISDIR}
# What libraries that write through their own code (safetensors, torch) say instead of an errno.
_WRITE_FAILURE_TEXTS = (
    "no space left on device",
    "file too large",
    "disk quota exceeded",
    "read-only file system",
    "pytorchstreamwriter failed writing",  # torch.save's text for a write the OS refused
)
# Temporary names written before they carried a process id are removed once this old.
_LEGACY_TEMP_AGE_SECONDS = 3600
NAME_MAX = 255  # bytes in one file name (Linux, macOS)
# What a temporary adds around its target's name: ".", ".<pid>-<8 random>.tmp" or ".old-<pid>", ".lock".
_TEMP_EXTRA_BYTES = 32


def _read_umask() -> int:
    """The process umask, read without changing it (os.umask would race with other threads)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


# ---- paths a user names ----------------------------------------------------------------------
def user_path(value: str | os.PathLike[str], what: str, error: type[GapError] = OutputError) -> str:
    """``value`` with a leading ``~`` or ``~user`` expanded, checked so no file system call on it
    can fail in a way a command does not expect: every path option and GAP_CACHE_DIR goes
    through here before anything else reads it.

    Args:
        value: the path as given (a command-line value, an environment variable).
        what: how the message names it (``--out``, ``GAP_CACHE_DIR``).
        error: the GapError raised.
    Returns:
        The path, expanded (other values, such as a built-in model name or a hub id, unchanged).
    Raises:
        ``error`` (one line): bytes that are not UTF-8 in the path (the system hands them over as
        they are, and they cannot be written into JSON, the history or a crash report), ``~user``
        for no such user (or ``~`` with no home), a symbolic-link loop on the way, a name past
        NAME_MAX bytes.
    """
    text = os.fspath(value)
    shown = text.encode("utf-8", "backslashreplace").decode("utf-8")[:300]
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise error(f"{what} {shown} holds bytes that are not UTF-8; rename it, or give another path") from None
    if text.startswith("~"):
        expanded = os.path.expanduser(text)
        if expanded.startswith("~"):  # os.path.expanduser leaves what it cannot expand
            user = text[1:].split("/", 1)[0]
            why = f"there is no user named {user!r}" if user else "there is no home folder (HOME is not set)"
            raise error(f"{what} {shown}: {why} to expand the ~; give the full path")
        text = expanded
    try:
        os.stat(text)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise error(f"{what} {shown} runs into a loop of symbolic links; give a path that ends somewhere") from None
        if exc.errno == errno.ENAMETOOLONG:
            raise error(f"{what} {shown[:80]}...: a name in it is longer than the file system allows ({NAME_MAX} bytes)") from None
    except ValueError:  # a NUL byte (only an environment variable can carry one here)
        raise error(f"{what} holds a NUL byte; give a path") from None
    return text


def cache_root() -> Path:
    """The on-disk cache root: $GAP_CACHE_DIR, else ``cache/`` beside the package.

    Raises:
        CacheError: the root is a file, or cannot be created.
    """
    root = os.environ.get(CACHE_ENV)
    path = Path(user_path(root, CACHE_ENV, CacheError)) if root else Path(__file__).resolve().parents[2] / "cache"
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise CacheError(f"the cache root {path} ({CACHE_ENV if root else 'default'}) is a file, not a folder") from None
    except OSError as exc:
        raise CacheError(f"cannot create the cache root {path} ({CACHE_ENV if root else 'default'}): {exc.strerror}") from None
    return path


def temp_stem(name: str) -> str:
    """``name`` as the temporaries and lock beside it spell it: the name itself, or when the name
    and a temporary's own characters would pass NAME_MAX (a legal 255-byte output name), its
    first bytes and a hash of the whole, so every legal name can be written atomically."""
    encoded = os.fsencode(name)
    if len(encoded) + _TEMP_EXTRA_BYTES <= NAME_MAX:
        return name
    digest = hashlib.sha256(encoded).hexdigest()[:16]
    return os.fsdecode(encoded[: NAME_MAX - _TEMP_EXTRA_BYTES - len(digest) - 1]) + "~" + digest


# ---- stale temporaries -----------------------------------------------------------------------
def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, OSError):
        return True  # another user's process, or a value we cannot test: leave it
    return True


def clean_stale(target: str | Path) -> list[Path]:
    """Remove temporaries beside ``target`` that a killed writer of it left behind.

    Only names of our own making are touched: ``.<name>.<pid>-*.tmp`` and ``.<name>.old-<pid>``
    whose process is gone, and the older pid-less ``.<name>.<random>.tmp`` after an hour.

    Returns:
        The paths removed.
    """
    target = Path(target)
    name = re.escape(temp_stem(target.name))
    tagged = re.compile(rf"^\.{name}\.(?:(\d+)-[A-Za-z0-9_]+\.tmp|old-(\d+))$")
    legacy = re.compile(rf"^\.{name}\.[A-Za-z0-9_]{{8}}\.tmp$")
    removed: list[Path] = []
    try:
        siblings = list(target.parent.iterdir()) if target.parent.is_dir() else []
    except OSError:
        return removed
    now = time.time()
    for path in siblings:
        match = tagged.match(path.name)
        try:
            if match:
                stale = not _pid_alive(int(match.group(1) or match.group(2)))
            else:
                stale = bool(legacy.match(path.name)) and now - path.lstat().st_mtime > _LEGACY_TEMP_AGE_SECONDS
            if not stale:
                continue
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
        except OSError:
            continue
        log.info("removed %s, left behind by an interrupted write", path)
        removed.append(path)
    return removed


# ---- special files -------------------------------------------------------------------------------
def special_kind(path: str | Path) -> str | None:
    """'a FIFO', 'a socket', 'a device' for such a path (links followed), else None.

    Opening a FIFO for reading blocks until a writer comes, so anything that reads a file the
    user named (or a file inside a folder the user named) asks this first.
    """
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return None


def refuse_special_files(folder: str | Path, error: type, what: str | None = None) -> None:
    """``error`` (one line) when ``folder`` holds a FIFO, socket or device (one level down)."""
    folder = Path(folder)
    try:
        entries = sorted(folder.iterdir())
    except OSError:
        return  # the reader names the unreadable folder
    for entry in entries:
        kind = special_kind(entry)
        if kind:
            raise error(f"{what or folder}: {entry.name} is {kind}, not a regular file; refusing to read it")


# ---- outputs that are inputs -------------------------------------------------------------------
def _resolved(path: str | Path) -> Path:
    return Path(os.path.abspath(Path(path).expanduser())).resolve()


def check_not_an_input(
    out: str | Path, inputs: Sequence[tuple[str, str | Path]], folder: bool, what: str = "--out", containers: tuple[str, ...] | None = None
) -> None:
    """OutputError when ``out`` is, or lies inside, one of the command's inputs.

    Writing there would replace (or write into) what the command reads, so a table would turn
    into a plan, a checkpoint into its own base. A folder output is also refused when an input
    lies inside it, since the folder is replaced as a whole. Paths are compared resolved, links
    followed.

    Args:
        out: the output path.
        inputs: (flag, input path) pairs, the flag being how the message names it; names that
            are not paths (a built-in model, a hub id) may be passed and are skipped when
            nothing is there.
        folder: True when the output is a folder that replaces what is there.
        containers: the flags whose folders are read as a whole (a model, a checkpoint), so
            an output inside one changes the input; None: every flag. A file flag given a
            folder (``--plan some/folder``) is its reader's error, not this rule's.
    """
    target = _resolved(out)
    for flag, source in inputs:
        if source is None or not str(source).strip():
            continue
        source_path = Path(str(source)).expanduser()
        if not (source_path.exists() or source_path.is_symlink()):
            continue
        source_path = _resolved(source_path)
        if target == source_path:
            raise OutputError(f"{what} {out} is the same path as {flag} {source}; writing it would destroy the input, choose another")
        if target.is_relative_to(source_path) and (containers is None or flag in containers):
            raise OutputError(f"{what} {out} lies inside {flag} {source}; writing there would change the input, choose a path outside it")
        if folder and source_path.is_relative_to(target):
            raise OutputError(f"{what} {out} holds {flag} {source}; replacing the folder would destroy the input, choose another")


# ---- checks before the work starts ----------------------------------------------------------
def check_output(path: str | Path, folder: bool, what: str = "--out") -> Path:
    """OutputError (one line) unless ``path`` can be written as a file (or a folder when ``folder``).

    Called before slow work starts, so an unwritable output is found in a second, not after
    an hour of measuring. Also removes temporaries a killed earlier run left beside it.

    Args:
        path: the output file or folder.
        folder: True when a folder will be written there (it replaces an existing folder).
        what: how the message names the path (a flag, or "the output").
    Returns:
        ``path`` as a Path.
    """
    path = Path(path)
    if not str(path).strip():
        raise OutputError(f"{what} is empty; give a path")
    if path.exists() or path.is_symlink():
        if folder and not path.is_dir():
            raise OutputError(f"{what} {path} is an existing file, not a folder; remove it or choose another path")
        if not folder and path.is_dir():
            raise OutputError(f"{what} {path} is a folder; give a file name")
        if not folder and not path.is_file():
            raise OutputError(f"{what} {path} exists and is not a regular file")
    ancestor = path.parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise OutputError(f"{what} {path} cannot be created: {ancestor} is a file, not a folder")
    refusal = write_refusal(ancestor)
    if refusal:
        raise OutputError(f"{what} {path} cannot be written: {ancestor}: {refusal}")
    clean_stale(path)
    return path


def write_refusal(folder: str | Path) -> str | None:
    """Why a file cannot be created in ``folder`` (the system's words), or None when it can.

    Asks by creating (and removing) an empty probe file: permission bits, read-only mounts,
    ACLs and file systems that refuse new files all answer the same way.
    """
    try:
        fd, probe = tempfile.mkstemp(prefix=f".gap-write-probe.{os.getpid()}-", suffix=".tmp", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        return str(exc.strerror or exc)
    return None


def _output_error(target: Path, exc: OSError) -> OutputError:
    return OutputError(f"cannot write {target}: {exc.strerror or exc}")


def write_failure(target: str | Path, exc: BaseException) -> OutputError | None:
    """The one-line OutputError for an exception that means "the disk said no", else None.

    OSErrors with a write errno (disk full, file too large for ``ulimit -f``, read-only), and the
    same causes wrapped by libraries that write through their own code (safetensors' Rust writer
    raises a SafetensorError whose text holds the OS message).
    """
    if isinstance(exc, OutputError):
        return exc
    if isinstance(exc, OSError) and exc.errno in _WRITE_ERRNOS:
        return _output_error(Path(target), exc)
    text = str(exc).lower()
    for reason in _WRITE_FAILURE_TEXTS:
        if reason in text:
            return OutputError(f"cannot write {target}: {reason[0].upper() + reason[1:]}")
    return None


# numpy's ndarray.tofile (the GGUF writer's tensors) on a write the OS cut short: no errno, only the counts.
_SHORT_WRITE = re.compile(r"^\d+ requested and \d+ written$")


def short_write_cause(written: str | Path, exc: BaseException) -> OSError | None:
    """The system's own error behind a write that stopped short without one (numpy's "3145728
    requested and 687632 written"), or None for any other exception: one more byte appended to
    ``written`` gets it (no space left, a file too large for ``ulimit -f``); a disk that took the
    byte after all is still reported as full."""
    if not (isinstance(exc, OSError) and exc.errno is None and _SHORT_WRITE.match(str(exc).strip())):
        return None
    try:
        fd = os.open(written, os.O_WRONLY | os.O_APPEND)
        try:
            os.write(fd, b"\0")
        finally:
            os.close(fd)
    except OSError as cause:
        if cause.errno in _WRITE_ERRNOS:
            return cause
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


# ---- atomic writes ------------------------------------------------------------------------------
_UMASK = _read_umask()


@contextlib.contextmanager
def atomic_file(path: str | Path) -> Iterator[Path]:
    """Yield a temporary file path beside ``path`` for a writer that opens files itself
    (the GGUF writer); on success it gets the umask's permissions and replaces ``path``.

    The temporary carries the process id like every other (``clean_stale`` knows it). On any
    exception it is removed and ``path`` is untouched; a full disk is one OutputError.
    """
    path = Path(path)
    if path.is_dir():
        raise OutputError(f"cannot write {path}: it is a folder")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        clean_stale(path)
        fd, tmp = tempfile.mkstemp(prefix=f".{temp_stem(path.name)}.{os.getpid()}-", suffix=".tmp", dir=path.parent)
        os.close(fd)
    except OSError as exc:
        raise _output_error(path, exc) from None
    try:
        yield Path(tmp)
        os.chmod(tmp, 0o666 & ~_UMASK)
        os.replace(tmp, path)
    except BaseException as exc:
        cause = short_write_cause(tmp, exc)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        failure = write_failure(path, cause or exc)
        if failure is not None:
            raise failure from None
        raise


def atomic_write_bytes(path: str | Path, data: bytes) -> Path:
    """Write ``data`` to ``path`` under a temporary name, then rename it into place.

    Raises:
        OutputError: the path cannot be written (a folder there, read-only, disk full).
    """
    path = Path(path)
    with atomic_file(path) as tmp:
        try:
            with open(tmp, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
        except OSError as exc:
            raise _output_error(path, exc) from None
    return path


def atomic_write_text(path: str | Path, text: str) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | Path, obj: Any) -> Path:
    return atomic_write_text(path, json_text(obj, str(path), indent=2, sort_keys=False) + "\n")


def _open_up(folder: Path) -> None:
    """Give a finished temporary folder and what it holds the modes the umask asks for."""
    os.chmod(folder, 0o777 & ~_UMASK)
    for root, dirs, files in os.walk(folder):
        for names, mode in ((dirs, 0o777), (files, 0o666)):
            for name in names:
                entry = os.path.join(root, name)
                if not os.path.islink(entry):
                    os.chmod(entry, mode & ~_UMASK)


@contextlib.contextmanager
def atomic_directory(target: str | Path, overwrite: bool = True) -> Iterator[Path]:
    """Yield a fresh temporary folder beside ``target``; on success it replaces ``target``.

    On any exception the temporary folder is removed and ``target`` is untouched.

    Raises:
        OutputError: ``target`` is an existing file (never replaced by a folder), or the
            folder cannot be written (read-only, disk full).
    """
    target = Path(target)
    if target.exists() and not target.is_dir():
        raise OutputError(f"{target} is an existing file, not a folder; remove it or choose another path")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        clean_stale(target)
        tmp = Path(tempfile.mkdtemp(prefix=f".{temp_stem(target.name)}.{os.getpid()}-", suffix=".tmp", dir=target.parent))
    except OSError as exc:
        raise _output_error(target, exc) from None
    try:
        yield tmp
        _open_up(tmp)
        if target.exists():
            if not overwrite:
                raise FileExistsError(f"{target} already exists")
            old = target.with_name(f".{temp_stem(target.name)}.old-{os.getpid()}")
            os.replace(target, old)
            os.replace(tmp, target)
            if old.is_symlink():
                old.unlink()  # the link itself: the folder it pointed at is not ours to remove
            else:
                shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, target)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        failure = None if isinstance(exc, FileExistsError) else write_failure(target, exc)
        if failure is not None:
            raise failure from None
        raise


def lock_for(path: str | Path, timeout: float = -1) -> FileLock:
    """An inter-process lock guarding ``path`` (a sibling ``.lock`` file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return FileLock(str(lock_path(path)), timeout=timeout)


def lock_path(path: str | Path) -> Path:
    """The file behind ``lock_for(path)`` (removed with the thing it guards)."""
    path = Path(path)
    return path.with_name(temp_stem(path.name) + ".lock")
